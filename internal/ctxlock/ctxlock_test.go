package ctxlock

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLockTakesAFreeMutex(t *testing.T) {
	var mu sync.Mutex
	require.NoError(t, Lock(context.Background(), &mu))
	require.False(t, mu.TryLock(), "the caller holds it")
	mu.Unlock()
}

func TestLockWaitsForTheHolder(t *testing.T) {
	var mu sync.Mutex
	mu.Lock()
	time.AfterFunc(20*time.Millisecond, mu.Unlock)
	require.NoError(t, Lock(context.Background(), &mu))
	mu.Unlock()
}

func TestLockGivesUpWithItsContextAndLeavesTheMutexFree(t *testing.T) {
	var mu sync.Mutex
	mu.Lock()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, Lock(ctx, &mu), context.DeadlineExceeded)
	mu.Unlock()
	// The abandoned waiter takes the lock and hands it back.
	require.Eventually(t, func() bool {
		if mu.TryLock() {
			mu.Unlock()
			return true
		}
		return false
	}, time.Second, time.Millisecond)
}
