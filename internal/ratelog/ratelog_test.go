package ratelog

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestGateLetsTheFirstLineThroughThenOneAnIntervalCountingTheRest(t *testing.T) {
	var g Gate
	const interval = 50 * time.Millisecond
	start := time.Now()
	skipped, ok := g.Allow(interval)
	require.True(t, ok)
	require.Zero(t, skipped)
	held := 0
	for {
		skipped, ok := g.Allow(interval)
		if ok {
			require.GreaterOrEqual(t, time.Since(start), interval)
			require.Equal(t, int64(held), skipped)
			break
		}
		held++
		require.Less(t, time.Since(start), 10*time.Second, "no line let through an interval on")
	}
	require.Positive(t, held)
}

func TestGateLetsOneOfManyConcurrentCallersThrough(t *testing.T) {
	var g Gate
	var through, skipped atomic.Int64
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			if _, ok := g.Allow(time.Hour); ok {
				through.Add(1)
			} else {
				skipped.Add(1)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int64(1), through.Load())
	require.Equal(t, int64(63), skipped.Load())
	require.Equal(t, int64(63), g.skipped.Load())
}
