package index

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestConcurrentIngestAndLookups runs one writer per holder, churning
// chains (growing tables, breaking and repairing links, clearing tiers),
// against readers. Each holder also holds a stable chain nobody touches:
// every concurrent lookup of it must be exact. When writers stop, the index
// must equal the union of the writers' own models.
func TestConcurrentIngestAndLookups(t *testing.T) {
	const holders = 6
	d := 1500 * time.Millisecond
	if testing.Short() {
		d = 300 * time.Millisecond
	}
	ix := New(Config{MaxHolderBlocks: -1})
	stable := make([][]uint64, holders)
	hs := make([]Holder, holders)
	for i := range hs {
		hs[i] = Holder{Pod: fmt.Sprintf("pod-%d", i%3), Rank: i / 3}
		stable[i] = chain(uint64(1_000_000+i), 300)
		ix.Store("m", hs[i], TierGPU, 0, 0, false, stable[i])
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	refs := make([]*brute, holders)
	for w := range holders {
		refs[w] = newBrute()
		refs[w].store("m", hs[w], TierGPU, 0, stable[w])
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			u := &universe{rng: rng, roots: []uint64{1, 2, 3}}
			ref := refs[w]
			h := hs[w]
			for !stop.Load() {
				p := u.path(1 + rng.IntN(200))
				tier := []string{TierGPU, TierCPU}[rng.IntN(2)]
				switch r := rng.IntN(100); {
				case r < 50:
					a := rng.IntN(len(p))
					var parent uint64
					if a > 0 {
						parent = p[a-1]
					}
					ix.Store("m", h, tier, 0, parent, a > 0, p[a:])
					ref.store("m", h, tier, 0, p[a:])
				case r < 97:
					var ks []uint64
					for _, k := range p {
						if rng.IntN(2) == 0 {
							ks = append(ks, k)
						}
					}
					ix.Remove("m", h, tier, 0, ks)
					ref.remove("m", h, tier, 0, ks)
				default:
					ix.ClearHolder("m", h, TierCPU)
					ref.clear("m", h, TierCPU)
				}
			}
		})
	}
	var lookups atomic.Int64
	for r := range 2 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(r), 9))
			u := &universe{rng: rng, roots: []uint64{1, 2, 3}}
			var res Result
			for !stop.Load() {
				i := rng.IntN(holders)
				ix.Lookup("m", stable[i], &res)
				hit := res.Holder(hs[i])
				if hit == nil || hit.Prefix != 300 || hit.Tier(TierGPU) != 300 || len(res.Hits) != 1 {
					t.Errorf("stable chain of %v: got %+v", hs[i], res.Hits)
					return
				}
				q := u.path(1 + rng.IntN(200))
				ix.Lookup("m", q, &res)
				for _, h := range res.Hits {
					if h.Prefix > len(q) || h.Tier(TierGPU) > h.Prefix || h.Tier(TierCPU) > h.Prefix {
						t.Errorf("impossible hit %+v for %d keys", h, len(q))
						return
					}
				}
				lookups.Add(1)
			}
		})
	}
	time.Sleep(d)
	stop.Store(true)
	wg.Wait()
	require.Positive(t, lookups.Load())

	all := newBrute()
	for _, ref := range refs {
		for h, tiers := range ref.held["m"] {
			for tier, set := range tiers {
				for k := range set {
					all.store("m", h, tier, 0, []uint64{k})
				}
			}
		}
	}
	require.Equal(t, all.total(), ix.Stats().HolderBlocks)
	rng := rand.New(rand.NewPCG(5, 5))
	u := &universe{rng: rng, roots: []uint64{1, 2, 3}}
	var res Result
	for range 300 {
		q := u.path(1 + rng.IntN(200))
		ix.Lookup("m", q, &res)
		require.Equal(t, all.lookup("m", q), hitsByHolder(&res))
	}
}
