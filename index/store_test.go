package index

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBlocksManyHoldersHoldAreStoredOnce(t *testing.T) {
	ix := New(Config{MaxHolderBlocks: -1})
	system := chain(5, 48)
	var hs []Holder
	for i := range 6 {
		h := Holder{Pod: fmt.Sprintf("10.6.0.%d:8000", i)}
		hs = append(hs, h)
		// Each holder's own blocks continue the system prompt.
		own := append(append([]uint64{}, system...), make([]uint64, 16)...)
		for j := 48; j < len(own); j++ {
			own[j] = chainKey(own[j-1], 10+i)
		}
		for j := 0; j < len(own); j += 16 {
			ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Parent: parentIf(j > 0, own[max(j-1, 0)]), Keys: own[j : j+16]})
		}
		checkInvariants(t, ix, i)
	}
	s := ix.Stats()
	require.Equal(t, int64(48), s.SharedBlocks, "the system prompt has six holders, nobody's own blocks more than one")
	require.Equal(t, int64(48+6*16), ix.model("m", false).entries.Load(), "each block kept once")
	require.Equal(t, int64(6*64), s.HolderBlocks)
	for _, h := range hs {
		require.Equal(t, map[string]int{TierGPU: 64}, ix.HolderBlocks("m", h))
	}
	var res Result
	ix.Lookup("m", system, &res)
	require.Len(t, res.Hits, 6)
	for _, hit := range res.Hits {
		require.Equal(t, 48, hit.Prefix)
		require.Equal(t, []TierPrefix{{TierGPU, 48}}, hit.Tiers)
	}
	require.ElementsMatch(t, hs, ix.Holders("m", system[20], nil))
	require.ElementsMatch(t, hs, ix.HoldersAt("m", system, 47, nil))

	// Removing the system prompt from all but two holders keeps it for
	// them, then frees it.
	for i, h := range hs {
		ix.Remove("m", h, TierGPU, 0, system[40:])
		if i >= 4 {
			continue
		}
		ix.Remove("m", h, TierGPU, 0, system[:40])
	}
	checkInvariants(t, ix, 100)
	ix.Lookup("m", system, &res)
	require.Len(t, res.Hits, 2)
	require.Equal(t, 40, res.Hits[0].Prefix)
	for _, h := range hs[4:] {
		ix.ClearHolder("m", h, "")
	}
	checkInvariants(t, ix, 101)
	require.Empty(t, ix.Holders("m", system[0], nil))
	// The removed holdings' queue places keep their entries until their
	// queues drop them: with their holders here.
	for _, h := range hs[:4] {
		ix.RemoveHolder(h)
	}
	checkInvariants(t, ix, 102)
	require.Zero(t, ix.Stats().SharedBlocks)
	require.Zero(t, ix.model("m", false).entries.Load())
}

func TestSharedBlocksKeepTheirHoldersEvictionOrder(t *testing.T) {
	// Holders at capacity evict oldest first, whether another holder
	// stored their blocks before them or after.
	ix := New(Config{HolderCapacity: 64, MaxHolderBlocks: -1})
	a, b := Holder{Pod: "10.7.0.1:8000"}, Holder{Pod: "10.7.0.2:8000"}
	old, shared, fresh := chain(1, 32), chain(2, 32), chain(3, 32)
	ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: old})
	ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: shared})
	ix.Store(Blocks{Model: "m", Holder: b, Tier: TierGPU, Keys: shared})
	require.Equal(t, int64(32), ix.Stats().SharedBlocks)
	checkInvariants(t, ix, 0)
	ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: fresh[:16]})
	checkInvariants(t, ix, 1)
	require.Zero(t, ix.Run("m", a, old, 0, nil), "a's oldest blocks go first")
	require.Equal(t, 32, ix.Run("m", a, shared, 0, nil))
	ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: fresh[16:]})
	checkInvariants(t, ix, 2)
	require.Equal(t, 32, ix.Run("m", a, fresh, 0, nil))
	require.Equal(t, 32, ix.Run("m", a, shared, 0, nil), "next oldest: the shared blocks")
	ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: chain(4, 8)})
	checkInvariants(t, ix, 3)
	require.Zero(t, ix.Run("m", a, shared, 0, nil), "the first shared blocks, then the rest, by the time they became a's")
	require.Equal(t, 24, ix.Run("m", a, shared, 8, nil))
	require.Equal(t, 32, ix.Run("m", b, shared, 0, nil), "b keeps them")
}

func TestSnapshotKeepsSharedBlocksShared(t *testing.T) {
	ix := New(Config{MaxHolderBlocks: -1})
	p := chain(9, 40)
	for i := range 4 {
		h := Holder{Pod: fmt.Sprintf("10.8.0.%d:8000", i)}
		ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: p[:20]})
		ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Group: 1, Parent: ParentKey(p[19]), Keys: p[20 : 30+i]})
		ix.Store(Blocks{Model: "m", Holder: h, Tier: TierCPU, Keys: p[:10]})
	}
	ix.Store(Blocks{Model: "m", Holder: Holder{Pod: "10.8.0.0:8000"}, Tier: TierGPU, Group: 3, Keys: p[:5]})
	before := ix.Stats()
	require.Positive(t, before.SharedBlocks)
	path := filepath.Join(t.TempDir(), "index.snap")
	require.NoError(t, ix.SaveFile(path, nil))
	loaded, _, err := LoadFile(path, Config{MaxHolderBlocks: -1})
	require.NoError(t, err)
	checkInvariants(t, loaded, 0)
	after := loaded.Stats()
	require.Equal(t, before.HolderBlocks, after.HolderBlocks)
	require.Equal(t, before.SharedBlocks, after.SharedBlocks)
	var r1, r2 Result
	ix.Lookup("m", p, &r1)
	loaded.Lookup("m", p, &r2)
	require.Equal(t, hitsByHolder(&r1), hitsByHolder(&r2))
	// Group 3 of the first blocks outlives group 0's removal.
	h0 := Holder{Pod: "10.8.0.0:8000"}
	loaded.Remove("m", h0, TierGPU, 0, p[:20])
	require.Equal(t, 5, loaded.Run("m", h0, p, 0, []string{TierGPU}))
	checkInvariants(t, loaded, 1)
}

// TestReadersSeeBlocksWhileTheirHolderSetsChangeForm has readers follow
// holders whose blocks other holders' stores and removals turn from one
// inline holder into a small set, a large one and back, block by block:
// every Lookup, Run, Holders and HoldersAt must see them held throughout.
func TestReadersSeeBlocksWhileTheirHolderSetsChangeForm(t *testing.T) {
	// Under -race 300 holders took 11 s on 2 loaded cores, the two readers
	// spinning beside the writer; fewer move as many blocks each.
	holders := sized(300, 80)
	const n = 48
	ix := New(Config{MaxHolderBlocks: -1})
	chains := make([][]uint64, holders)
	xs := make([]Holder, holders)
	for i := range holders {
		chains[i] = chain(uint64(1000+i), n)
		xs[i] = Holder{Pod: fmt.Sprintf("10.12.%d.%d:8000", i/256, i%256)}
		ix.Store(Blocks{Model: "m", Holder: xs[i], Tier: TierGPU, Keys: chains[i]})
	}
	var moving atomic.Int64
	var stop atomic.Bool
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(r), 1))
			var res Result
			var dst []Holder
			for !stop.Load() {
				i := min(holders-1, int(moving.Load())+rng.IntN(2))
				x, c := xs[i], chains[i]
				ix.Lookup("m", c, &res)
				if hit := res.Holder(x); hit == nil || hit.Prefix != n || hit.Tier(TierGPU) != n {
					t.Errorf("lookup of chain %d: %+v", i, hit)
					return
				}
				if got := ix.Run("m", x, c, 0, nil); got != n {
					t.Errorf("run of chain %d: %d", i, got)
					return
				}
				j := rng.IntN(n)
				if dst = ix.HoldersAt("m", c, j, dst); !slices.Contains(dst, x) {
					t.Errorf("holders of block %d of chain %d: %v", j, i, dst)
					return
				}
				if dst = ix.Holders("m", c[j], dst); !slices.Contains(dst, x) {
					t.Errorf("holders of block %d of chain %d: %v", j, i, dst)
					return
				}
			}
		})
	}
	y := Holder{Pod: "10.12.9.9:8000"}
	crowd := make([]Holder, largeMin+8)
	for i := range crowd {
		crowd[i] = Holder{Pod: fmt.Sprintf("10.13.%d.%d:8000", i/256, i%256)}
	}
	sawLarge := false
	for i := range holders {
		moving.Store(int64(i))
		for j := range n {
			b := Blocks{Model: "m", Holder: y, Tier: TierGPU, Keys: chains[i][j : j+1]}
			if j > 0 {
				b.Parent = ParentKey(chains[i][j-1])
			}
			ix.Store(b)
		}
		if i%16 == 0 {
			// A crowd past largeMin, then gone: small, large, small again.
			for _, h := range crowd {
				ix.Store(Blocks{Model: "m", Holder: h, Tier: TierCPU, Keys: chains[i]})
			}
			if v, _ := ix.model("m", false).view(chains[i][0]); v.set != nil && v.set.large() {
				sawLarge = true
			}
			for _, h := range crowd {
				ix.Remove("m", h, TierCPU, 0, chains[i])
			}
		}
	}
	stop.Store(true)
	wg.Wait()
	require.True(t, sawLarge, "no set became large")
	checkInvariants(t, ix, 0)
	for _, h := range crowd {
		ix.RemoveHolder(h)
	}
	require.Equal(t, int64(holders*n), ix.Stats().SharedBlocks)
	checkInvariants(t, ix, 1)
}

// TestAHolderIDReusedMeanwhileIsNotCreditedWithItsPredecessorsBlocks
// removes holders of a shared chain while others take their layer ids:
// a lookup that read an id before it changed hands must not report its
// new holder with the old one's blocks.
func TestAHolderIDReusedMeanwhileIsNotCreditedWithItsPredecessorsBlocks(t *testing.T) {
	ix := New(Config{MaxHolderBlocks: -1})
	c, d := chain(1, 32), chain(2, 32)
	ix.Store(Blocks{Model: "m", Holder: Holder{Pod: "10.13.0.1:8000"}, Tier: TierGPU, Keys: c})
	ix.Store(Blocks{Model: "m", Holder: Holder{Pod: "10.13.0.2:8000"}, Tier: TierGPU, Keys: d})
	other := Holder{Pod: "10.13.0.3:8000"}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		var res Result
		var dst []Holder
		for !stop.Load() {
			ix.Lookup("m", c, &res)
			if hit := res.Holder(other); hit != nil {
				t.Errorf("%+v holds a chain it never stored", hit)
				return
			}
			if dst = ix.HoldersAt("m", c, 5, dst); slices.Contains(dst, other) {
				t.Errorf("%v holds a block it never stored", other)
				return
			}
		}
	})
	for i := range sized(3000, 1000) {
		a := Holder{Pod: fmt.Sprintf("10.14.%d.%d:8000", i/256, i%256)}
		ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: c})
		ix.RemoveHolder(a)
		ix.Store(Blocks{Model: "m", Holder: other, Tier: TierGPU, Keys: d})
		ix.RemoveHolder(other)
	}
	stop.Store(true)
	wg.Wait()
}

// TestASecondHolderOfALongChainSharesItsHolderSets: a holder storing a
// chain another holds gives its blocks one holder set per store, not one
// each.
func TestASecondHolderOfALongChainSharesItsHolderSets(t *testing.T) {
	const n = 16000
	ix := New(Config{MaxHolderBlocks: -1})
	keys := chain(5, n)
	ix.Store(Blocks{Model: "m", Holder: Holder{Pod: "10.15.0.1:8000"}, Tier: TierGPU, Keys: keys})
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	ix.Store(Blocks{Model: "m", Holder: Holder{Pod: "10.15.0.2:8000"}, Tier: TierGPU, Keys: keys})
	runtime.ReadMemStats(&after)
	// The set table's slots are 8 bytes a block and the store's scratch
	// 4 (grown by append); sets of their own would be over 100.
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(40*n), "bytes allocated for %d blocks", n)
	require.Equal(t, int64(n), ix.Stats().SharedBlocks)
	checkInvariants(t, ix, 0)
}

// TestWritersOfSharedBlocksDoNotWaitForEachOther holds one holder's
// mutex, as a long write of it does, and checks that another holder of
// the same blocks still stores and removes them and its own: holders
// share entries, whose locks a write holds for one block at a time, and
// nothing else.
func TestWritersOfSharedBlocksDoNotWaitForEachOther(t *testing.T) {
	a, b := Holder{Pod: "10.12.0.1:8000"}, Holder{Pod: "10.12.0.2:8000"}
	system := chain(21, 16)
	own := chain(22, 48)
	cases := []struct {
		name string
		op   func(ix *Index)
		// b's blocks after the op, and how many of system and own it holds.
		blocks, systemRun, ownRun int
	}{
		{"a store of its own blocks", func(ix *Index) {
			ix.Store(Blocks{Model: "m", Holder: b, Tier: TierGPU, Keys: own})
		}, 64, 16, 48},
		{"a removal of shared blocks", func(ix *Index) {
			ix.Remove("m", b, TierGPU, 0, system[8:])
		}, 8, 8, 0},
		{"a store of shared blocks it holds", func(ix *Index) {
			ix.Store(Blocks{Model: "m", Holder: b, Tier: TierGPU, Keys: system})
		}, 16, 16, 0},
		{"a store of shared blocks in another tier", func(ix *Index) {
			ix.Store(Blocks{Model: "m", Holder: b, Tier: TierCPU, Keys: system})
		}, 32, 16, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ix := New(Config{MaxHolderBlocks: -1})
			for _, h := range []Holder{a, b} {
				ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: system})
			}
			hsA := ix.lockHolder("m", a, false)
			held := true
			defer func() {
				if held {
					hsA.mu.Unlock()
				}
			}()
			done := make(chan struct{})
			go func() {
				defer close(done)
				tc.op(ix)
			}()
			require.Eventually(t, func() bool {
				select {
				case <-done:
					return true
				default:
					return false
				}
			}, 10*time.Second, time.Millisecond, "the writer waits for another holder")
			held = false
			hsA.mu.Unlock()

			checkInvariants(t, ix, 0)
			blocks := 0
			for _, n := range ix.HolderBlocks("m", b) {
				blocks += n
			}
			require.Equal(t, tc.blocks, blocks)
			require.Equal(t, tc.systemRun, ix.Run("m", b, system, 0, nil))
			require.Equal(t, tc.ownRun, ix.Run("m", b, own, 0, nil))
			require.Equal(t, 16, ix.Run("m", a, system, 0, nil))
		})
	}
}
