package notify

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Every waiter sees the condition become true, not just one of them.
func TestBroadcastWakesEveryWaiter(t *testing.T) {
	var n Notifier
	var v atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			errs <- n.Await(ctx, func() bool { return v.Load() >= 3 })
		}()
	}
	require.Eventually(t, func() bool { return n.waiters.Load() == 16 }, 10*time.Second, time.Millisecond)
	for range 3 {
		v.Add(1)
		n.Broadcast()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

func TestAwaitReturnsTheContextsError(t *testing.T) {
	var n Notifier
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, n.Await(ctx, func() bool { return false }), context.Canceled)
	require.NoError(t, n.Await(ctx, func() bool { return true }), "a condition already true needs no broadcast")
}
