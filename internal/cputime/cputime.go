// Package cputime reads CPU time, of the calling thread and of the
// process, for benchmarks on a shared machine: work per CPU second (or CPU
// per operation) besides per wall second, which also counts the time other
// processes held the CPU. Where a clock is missing it reads zero, and
// callers report no CPU figure.
package cputime
