package cputime

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestClocksAdvanceWithWorkDone(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the thread clock is Linux's")
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	t0, p0 := Thread(), Process()
	x := uint64(1)
	for start := time.Now(); time.Since(start) < 20*time.Millisecond; {
		x = x*6364136223846793005 + 1
	}
	require.NotZero(t, x)
	require.Greater(t, Thread()-t0, time.Millisecond)
	require.Greater(t, Process()-p0, time.Millisecond)
}
