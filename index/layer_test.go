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

type layerHolding struct {
	hs   *holderState
	lane int
	e    uint32
}

// checkLayer verifies each model's layer: entries reachable by key, their
// children, holder sets and references counted exactly; every layer
// holding counted by its holder, named by its eviction queue and absent
// from its tables; the gaps listed a superset of the exact ones.
//
// The checks run for every entry and holding, so each require is called
// only once its condition failed, for its message: called every time, its
// stack walk and reflection took most of the property tests' time.
func checkLayer(t *testing.T, ix *Index, op int) {
	ix.models.Range(func(model string, ms *modelState) bool {
		list := *ms.list.Load()
		for _, hs := range list {
			hs.mu.Lock()
		}
		defer func() {
			for _, hs := range list {
				hs.mu.Unlock()
			}
		}()
		ly := ms.layer
		ly.mu.Lock()
		defer ly.mu.Unlock()
		ctx := fmt.Sprintf("op %d %s", op, model)

		children := make(map[uint32]uint32)
		var live int64
		holdings := make(map[layerHolding]bool)
		var ids []uint32
		for e := range ly.next {
			en := ly.at(e)
			m := en.meta.Load()
			if m&entryLive == 0 {
				if en.refs != 0 {
					require.Zero(t, en.refs, "%s: freed entry %d referenced", ctx, e)
				}
				continue
			}
			live++
			if got, ge := ly.find(en.key.Load()); got != en || ge != int(e) {
				require.Same(t, en, got, "%s: entry %d not found by its key", ctx, e)
				require.Equal(t, int(e), ge, ctx)
			}
			if p := entryParent(m); p >= 0 {
				pm := ly.at(uint32(p)).meta.Load()
				if want := min(entryDepth(pm)+1, metaDepthMax); pm&entryLive == 0 || entryDepth(m) != want {
					require.NotZero(t, pm&entryLive, "%s: entry %d's parent freed", ctx, e)
					require.Equal(t, want, entryDepth(m), "%s: depth of entry %d", ctx, e)
				}
				children[uint32(p)]++
			} else if entryDepth(m) != 0 {
				require.Zero(t, entryDepth(m), ctx)
			}
			for l := range en.lanes {
				ids = en.lanes[l].appendIDs(ids[:0])
				if len(ids) != int(en.lanes[l].n) {
					require.Len(t, ids, int(en.lanes[l].n), "%s: members of entry %d lane %d", ctx, e, l)
				}
				for _, id := range ids {
					hs := ly.holderAt(id)
					if hs == nil || hs.lid.Load() != id+1 || !slices.Contains(list, hs) {
						require.NotNil(t, hs, "%s: entry %d has freed id %d", ctx, e, id)
						require.Equal(t, id+1, hs.lid.Load(), ctx)
						require.Contains(t, list, hs, ctx)
					}
					holdings[layerHolding{hs, l, e}] = true
				}
			}
		}
		require.Equal(t, live, ly.live.Load(), "%s: live entries", ctx)
		for e := range ly.next {
			if en := ly.at(e); en.meta.Load()&entryLive != 0 && children[e] != en.nchild {
				require.Equal(t, children[e], en.nchild, "%s: children of entry %d", ctx, e)
			}
		}

		refs := make(map[uint32]uint32)
		for _, hs := range list {
			tiers := hs.tierList()
			named := make(map[layerHolding]bool)
			queued := 0
			for r := hs.head; r < len(hs.fifoSlot); r++ {
				ti, i := hs.fifoTier[r], hs.fifoSlot[r]
				switch {
				case ti < fifoLayer:
					queued++
					tab := tiers[ti].tab.Load()
					if tab.slots[i].meta&metaMigrated == 0 {
						continue
					}
					if held(tab.slots[i].meta) {
						require.False(t, held(tab.slots[i].meta), "%s: held slot marked migrated", ctx)
					}
					if l := ly.laneOf(tiers[ti].name); l >= 0 {
						if _, e := ly.find(tab.slots[i].key); e >= 0 {
							named[layerHolding{hs, l, uint32(e)}] = true
						}
					}
				case ti == fifoRun:
					if hs.fifoTier[r+1] != fifoRunLen {
						require.Equal(t, uint8(fifoRunLen), hs.fifoTier[r+1], ctx)
					}
					e, lane, n := hs.runAt(r)
					if n <= 0 {
						require.Positive(t, n, "%s: empty run", ctx)
					}
					for x := range n {
						refs[e+x]++
						named[layerHolding{hs, lane, e + x}] = true
					}
					queued += int(n)
					r++
				default:
					if int(ti) >= fifoLayer+layerLanes {
						require.Less(t, int(ti), fifoLayer+layerLanes, "%s: FIFO tier byte %d", ctx, ti)
					}
					refs[i]++
					named[layerHolding{hs, int(ti - fifoLayer), i}] = true
					queued++
				}
			}
			require.Equal(t, queued, hs.queued, "%s %v: queued holdings", ctx, hs.h)
			var perLane [layerLanes]int64
			for hd := range holdings {
				if hd.hs != hs {
					continue
				}
				perLane[hd.lane]++
				if !named[hd] {
					require.True(t, named[hd], "%s %v: layer holding of entry %d not in the eviction queue", ctx, hs.h, hd.e)
				}
				if _, ts := hs.tier(ly.laneName(hd.lane), false); ts != nil && held(ts.tab.Load().get(ly.at(hd.e).key.Load())) {
					require.False(t, held(ts.tab.Load().get(ly.at(hd.e).key.Load())), "%s %v: block held in the layer and the table", ctx, hs.h)
				}
			}
			require.Equal(t, perLane, hs.laneLive, "%s %v: layer holdings per lane", ctx, hs.h)
		}
		for e := range ly.next {
			if en := ly.at(e); en.meta.Load()&entryLive != 0 && refs[e] != en.refs {
				require.Equal(t, refs[e], en.refs, "%s: references of entry %d", ctx, e)
			}
		}

		for l := range ly.lanes {
			ln := &ly.lanes[l]
			for e := range ly.next {
				en := ly.at(e)
				m := en.meta.Load()
				p := entryParent(m)
				if m&entryLive == 0 || p < 0 {
					continue
				}
				ids = en.lanes[l].appendIDs(ids[:0])
				for _, id := range ids {
					if _, listed := ln.gapSet[uint32(p)]; !listed && !ly.at(uint32(p)).lanes[l].has(id) {
						require.Contains(t, ln.gapSet, uint32(p), "%s: gap %d of lane %d not listed", ctx, p, l)
					}
				}
			}
			if g := int(ln.gapN.Load()); g >= 0 {
				listed := make(map[uint64]uint64)
				for j := range g {
					listed[ln.gaps[j].key.Load()] = ln.gaps[j].depth.Load()
				}
				want := make(map[uint64]uint64)
				for e := range ln.gapSet {
					en := ly.at(e)
					want[en.key.Load()] = uint64(entryDepth(en.meta.Load()))
				}
				require.Equal(t, want, listed, "%s: published gaps of lane %d", ctx, l)
			} else {
				require.Greater(t, len(ln.gapSet), maxGaps, "%s: gaps of lane %d unlisted although few", ctx, l)
			}
		}
		return true
	})
}

func TestBlocksManyHoldersHoldAreStoredOnce(t *testing.T) {
	ix := New(Config{ShareThreshold: 3, MaxHolderBlocks: -1})
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
	require.Equal(t, int64(48), s.SharedBlocks, "the system prompt is shared, nobody's own blocks are")
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

	// Removing the system prompt from all but two holders keeps it shared
	// for them, then frees it.
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
	require.Zero(t, ix.Stats().SharedBlocks)
}

func TestSharedBlocksKeepTheirHoldersEvictionOrder(t *testing.T) {
	// Holders at capacity evict oldest first, whether their blocks moved
	// to the layer after they stored them or were stored there.
	ix := New(Config{ShareThreshold: 2, HolderCapacity: 64, MaxHolderBlocks: -1})
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
	ix := New(Config{ShareThreshold: 2, MaxHolderBlocks: -1})
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
	loaded, _, err := LoadFile(path, Config{ShareThreshold: 2, MaxHolderBlocks: -1})
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

func TestMigratedHoldingsLeaveTheirHoldersTables(t *testing.T) {
	// a holds 4,096 blocks; once b stores them too they move to the layer,
	// and a's table gives their slots up, its queue keeping their order.
	ix := New(Config{ShareThreshold: 2, MaxHolderBlocks: -1})
	a, b := Holder{Pod: "10.9.0.1:8000"}, Holder{Pod: "10.9.0.2:8000"}
	keys := chain(11, 4096)
	own := chain(12, 64)
	for j := 0; j < len(keys); j += 16 {
		ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Parent: parentIf(j > 0, keys[max(j-1, 0)]), Keys: keys[j : j+16]})
	}
	ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: own})
	hsA := ix.lockHolder("m", a, false)
	slotsBefore := len(hsA.tierList()[0].tab.Load().slots)
	hsA.mu.Unlock()
	for j := 0; j < len(keys); j += 16 {
		ix.Store(Blocks{Model: "m", Holder: b, Tier: TierGPU, Parent: parentIf(j > 0, keys[max(j-1, 0)]), Keys: keys[j : j+16]})
	}
	checkInvariants(t, ix, 0)
	require.Equal(t, int64(4096), ix.Stats().SharedBlocks)
	hsA = ix.lockHolder("m", a, false)
	ts := hsA.tierList()[0]
	slotsAfter, migrated, items := len(ts.tab.Load().slots), ts.migrated, len(hsA.fifoSlot)-hsA.head
	hsA.mu.Unlock()
	require.Less(t, slotsAfter, slotsBefore/4, "the table shrank")
	require.Less(t, migrated, 1024, "most migrated slots are gone")
	require.Less(t, items, 1024+64+8, "the queue names most shared blocks by runs")
	require.Equal(t, map[string]int{TierGPU: 4096 + 64}, ix.HolderBlocks("m", a))
	var res Result
	ix.Lookup("m", keys, &res)
	require.Equal(t, 4096, res.Holder(a).Prefix)
	require.Equal(t, 4096, res.Holder(b).Prefix)
	ix.Lookup("m", own, &res)
	require.Equal(t, 64, res.Holder(a).Prefix)
	// a's oldest holdings are still the shared blocks' first ones.
	ix.SetHolderCapacity(a, 4096)
	ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: chain(13, 100)})
	checkInvariants(t, ix, 1)
	require.Zero(t, ix.Run("m", a, keys, 0, nil))
	require.Equal(t, 4096-164, ix.Run("m", a, keys, 164, nil))
	require.Equal(t, 64, ix.Run("m", a, own, 0, nil))
}

// TestReadersSeeBlocksWhileTheyMoveToTheLayer has readers follow holders
// whose blocks another holder's stores move to the layer, block by block:
// every Lookup, Run, Holders and HoldersAt must see them held throughout.
func TestReadersSeeBlocksWhileTheyMoveToTheLayer(t *testing.T) {
	// Under -race 300 holders took 11 s on 2 loaded cores, the two readers
	// spinning beside the writer; fewer move as many blocks each.
	holders := sized(300, 80)
	const n = 48
	ix := New(Config{MaxHolderBlocks: -1, ShareThreshold: 2})
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
	for i := range holders {
		moving.Store(int64(i))
		for j := range n {
			b := Blocks{Model: "m", Holder: y, Tier: TierGPU, Keys: chains[i][j : j+1]}
			if j > 0 {
				b.Parent = ParentKey(chains[i][j-1])
			}
			ix.Store(b)
		}
	}
	stop.Store(true)
	wg.Wait()
	require.Equal(t, int64(holders*n), ix.Stats().SharedBlocks)
	checkInvariants(t, ix, 0)
}

// TestAHolderIDReusedMeanwhileIsNotCreditedWithItsPredecessorsBlocks
// removes holders of a shared chain while others take their layer ids:
// a lookup that read an id before it changed hands must not report its
// new holder with the old one's blocks.
func TestAHolderIDReusedMeanwhileIsNotCreditedWithItsPredecessorsBlocks(t *testing.T) {
	ix := New(Config{MaxHolderBlocks: -1, ShareThreshold: 2})
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

// TestMovingAChainToTheLayerRebuildsTheTableAFewTimes: a chain held by
// one holder whose blocks move one by one keeps the moved ones as
// ancestors of those not yet moved; rebuilding each time most of the
// table had moved would rebuild it at every block.
func TestMovingAChainToTheLayerRebuildsTheTableAFewTimes(t *testing.T) {
	const n = 16000
	ix := New(Config{MaxHolderBlocks: -1, ShareThreshold: 2})
	keys := chain(5, n)
	ix.Store(Blocks{Model: "m", Holder: Holder{Pod: "10.15.0.1:8000"}, Tier: TierGPU, Keys: keys})
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	ix.Store(Blocks{Model: "m", Holder: Holder{Pod: "10.15.0.2:8000"}, Tier: TierGPU, Keys: keys})
	runtime.ReadMemStats(&after)
	// A rebuild allocates a table of about the chain's size.
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(64*n*16), "bytes allocated moving %d blocks", n)
	require.Equal(t, int64(n), ix.Stats().SharedBlocks)
	checkInvariants(t, ix, 0)
}

// TestWritersOfUnsharedBlocksDoNotWaitForTheLayer holds a model's layer
// mutex, as a writer promoting or evicting a shared block does, and
// checks that a holder of the model's shared system prompt still stores
// and removes its own blocks, and stores the prompt again: none of them
// touches a block the layer may take. Each used to take the mutex for the
// whole call, so one shared block serialised all the model's writers.
func TestWritersOfUnsharedBlocksDoNotWaitForTheLayer(t *testing.T) {
	a, b := Holder{Pod: "10.12.0.1:8000"}, Holder{Pod: "10.12.0.2:8000"}
	system := chain(21, 16)
	own := make([]uint64, 48)
	for i := range own {
		own[i] = chainKey(system[len(system)-1]+uint64(i), 4)
		if i > 0 {
			own[i] = chainKey(own[i-1], 4)
		}
	}
	cases := []struct {
		name string
		op   func(ix *Index)
		// a's blocks after the op, and how many of system and own it holds.
		blocks, systemRun, ownRun int
	}{
		{"a store of its own blocks", func(ix *Index) {
			ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Parent: ParentKey(own[15]), Keys: own[16:]})
		}, 64, 16, 48},
		{"a removal of its own blocks", func(ix *Index) {
			ix.Remove("m", a, TierGPU, 0, own[8:16])
		}, 24, 16, 8},
		{"a store of shared blocks it holds", func(ix *Index) {
			ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: system})
		}, 32, 16, 16},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ix := New(Config{ShareThreshold: 2, MaxHolderBlocks: -1})
			for _, h := range []Holder{a, b} {
				ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: system})
			}
			// The first own block continues a shared one: a store of it
			// may share it, so it takes the mutex.
			ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Parent: ParentKey(system[15]), Keys: own[:16]})
			require.Equal(t, int64(16), ix.Stats().SharedBlocks)

			ly := ix.model("m", false).layer
			ly.mu.Lock()
			held := true
			defer func() {
				if held {
					ly.mu.Unlock()
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
			}, 10*time.Second, time.Millisecond, "the writer waits for the layer's mutex")
			held = false
			ly.mu.Unlock()

			checkInvariants(t, ix, 0)
			require.Equal(t, map[string]int{TierGPU: tc.blocks}, ix.HolderBlocks("m", a))
			require.Equal(t, tc.systemRun, ix.Run("m", a, system, 0, nil))
			require.Equal(t, tc.ownRun, ix.Run("m", a, append(slices.Clone(system), own...), 16, nil))
			require.Equal(t, int64(16), ix.Stats().SharedBlocks)
		})
	}
}
