package picker

import (
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
)

// fakeClock is a settable clock for a picker and its prefetcher.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newPrefetcher(t *testing.T, idx Index, ttl time.Duration, clk *fakeClock) (*Picker, *Prefetcher) {
	t.Helper()
	p := newPicker(t, idx, Config{InflightTTL: ttl, Now: clk.now})
	return p, NewPrefetcher(p, PrefetchConfig{TTL: ttl, Now: clk.now})
}

func TestPrefetchDecidesByPicksRule(t *testing.T) {
	keys := seqKeys(16)
	cases := []struct {
		name      string
		hold      []holding
		threshold int
		state     PrefetchState
		reason    Reason
		source    index.Holder
		gain      int
	}{
		{name: "nobody holds the prefix: nothing to move",
			state: PrefetchNotNeeded, reason: ReasonNoHolder},
		{name: "destination holds it: local hit first",
			hold:  []holding{{dst, index.TierGPU, 0, 16}, {peerA, index.TierCPU, 0, 16}},
			state: PrefetchNotNeeded, reason: ReasonLocalHit},
		{name: "peer holds it in CPU: pull it now",
			hold:  []holding{{peerA, index.TierCPU, 0, 16}},
			state: PrefetchStarted, reason: ReasonPull, source: peerA, gain: 16},
		{name: "destination holds a head: pull only the rest",
			hold:  []holding{{dst, index.TierGPU, 0, 10}, {peerA, index.TierCPU, 0, 16}},
			state: PrefetchStarted, reason: ReasonPull, source: peerA, gain: 6},
		{name: "gain below the threshold: recompute is cheaper",
			hold:      []holding{{dst, index.TierGPU, 0, 14}, {peerA, index.TierCPU, 0, 16}},
			threshold: 3 * DefaultBlockSize,
			state:     PrefetchNotNeeded, reason: ReasonBelowThreshold},
		{name: "peer holds it only on GPU: not pullable",
			hold:  []holding{{peerA, index.TierGPU, 0, 16}},
			state: PrefetchNotNeeded, reason: ReasonNoHolder},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, f := newPrefetcher(t, fleet(keys, tc.hold...), time.Minute, newFakeClock())
			got, err := f.Prefetch(PrefetchRequest{Session: "s", Request: Request{
				Model: model, Keys: keys, Destination: dst, MinCachedTokenDelta: tc.threshold,
			}})
			require.NoError(t, err)
			require.Equal(t, tc.state, got.State)
			require.Equal(t, tc.reason, got.Decision.Reason)
			require.Equal(t, tc.source, got.Decision.Source)
			require.Equal(t, tc.gain, got.Decision.Gain)
			remembered := 0
			if tc.state == PrefetchStarted {
				remembered = 1
			}
			require.Equal(t, remembered, f.Remembered(), "only a started prefetch is remembered")
		})
	}
}

func TestPrefetchBadInput(t *testing.T) {
	keys := seqKeys(4)
	_, f := newPrefetcher(t, fleet(keys), time.Minute, newFakeClock())
	_, err := f.Prefetch(PrefetchRequest{Request: Request{Model: model, Keys: keys, Destination: dst}})
	require.ErrorIs(t, err, ErrNoSession)
	_, err = f.Prefetch(PrefetchRequest{Session: "s", Request: Request{Model: model, Keys: keys}})
	require.ErrorIs(t, err, ErrNoDestination)
	_, err = f.Prefetch(PrefetchRequest{Session: "s", Request: Request{Model: model, Destination: dst}})
	require.ErrorIs(t, err, ErrNoKeys, "no keys and no hasher")
}

func TestPrefetchNeverTwiceForTheSameSessionPrefixAndDestination(t *testing.T) {
	keys := seqKeys(16)
	clk := newFakeClock()
	p, f := newPrefetcher(t, fleet(keys, holding{peerA, index.TierCPU, 0, 16}), time.Minute, clk)
	req := func(session string, dest index.Holder, n int) PrefetchRequest {
		return PrefetchRequest{Session: session, Request: Request{Model: model, Keys: keys[:n], Destination: dest}}
	}
	first, err := f.Prefetch(req("s1", dst, 12))
	require.NoError(t, err)
	require.Equal(t, PrefetchStarted, first.State)
	require.Equal(t, 1, p.Inflight(peerA))

	again, err := f.Prefetch(req("s1", dst, 12))
	require.NoError(t, err)
	require.Equal(t, PrefetchDuplicate, again.State, "in flight")
	require.Equal(t, first.Expires, again.Expires)
	require.Equal(t, 1, p.Inflight(peerA), "a duplicate adds no pull")

	require.True(t, f.Pending("s1", dst))
	require.False(t, f.Pending("s1", peerB))
	first.Complete()
	require.False(t, f.Pending("s1", dst), "completed")
	require.Zero(t, p.Inflight(peerA), "completion releases the source")
	again, err = f.Prefetch(req("s1", dst, 12))
	require.NoError(t, err)
	require.Equal(t, PrefetchDuplicate, again.State, "completed, before the index has heard of it")
	first.Complete()
	first.Cancel()
	require.Zero(t, p.Inflight(peerA), "releasing twice does not go negative")

	for _, other := range []PrefetchRequest{req("s2", dst, 12), req("s1", peerB, 12), req("s1", dst, 16)} {
		got, err := f.Prefetch(other)
		require.NoError(t, err)
		require.Equal(t, PrefetchStarted, got.State, "another session, destination or prefix: %s %v %d", other.Session, other.Destination, len(other.Keys))
	}
	require.Equal(t, 3, p.Inflight(peerA))
}

func TestPrefetchCancelAllowsARetry(t *testing.T) {
	keys := seqKeys(8)
	p, f := newPrefetcher(t, fleet(keys, holding{peerA, index.TierCPU, 0, 8}), time.Minute, newFakeClock())
	req := PrefetchRequest{Session: "s", Request: Request{Model: model, Keys: keys, Destination: dst}}
	first, err := f.Prefetch(req)
	require.NoError(t, err)
	first.Cancel()
	require.Zero(t, p.Inflight(peerA))
	require.Zero(t, f.Remembered())
	retry, err := f.Prefetch(req)
	require.NoError(t, err)
	require.Equal(t, PrefetchStarted, retry.State)
	first.Cancel()
	require.Equal(t, 1, f.Remembered(), "a stale handle does not forget its successor")
	require.Equal(t, 1, p.Inflight(peerA))
}

func TestPrefetchExpires(t *testing.T) {
	keys := seqKeys(8)
	clk := newFakeClock()
	ttl := 8 * time.Second
	p, f := newPrefetcher(t, fleet(keys, holding{peerA, index.TierCPU, 0, 8}), ttl, clk)
	req := PrefetchRequest{Session: "s", Request: Request{Model: model, Keys: keys, Destination: dst}}
	first, err := f.Prefetch(req)
	require.NoError(t, err)
	require.Equal(t, clk.now().Add(ttl), first.Expires)

	clk.advance(ttl - time.Second)
	got, err := f.Prefetch(req)
	require.NoError(t, err)
	require.Equal(t, PrefetchDuplicate, got.State, "a second before expiry")

	require.True(t, f.Pending("s", dst))
	clk.advance(time.Second)
	require.False(t, f.Pending("s", dst), "expired")
	require.Zero(t, f.Remembered(), "forgotten at its expiry")
	require.Zero(t, p.Inflight(peerA), "an expired prefetch no longer counts against its source")
	first.Complete()
	require.Zero(t, p.Inflight(peerA), "completing after expiry does nothing")
	got, err = f.Prefetch(req)
	require.NoError(t, err)
	require.Equal(t, PrefetchStarted, got.State, "decided afresh after expiry")
}

func TestPrefetchIsBounded(t *testing.T) {
	keys := seqKeys(8)
	clk := newFakeClock()
	p := newPicker(t, fleet(keys, holding{peerA, index.TierCPU, 0, 8}), Config{Now: clk.now})
	f := NewPrefetcher(p, PrefetchConfig{TTL: time.Second, MaxEntries: 3, Now: clk.now})
	for i := range 3 {
		_, err := f.Prefetch(PrefetchRequest{Session: fmt.Sprint(i), Request: Request{Model: model, Keys: keys, Destination: dst}})
		require.NoError(t, err)
	}
	_, err := f.Prefetch(PrefetchRequest{Session: "3", Request: Request{Model: model, Keys: keys, Destination: dst}})
	require.ErrorIs(t, err, ErrPrefetchFull)
	clk.advance(time.Second)
	got, err := f.Prefetch(PrefetchRequest{Session: "3", Request: Request{Model: model, Keys: keys, Destination: dst}})
	require.NoError(t, err, "expired entries make room")
	require.Equal(t, PrefetchStarted, got.State)
}

func TestPrefetchWarmupIsAOneTokenCompletionNamingTheSource(t *testing.T) {
	keys := seqKeys(2)
	_, f := newPrefetcher(t, fleet(keys, holding{peerA, index.TierCPU, 0, 2}), time.Minute, newFakeClock())
	got, err := f.Prefetch(PrefetchRequest{Session: "s", Request: Request{Model: model, Keys: keys, Destination: dst}})
	require.NoError(t, err)
	tokens := make([]uint32, 2*DefaultBlockSize+3)
	_, err = got.Warmup("m", tokens[:2*DefaultBlockSize-1], "", "kv-1")
	require.ErrorIs(t, err, ErrWarmupTokens)
	w, err := got.Warmup("m", tokens, "salt", "kv-1")
	require.NoError(t, err)
	b, err := json.Marshal(w)
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m))
	require.Equal(t, 1.0, m["max_tokens"])
	require.Equal(t, "salt", m["cache_salt"])
	require.Len(t, m["prompt"], len(tokens))
	require.Equal(t, map[string]any{"remote_kv_source": map[string]any{
		"kv_request_id": "kv-1", "remote_host": "10.0.0.2", "remote_port": float64(DefaultP2PPort),
	}}, m["kv_transfer_params"])
}

// TestPrefetchConcurrentIsRaceFreeAndCountsOnce runs prefetches, duplicates,
// completions, cancels and picks at once over a real index, then checks the
// sources count exactly the prefetches left open.
func TestPrefetchConcurrentIsRaceFreeAndCountsOnce(t *testing.T) {
	keys := seqKeys(16)
	b := fleet(keys, holding{peerA, index.TierCPU, 0, 16}, holding{peerB, index.TierCPU, 0, 16})
	clk := newFakeClock()
	p, f := newPrefetcher(t, toIndex(b, keys), time.Hour, clk)
	const workers, sessions = 8, 50
	var (
		mu      sync.Mutex
		started = map[string]int{}
		open    []Prefetch
		wg      sync.WaitGroup
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for s := range sessions {
				got, err := f.Prefetch(PrefetchRequest{Session: fmt.Sprint(s), Request: Request{Model: model, Keys: keys, Destination: dst}})
				if err != nil {
					t.Error(err)
					return
				}
				d, err := p.Pick(Request{ID: fmt.Sprint(w, s), Model: model, Keys: keys, Destination: dst})
				if err != nil {
					t.Error(err)
					return
				}
				d.Done()
				if got.State != PrefetchStarted {
					continue
				}
				mu.Lock()
				started[got.Session]++
				mu.Unlock()
				switch s % 3 {
				case 0:
					got.Complete()
				case 1:
					got.Cancel()
				default:
					mu.Lock()
					open = append(open, got)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	for s := range sessions {
		// A cancelled session may be prefetched again by a later worker;
		// the others exactly once.
		if s%3 != 1 {
			require.Equal(t, 1, started[fmt.Sprint(s)], "session %d", s)
		}
	}
	require.Equal(t, len(open), p.Inflight(peerA)+p.Inflight(peerB))
	for _, pf := range open {
		pf.Complete()
	}
	require.Zero(t, p.Inflight(peerA)+p.Inflight(peerB))
}
