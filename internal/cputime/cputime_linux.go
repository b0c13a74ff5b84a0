package cputime

import (
	"syscall"
	"time"
	"unsafe"
)

// Thread is the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID); lock
// the goroutine to its thread around what it measures.
func Thread() time.Duration {
	const clockThreadCPUTimeID = 3
	var ts syscall.Timespec
	if _, _, e := syscall.RawSyscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTimeID, uintptr(unsafe.Pointer(&ts)), 0); e != 0 {
		return 0
	}
	return time.Duration(ts.Nano())
}
