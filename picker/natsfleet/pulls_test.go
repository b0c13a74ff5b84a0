package natsfleet

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// hotIndex holds one hot prefix on four equally good holders, in the CPU
// tier P2P pulls are served from.
func hotIndex(keys []uint64, holders []index.Holder) *index.Index {
	ix := index.New(index.Config{})
	for _, h := range holders {
		ix.Store(index.Blocks{Model: "m", Holder: h, Tier: index.TierCPU, Keys: keys})
	}
	return ix
}

func spread(counts map[index.Holder]int, holders []index.Holder) (lo, hi int) {
	lo = 1 << 30
	for _, h := range holders {
		lo, hi = min(lo, counts[h]), max(hi, counts[h])
	}
	return lo, hi
}

func TestThreeReplicasSpreadPullsAsOnePickerWould(t *testing.T) {
	env := startNATS(t)
	keys := make([]uint64, 32)
	for i := range keys {
		keys[i] = uint64(9000 + i)
	}
	holders := []index.Holder{{Pod: "10.0.9.1:8000"}, {Pod: "10.0.9.2:8000"}, {Pod: "10.0.9.3:8000"}, {Pod: "10.0.9.4:8000"}}
	dst := index.Holder{Pod: "10.0.9.9:8000"}
	const replicas, rounds = 3, 40

	type rep struct {
		p *picker.Picker
		f *Pulls
	}
	var rs []rep
	for i := range replicas {
		_, js := env.connect(t)
		f, err := NewPulls(context.Background(), PullsConfig{JetStream: js, Name: fmt.Sprintf("r%d", i)})
		require.NoError(t, err)
		runUntilCleanup(t, func(ctx context.Context) { require.NoError(t, f.Run(ctx)) })
		p, err := picker.New(picker.Config{Index: hotIndex(keys, holders), Fleet: f})
		require.NoError(t, err)
		rs = append(rs, rep{p, f})
	}
	// Each round the three replicas pick at once, for requests of their
	// own; then the round's pulls reach every replica (a few ms on a LAN)
	// before the next.
	total := map[index.Holder]int{}
	for round := range rounds {
		var wg sync.WaitGroup
		got := make([]index.Holder, replicas)
		for i, r := range rs {
			wg.Go(func() {
				d, err := r.p.Pick(picker.Request{ID: fmt.Sprintf("r%d-%d", i, round), Model: "m", Keys: keys, Destination: dst})
				require.NoError(t, err)
				require.Equal(t, picker.ReasonPull, d.Reason)
				got[i] = d.Source
			})
		}
		wg.Wait()
		for _, h := range got {
			total[h]++
		}
		n := (round + 1) * replicas
		require.Eventually(t, func() bool {
			for _, r := range rs {
				if r.f.Stats().Remote != n-(round+1) {
					return false
				}
			}
			return true
		}, waitLong, time.Millisecond)
	}
	// Every replica's view of each holder's load is the fleet's.
	for _, r := range rs {
		for _, h := range holders {
			require.Equal(t, total[h], r.p.Inflight(h)+r.f.Inflight(h))
		}
	}

	// The same number of picks by one picker, and by three pickers that
	// do not share their pulls.
	one, err := picker.New(picker.Config{Index: hotIndex(keys, holders)})
	require.NoError(t, err)
	single := map[index.Holder]int{}
	for i := range replicas * rounds {
		d, err := one.Pick(picker.Request{ID: fmt.Sprintf("one-%d", i), Model: "m", Keys: keys, Destination: dst})
		require.NoError(t, err)
		single[d.Source]++
	}
	alone := map[index.Holder]int{}
	for range replicas {
		p, err := picker.New(picker.Config{Index: hotIndex(keys, holders)})
		require.NoError(t, err)
		for round := range rounds {
			// Each replica's requests start alike: the shared system
			// prompt's burst, the case that converges without sharing.
			d, err := p.Pick(picker.Request{ID: fmt.Sprintf("burst-%d", round), Model: "m", Keys: keys, Destination: dst})
			require.NoError(t, err)
			alone[d.Source]++
		}
	}
	flo, fhi := spread(total, holders)
	slo, shi := spread(single, holders)
	alo, ahi := spread(alone, holders)
	t.Logf("in flight per holder, %d pulls: three replicas sharing %v (min %d, max %d); one picker %v (min %d, max %d); three replicas not sharing, same requests %v (min %d, max %d)",
		replicas*rounds, slices.Collect(mapValues(total, holders)), flo, fhi, slices.Collect(mapValues(single, holders)), slo, shi,
		slices.Collect(mapValues(alone, holders)), alo, ahi)
	// Within a round the three picks are concurrent and see the same
	// counts, as any uncoordinated replicas would; across rounds each sees
	// the fleet's. One picker's spread plus a round's worth of collisions
	// per side bounds it.
	require.LessOrEqual(t, fhi-flo, shi-slo+2*replicas, "sharing spreads about as evenly as one picker")
}

func mapValues(m map[index.Holder]int, keys []index.Holder) func(func(int) bool) {
	return func(yield func(int) bool) {
		for _, k := range keys {
			if !yield(m[k]) {
				return
			}
		}
	}
}

// Made-up pulls, as anyone with a replica's credentials can write them,
// leave nothing behind once their TTL passes, and a pull whose pod name
// no holder can have (a 4,000-byte one) is not counted at all.
func TestPullsForgetsMadeUpPullsWithTheirTTLAndRefusesLongPodNames(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	f, err := NewPulls(context.Background(), PullsConfig{JetStream: js, Name: "victim", TTL: time.Second})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = f.Run(ctx) })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, natsstream.DefaultStream+"_PULLS")
	require.NoError(t, err)

	const valid, long = 200, 100
	for i := range valid {
		_, err := kv.Put(ctx, fmt.Sprintf("evil.%d", i), fmt.Appendf(nil, "0|10.1.%d.%d:8000", i/256, i%256))
		require.NoError(t, err)
	}
	for i := range long {
		_, err := kv.Put(ctx, fmt.Sprintf("evil.long-%d", i), fmt.Appendf(nil, "0|%s-%d:8000", strings.Repeat("a", 4000), i))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return f.Stats().Remote == valid }, 10*time.Second, time.Millisecond)
	require.Equal(t, valid, f.counts.Size())
	require.Equal(t, 1, f.Inflight(index.Holder{Pod: "10.1.0.7:8000"}))
	require.Eventually(t, func() bool { return f.Stats().Malformed == long }, 10*time.Second, time.Millisecond)

	// Past the TTL, no holder is left in the counts.
	require.Eventually(t, func() bool { return f.Stats().Remote == 0 }, 10*time.Second, 10*time.Millisecond)
	require.Zero(t, f.counts.Size(), "holders of expired pulls are left in the counts")
	require.Zero(t, f.Inflight(index.Holder{Pod: "10.1.0.7:8000"}))
}

func TestPullsCountsAtMostMaxRemotePulls(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	f, err := NewPulls(context.Background(), PullsConfig{JetStream: js, Name: "victim", MaxRemote: 10})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = f.Run(ctx) })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, natsstream.DefaultStream+"_PULLS")
	require.NoError(t, err)
	for i := range 15 {
		_, err := kv.Put(ctx, fmt.Sprintf("other.%d", i), []byte("0|10.1.0.1:8000"))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return f.Stats().OverCap == 5 }, 10*time.Second, time.Millisecond)
	require.Equal(t, 10, f.Stats().Remote)
	require.Equal(t, 10, f.Inflight(index.Holder{Pod: "10.1.0.1:8000"}))
}
