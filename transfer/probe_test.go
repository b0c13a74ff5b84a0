package transfer_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
	"github.com/kvsource/kvsource/transfer/fake"
)

func fleet(t *testing.T, cfg fake.Config, held int) (*fake.Network, transfer.Session, []transfer.Key) {
	t.Helper()
	n := fake.New(cfg)
	ks := make([]transfer.Key, 8)
	for i := range ks {
		ks[i] = transfer.KeyFromUint64(uint64(i+1), 0)
	}
	n.AddPeer("p").Hold(ks[:held]...)
	s, err := n.Client(nil).Connect(context.Background(), "p")
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return n, s, ks
}

func TestPrefixCountsLeadingHits(t *testing.T) {
	tests := []struct {
		hits []bool
		want int
	}{
		{nil, 0}, {[]bool{false, true}, 0}, {[]bool{true, true, false, true}, 2}, {[]bool{true, true}, 2},
	}
	for _, tt := range tests {
		require.Equal(t, tt.want, transfer.Prefix(tt.hits), "%v", tt.hits)
	}
}

func TestProbeReportsHitsAndReleasesThePins(t *testing.T) {
	n, s, ks := fleet(t, fake.Config{}, 5)
	r, err := transfer.Probe(context.Background(), s, ks)
	require.NoError(t, err)
	require.Equal(t, 5, r.Prefix)
	require.Equal(t, []bool{true, true, true, true, true, false, false, false}, r.Hits)
	require.Equal(t, uint64(1), n.Stats().EmptyFetches, "the request was ended")
	_, err = s.Fetch(context.Background(), ks[:1], []int{0})
	require.ErrorIs(t, err, transfer.ErrMissingKeys, "no pin survives the probe")
}

func TestProbeOfALostPeerFails(t *testing.T) {
	n, s, ks := fleet(t, fake.Config{}, 5)
	n.Peer("p").SetFaults(fake.Faults{Unreachable: true})
	_, err := transfer.Probe(context.Background(), s, ks)
	require.ErrorIs(t, err, transfer.ErrPeerLost)
}

// stepClock is a virtual clock the fake charges and the measurement reads.
type stepClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *stepClock) Sleep(ctx context.Context, d time.Duration) error {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
	return ctx.Err()
}

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func TestMeasurePullTimesLookupPlusFetchPerSize(t *testing.T) {
	clk := &stepClock{now: time.Unix(0, 0)}
	// 1 ms per call, 1 ms per block.
	n, s, ks := fleet(t, fake.Config{BlockLen: 1000, Latency: time.Millisecond, Bandwidth: 1e6, Sleep: clk.Sleep}, 8)
	samples, err := transfer.MeasurePull(context.Background(), s, ks, []int{0, 1, 2, 3, 4, 5, 6, 7},
		transfer.PullPlan{TokensPerKey: 32, Now: clk.Now})
	require.NoError(t, err)
	require.Equal(t, []transfer.Sample{
		{Tokens: 32, Blocks: 1, Millis: 3},
		{Tokens: 64, Blocks: 2, Millis: 4},
		{Tokens: 128, Blocks: 4, Millis: 6},
		{Tokens: 256, Blocks: 8, Millis: 10},
	}, samples)
	require.Equal(t, uint64(15), n.Stats().Blocks)
}

func TestMeasurePullRepeatsEachSize(t *testing.T) {
	_, s, ks := fleet(t, fake.Config{}, 8)
	samples, err := transfer.MeasurePull(context.Background(), s, ks[:3], []int{0, 1, 2}, transfer.PullPlan{Sizes: []int{3}, Repeats: 2})
	require.NoError(t, err)
	require.Len(t, samples, 2)
	for _, sm := range samples {
		require.Equal(t, 48, sm.Tokens, "16 tokens per key by default")
	}
}

func TestMeasurePullStopsAtAMissAndEndsTheRequest(t *testing.T) {
	n, s, ks := fleet(t, fake.Config{}, 3)
	samples, err := transfer.MeasurePull(context.Background(), s, ks, []int{0, 1, 2, 3, 4, 5, 6, 7}, transfer.PullPlan{})
	require.ErrorIs(t, err, transfer.ErrMissingKeys)
	require.Len(t, samples, 2, "sizes 1 and 2 were pulled before size 4 missed")
	require.Equal(t, uint64(1), n.Stats().EmptyFetches)
}

func TestMeasurePullRejectsBadPlans(t *testing.T) {
	_, s, ks := fleet(t, fake.Config{}, 8)
	_, err := transfer.MeasurePull(context.Background(), s, ks, []int{0}, transfer.PullPlan{})
	require.ErrorIs(t, err, transfer.ErrInvalid)
	_, err = transfer.MeasurePull(context.Background(), s, ks[:2], []int{0, 1}, transfer.PullPlan{Sizes: []int{3}})
	require.ErrorIs(t, err, transfer.ErrInvalid)
	_, err = transfer.MeasurePull(context.Background(), s, ks[:2], []int{0, 1}, transfer.PullPlan{Sizes: []int{0}})
	require.ErrorIs(t, err, transfer.ErrInvalid)
}
