//go:build race

package index

// raceEnabled shrinks randomised tests under the race detector, which runs
// them ten times slower; the stress test is what race runs are for.
const raceEnabled = true
