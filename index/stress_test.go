package index

import (
	"fmt"
	"math/rand/v2"
	"slices"
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
	// With shared, the holders' chains start with common blocks, whose
	// entries their writers change concurrently.
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprintf("shared %v", shared), func(t *testing.T) { concurrentIngestAndLookups(t, shared) })
	}
}

func concurrentIngestAndLookups(t *testing.T, shared bool) {
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
		ix.Store(Blocks{Model: "m", Holder: hs[i], Tier: TierGPU, Keys: stable[i]})
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
					if shared && rng.IntN(2) == 0 {
						// From the root, where blocks enter the layer.
						a = 0
					}
					var parent uint64
					if a > 0 {
						parent = p[a-1]
					}
					ix.Store(Blocks{Model: "m", Holder: h, Tier: tier, Parent: parentIf(a > 0, parent), Keys: p[a:]})
					ref.store("m", h, tier, 0, p[a:])
				case r < 97:
					ks := scattered(rng, p, 2)
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
	checkInvariants(t, ix, 0)
	st := ix.Stats()
	t.Logf("%d holdings, %d shared blocks", st.HolderBlocks, st.SharedBlocks)
}

// TestConcurrentLookupsSeeOnlyRealPrefixes toggles single blocks of a
// held chain p (opening and closing gaps while lookups search it) and
// churns the same table (growing it, listing more gaps than lookups check,
// then fewer). A lookup of p must end at a toggled block or at p's end:
// anywhere else, a held block was missed or a torn read misplaced one. A
// lookup of q must end at z, which no write ever holds.
func TestConcurrentLookupsSeeOnlyRealPrefixes(t *testing.T) {
	d := time.Second
	if testing.Short() {
		d = 200 * time.Millisecond
	}
	ix := New(Config{MaxHolderBlocks: -1})
	p := chain(42, 512)
	toggles := []int{37, 100, 101, 200, 300, 450}
	ends := append(slices.Clone(toggles), len(p))
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: p})
	// z is never held; its children come and go, so it is a gap that
	// opens while lookups that listed the gaps before search past it.
	q, z := chain(43, 64), 40
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: q[:z]})
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		for !stop.Load() {
			ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Parent: ParentKey(q[z]), Keys: q[z+1:]})
			ix.Remove("m", podA, TierGPU, 0, q[z+1:])
		}
	})
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(1, 1))
		u := &universe{rng: rng, roots: []uint64{5, 6, 7}}
		for !stop.Load() {
			i := toggles[rng.IntN(len(toggles))]
			ix.Remove("m", podA, TierGPU, 0, p[i:i+1])
			other := u.path(1 + rng.IntN(100))
			if rng.IntN(2) == 0 {
				ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: other})
			} else {
				ix.Remove("m", podA, TierGPU, 0, scattered(rng, other, 2))
			}
			ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Parent: parentIf(rng.IntN(2) == 0, p[i-1]), Keys: p[i : i+1]})
		}
	})
	var lookups atomic.Int64
	for r := range 2 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(r), 3))
			var res Result
			for !stop.Load() {
				ix.Lookup("m", p, &res)
				got := 0
				if h := res.Holder(podA); h != nil {
					got = h.Prefix
				}
				if !slices.Contains(ends, got) {
					t.Errorf("prefix %d, not at a toggled block", got)
					return
				}
				ix.Lookup("m", q, &res)
				if h := res.Holder(podA); h == nil || h.Prefix != z {
					t.Errorf("prefix through the unheld block %d: %+v", z, h)
					return
				}
				s := rng.IntN(len(p))
				n := ix.Run("m", podA, p, s, nil)
				if !slices.Contains(ends, s+n) && (n > 0 || !slices.Contains(toggles, s)) {
					t.Errorf("run from %d of %d blocks, not to a toggled block", s, n)
					return
				}
				lookups.Add(1)
			}
		})
	}
	time.Sleep(d)
	stop.Store(true)
	wg.Wait()
	require.Positive(t, lookups.Load())
}
