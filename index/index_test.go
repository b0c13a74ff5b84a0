package index

import (
	"bytes"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// chain returns n chained keys starting from root.
func chain(root uint64, n int) []uint64 {
	keys := make([]uint64, n)
	k := root
	for i := range keys {
		if i > 0 {
			k = chainKey(k, 0)
		}
		keys[i] = k
	}
	return keys
}

var (
	podA = Holder{Pod: "a:8000"}
	podB = Holder{Pod: "b:8000"}
	podC = Holder{Pod: "a:8000", Rank: 1}
)

func TestLookupScenarios(t *testing.T) {
	p := chain(100, 10)
	type step func(ix *Index)
	store := func(h Holder, tier string, group int, from, to int) step {
		return func(ix *Index) {
			var parent uint64
			if from > 0 {
				parent = p[from-1]
			}
			ix.Store(Blocks{Model: "m", Holder: h, Tier: tier, Group: group, Parent: parentIf(from > 0, parent), Keys: p[from:to]})
		}
	}
	storeLoose := func(h Holder, tier string, from, to int) step {
		return func(ix *Index) { ix.Store(Blocks{Model: "m", Holder: h, Tier: tier, Keys: p[from:to]}) }
	}
	remove := func(h Holder, tier string, group int, idx ...int) step {
		return func(ix *Index) {
			for _, i := range idx {
				ix.Remove("m", h, tier, group, p[i:i+1])
			}
		}
	}
	cases := []struct {
		name  string
		steps []step
		want  map[Holder]Hit
	}{
		{
			name:  "a stored chain is a full prefix",
			steps: []step{store(podA, TierGPU, 0, 0, 10)},
			want:  map[Holder]Hit{podA: {Holder: podA, Prefix: 10, Tiers: []TierPrefix{{TierGPU, 10}}}},
		},
		{
			name:  "a partial chain is a partial prefix",
			steps: []step{store(podA, TierGPU, 0, 0, 4), store(podB, TierGPU, 0, 0, 7)},
			want: map[Holder]Hit{
				podA: {Holder: podA, Prefix: 4, Tiers: []TierPrefix{{TierGPU, 4}}},
				podB: {Holder: podB, Prefix: 7, Tiers: []TierPrefix{{TierGPU, 7}}},
			},
		},
		{
			name:  "an evicted parent ends the prefix although its children are kept",
			steps: []step{store(podA, TierGPU, 0, 0, 10), remove(podA, TierGPU, 0, 3)},
			want:  map[Holder]Hit{podA: {Holder: podA, Prefix: 3, Tiers: []TierPrefix{{TierGPU, 3}}}},
		},
		{
			name:  "storing the evicted parent again restores the prefix",
			steps: []step{store(podA, TierGPU, 0, 0, 10), remove(podA, TierGPU, 0, 3, 6), store(podA, TierGPU, 0, 3, 4), store(podA, TierGPU, 0, 6, 7)},
			want:  map[Holder]Hit{podA: {Holder: podA, Prefix: 10, Tiers: []TierPrefix{{TierGPU, 10}}}},
		},
		{
			name:  "a chain without its first blocks is no prefix",
			steps: []step{store(podA, TierGPU, 0, 2, 10)},
			want:  map[Holder]Hit{},
		},
		{
			name:  "the prefix runs across tiers block by block",
			steps: []step{store(podA, TierGPU, 0, 0, 4), storeLoose(podA, TierCPU, 3, 8)},
			want:  map[Holder]Hit{podA: {Holder: podA, Prefix: 8, Tiers: []TierPrefix{{TierGPU, 4}}}},
		},
		{
			name:  "blocks stored without a parent join the chain they continue",
			steps: []step{store(podA, TierCPU, 0, 0, 3), storeLoose(podA, TierCPU, 3, 6), storeLoose(podA, TierCPU, 6, 10)},
			want:  map[Holder]Hit{podA: {Holder: podA, Prefix: 10, Tiers: []TierPrefix{{TierCPU, 10}}}},
		},
		{
			name:  "removing one group keeps the block held by another",
			steps: []step{store(podA, TierGPU, 0, 0, 10), store(podA, TierGPU, 1, 0, 10), store(podA, TierGPU, 9, 0, 10), remove(podA, TierGPU, 1, 2), remove(podA, TierGPU, 0, 2)},
			want:  map[Holder]Hit{podA: {Holder: podA, Prefix: 10, Tiers: []TierPrefix{{TierGPU, 10}}}},
		},
		{
			name:  "removing every group drops the block",
			steps: []step{store(podA, TierGPU, 0, 0, 10), store(podA, TierGPU, 9, 0, 10), remove(podA, TierGPU, 0, 5), remove(podA, TierGPU, 9, 5)},
			want:  map[Holder]Hit{podA: {Holder: podA, Prefix: 5, Tiers: []TierPrefix{{TierGPU, 5}}}},
		},
		{
			name:  "storing twice is storing once",
			steps: []step{store(podA, TierGPU, 0, 0, 6), store(podA, TierGPU, 0, 0, 6), remove(podA, TierGPU, 0, 5)},
			want:  map[Holder]Hit{podA: {Holder: podA, Prefix: 5, Tiers: []TierPrefix{{TierGPU, 5}}}},
		},
		{
			name: "ranks of one pod are separate holders",
			steps: []step{store(podA, TierGPU, 0, 0, 2), store(podC, TierCPU, 0, 0, 5),
				func(ix *Index) { ix.ClearHolder("m", podA, "") }},
			want: map[Holder]Hit{podC: {Holder: podC, Prefix: 5, Tiers: []TierPrefix{{TierCPU, 5}}}},
		},
		{
			name: "clearing one tier keeps the others",
			steps: []step{store(podA, TierGPU, 0, 0, 3), store(podA, TierCPU, 0, 0, 6),
				func(ix *Index) { ix.ClearHolder("m", podA, TierCPU) }},
			want: map[Holder]Hit{podA: {Holder: podA, Prefix: 3, Tiers: []TierPrefix{{TierGPU, 3}}}},
		},
		{
			name: "a removed holder is gone",
			steps: []step{store(podA, TierGPU, 0, 0, 3), store(podB, TierGPU, 0, 0, 3),
				func(ix *Index) { ix.RemoveHolder(podA) }},
			want: map[Holder]Hit{podB: {Holder: podB, Prefix: 3, Tiers: []TierPrefix{{TierGPU, 3}}}},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ix := New(Config{})
			for _, s := range tc.steps {
				s(ix)
			}
			var res Result
			ix.Lookup("m", p, &res)
			require.Equal(t, tc.want, hitsByHolder(&res))
		})
	}
}

func TestRunCountsFromStartInChosenTiers(t *testing.T) {
	p := chain(5, 12)
	ix := New(Config{})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: p[:3]})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierCPU, Keys: p[:8]})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: "disk", Parent: ParentKey(p[7]), Keys: p[8:10]})
	cases := []struct {
		start int
		tiers []string
		want  int
	}{
		{0, nil, 10},
		{3, nil, 7},
		{3, []string{TierCPU}, 5},
		{3, []string{TierGPU}, 0},
		{0, []string{TierGPU}, 3},
		{2, []string{TierGPU, "disk"}, 1},
		{8, []string{"disk"}, 2},
		{10, nil, 0},
		{12, nil, 0},
		{-1, nil, 0},
	}
	for _, tc := range cases {
		require.Equal(t, tc.want, ix.Run("m", podA, p, tc.start, tc.tiers), "start %d tiers %v", tc.start, tc.tiers)
	}
	require.Zero(t, ix.Run("m", podB, p, 0, nil))
	require.Zero(t, ix.Run("other", podA, p, 0, nil))
}

func TestHoldersHasNoCapPerBlock(t *testing.T) {
	ix := New(Config{})
	p := chain(9, 3)
	var want []Holder
	for i := range 300 {
		h := Holder{Pod: fmt.Sprintf("pod-%d", i)}
		tier := TierGPU
		if i%2 == 1 {
			tier = TierCPU
		}
		ix.Store(Blocks{Model: "m", Holder: h, Tier: tier, Keys: p})
		want = append(want, h)
	}
	require.ElementsMatch(t, want, ix.Holders("m", p[1], nil))
	var res Result
	ix.Lookup("m", p, &res)
	require.Len(t, res.Hits, 300)
	require.Empty(t, ix.Holders("m", 12345, nil))
}

func TestKeyZeroIsAKey(t *testing.T) {
	ix := New(Config{})
	keys := []uint64{0, chainKey(0, 0)}
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: keys})
	var res Result
	ix.Lookup("m", keys, &res)
	require.Equal(t, 2, res.Holder(podA).Prefix)
	ix.Remove("m", podA, TierGPU, 0, keys[:1])
	ix.Lookup("m", keys, &res)
	require.Empty(t, res.Hits)
}

func TestStoreWithoutTierIsRejectedAndCounted(t *testing.T) {
	ix := New(Config{})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: "", Keys: chain(1, 4)})
	s := ix.Stats()
	require.Equal(t, uint64(4), s.RejectedTier)
	require.Zero(t, s.HolderBlocks)
	require.Empty(t, ix.HolderBlocks("m", podA))
}

func TestHolderCapacityEvictsOldestFirst(t *testing.T) {
	ix := New(Config{HolderCapacity: 10})
	old := chain(1, 6)
	mid := chain(2, 6)
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: old})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: mid})
	require.Equal(t, map[string]int{TierGPU: 10}, ix.HolderBlocks("m", podA))
	var res Result
	ix.Lookup("m", old, &res)
	require.Empty(t, res.Hits, "the oldest two blocks went first")
	ix.Lookup("m", mid, &res)
	require.Equal(t, 6, res.Holder(podA).Prefix)
	require.Equal(t, uint64(2), ix.Stats().EvictedCapacity)

	ix.SetHolderCapacity(podA, 3)
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: chain(3, 1)})
	require.Equal(t, map[string]int{TierGPU: 3}, ix.HolderBlocks("m", podA))
	require.Equal(t, uint64(10), ix.Stats().EvictedCapacity)
}

func TestBudgetEvictsFromLargestHolder(t *testing.T) {
	ix := New(Config{MaxHolderBlocks: 1000})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: chain(1, 900)})
	ix.Store(Blocks{Model: "m", Holder: podB, Tier: TierGPU, Keys: chain(2, 50)})
	ix.Store(Blocks{Model: "m", Holder: podB, Tier: TierGPU, Keys: chain(3, 100)})
	s := ix.Stats()
	require.LessOrEqual(t, s.HolderBlocks, int64(1000))
	require.Positive(t, s.EvictedBudget)
	require.Equal(t, 150, ix.HolderBlocks("m", podB)[TierGPU], "the largest holder pays")
	require.Equal(t, s.HolderBlocks-150, int64(ix.HolderBlocks("m", podA)[TierGPU]))
	var res Result
	ix.Lookup("m", chain(1, 900), &res)
	require.Nil(t, res.Holder(podA), "its oldest blocks, the chain's start, went first")
}

func TestLookupDoesNotAllocate(t *testing.T) {
	ix := New(Config{})
	p := chain(1, 256)
	for i := range 16 {
		ix.Store(Blocks{Model: "m", Holder: Holder{Pod: fmt.Sprintf("p%d", i)}, Tier: TierGPU, Keys: p[:16*i+1]})
		ix.Store(Blocks{Model: "m", Holder: Holder{Pod: fmt.Sprintf("p%d", i)}, Tier: TierCPU, Keys: p[:8*i+1]})
	}
	var res Result
	ix.Lookup("m", p, &res)
	dst := make([]Holder, 0, 16)
	allocs := testing.AllocsPerRun(100, func() {
		ix.Lookup("m", p, &res)
		ix.Run("m", Holder{Pod: "p3"}, p, 4, []string{TierCPU})
		dst = ix.Holders("m", p[3], dst)
		dst = ix.HoldersAt("m", p, 3, dst)
	})
	require.Zero(t, allocs)
	require.Len(t, res.Hits, 16)
}

func TestRemovalsKeepMemoryBounded(t *testing.T) {
	ix := New(Config{})
	for i := range 200 {
		keys := chain(uint64(i), 100)
		ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: keys})
		ix.Remove("m", podA, TierGPU, 0, keys)
	}
	ms := ix.model("m", false)
	hs, _ := ms.holders.Load(podA)
	hs.mu.Lock()
	defer hs.mu.Unlock()
	require.Less(t, hs.queue.n, int64(2048))
	require.Less(t, ms.entries.Load(), int64(2048), "entries kept by ghosts")
	require.Zero(t, ix.Stats().HolderBlocks)
}

func TestLongChainsAreExact(t *testing.T) {
	const depth = 1 << 16 // what the old tables' depths saturated at
	p := chain(3, depth+5000)
	ix := New(Config{})
	for i := 0; i < len(p); i += 4096 {
		var parent uint64
		if i > 0 {
			parent = p[i-1]
		}
		ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Parent: parentIf(i > 0, parent), Keys: p[i:min(i+4096, len(p))]})
	}
	var res Result
	ix.Lookup("m", p, &res)
	require.Equal(t, len(p), res.Holder(podA).Prefix)
	require.Equal(t, 4000, ix.Run("m", podA, p, len(p)-4000, nil))
	require.Equal(t, []Holder{podA}, ix.HoldersAt("m", p, len(p)-1, nil))

	// A hole far along the chain.
	ix.Remove("m", podA, TierGPU, 0, p[depth+100:depth+101])
	ix.Lookup("m", p, &res)
	require.Equal(t, depth+100, res.Holder(podA).Prefix)
	require.Equal(t, len(p)-depth-101, ix.Run("m", podA, p, depth+101, nil))
}

func TestEvictionsAreLoggedWithThePod(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ix := New(Config{HolderCapacity: 2, Logger: log})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: chain(1, 5)})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: "", Keys: chain(2, 1)})
	require.Contains(t, buf.String(), "over capacity")
	require.Contains(t, buf.String(), "pod=a:8000")
	require.Contains(t, buf.String(), "without tier")
	s := ix.Stats()
	require.Equal(t, Stats{Models: 1, Holders: 1, HolderBlocks: 2, Stored: 5, EvictedCapacity: 3, RejectedTier: 1}, s)
}

func TestManyChildrenOfOneBlockAreCountedExactly(t *testing.T) {
	const n = 300 // past what the old tables' child counters held
	root := uint64(77)
	ix := New(Config{})
	prompts := make([][]uint64, n)
	for i := range prompts {
		c := chainKey(root, i)
		prompts[i] = []uint64{root, c, chainKey(c, 0)}
		ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: prompts[i]})
	}
	var res Result
	ix.Remove("m", podA, TierGPU, 0, []uint64{root})
	ix.Lookup("m", prompts[5], &res)
	require.Empty(t, res.Hits)
	require.Equal(t, 2, ix.Run("m", podA, prompts[5], 1, nil))

	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: []uint64{root}})
	ix.Lookup("m", prompts[299], &res)
	require.Equal(t, 3, res.Holder(podA).Prefix)

	ix.Remove("m", podA, TierGPU, 0, []uint64{root})
	for i := range n - 1 {
		ix.Remove("m", podA, TierGPU, 0, prompts[i][1:2])
	}
	ix.Lookup("m", prompts[n-1], &res)
	require.Empty(t, res.Hits)
	require.Equal(t, 2, ix.Run("m", podA, prompts[n-1], 1, nil))
	require.Equal(t, 1, ix.Run("m", podA, prompts[0], 2, nil))
	ix.Remove("m", podA, TierGPU, 0, prompts[n-1][1:2])
	for i := range n {
		ix.Remove("m", podA, TierGPU, 0, prompts[i][2:])
	}
	require.Zero(t, ix.Stats().HolderBlocks)
}

func TestStoreInTooManyTiersIsRejectedAndCounted(t *testing.T) {
	ix := New(Config{})
	keys := chain(1, 2)
	for i := range maxTiers {
		ix.Store(Blocks{Model: "m", Holder: podA, Tier: fmt.Sprintf("tier-%d", i), Keys: keys})
	}
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: "one-too-many", Keys: keys})
	s := ix.Stats()
	require.Equal(t, uint64(2), s.RejectedTier)
	require.Equal(t, int64(2*maxTiers), s.HolderBlocks)
	require.NotContains(t, ix.HolderBlocks("m", podA), "one-too-many")
	require.Equal(t, 1, ix.Run("m", podA, keys, 1, []string{fmt.Sprintf("tier-%d", maxTiers-1)}))
	require.Zero(t, ix.Run("m", podA, keys, 0, []string{"one-too-many"}))
	ix.Store(Blocks{Model: "m", Holder: podB, Tier: "one-too-many", Keys: keys})
	require.Equal(t, 2, ix.Run("m", podB, keys, 0, []string{"one-too-many"}), "the limit is per holder")
}

// Blocks removed and stored again keep their queue places; compaction
// must bound the queue and keep every held block in it, or capacity could
// no longer be enforced.
func TestEvictionQueueCompactionKeepsEveryHoldingEvictable(t *testing.T) {
	ix := New(Config{})
	ref := newBrute()
	p := chain(1, 3000)
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: p})
	ref.store("m", podA, TierGPU, 0, p)
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierCPU, Keys: p[:100]})
	ref.store("m", podA, TierCPU, 0, p[:100])
	hs, _ := ix.model("m", false).holders.Load(podA)
	longest := 0
	for i := range 10000 {
		k := p[i*7%len(p):][:1]
		ix.Remove("m", podA, TierGPU, 0, k)
		ref.remove("m", podA, TierGPU, 0, k)
		ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: k})
		ref.store("m", podA, TierGPU, 0, k)
		longest = max(longest, int(hs.queue.n))
		if i%1000 == 0 {
			checkInvariants(t, ix, i)
		}
	}
	require.LessOrEqual(t, longest, 2*3100+1, "the queue is compacted at twice the holdings")
	require.Equal(t, ref.blocks("m", podA), ix.HolderBlocks("m", podA))

	ix.SetHolderCapacity(podA, 500)
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierCPU, Keys: chain(9, 1)})
	checkInvariants(t, ix, -1)
	s := ix.Stats()
	require.Equal(t, int64(500), s.HolderBlocks)
	require.Equal(t, uint64(2601), s.EvictedCapacity)
	var res Result
	ix.Lookup("m", p, &res)
	require.Equal(t, oracleLookup(ix, "m", p), hitsByHolder(&res))
}

// A capacity set while the holder's first store creates it must not be
// lost between the store's read of the capacities and its registration.
func TestCapacitySetWhileHolderIsCreatedApplies(t *testing.T) {
	ix := New(Config{})
	keys := chain(1, 4)
	for i := range 3000 {
		h := Holder{Pod: fmt.Sprint(i)}
		var wg sync.WaitGroup
		wg.Go(func() { ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: keys[:1]}) })
		wg.Go(func() { ix.SetHolderCapacity(h, 2) })
		wg.Wait()
		ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: keys})
		require.Equal(t, 2, ix.HolderBlocks("m", h)[TierGPU], "holder %d", i)
		// A store of a chain's first block asks every holder whose chain
		// starts there whether to share it: the 3000 holders left in made
		// the test quadratic, 45 s under -race.
		ix.RemoveHolder(h)
	}
}

// parentIf is Blocks.Parent for a chain that continues from p when ok.
func parentIf(ok bool, p uint64) Parent {
	if !ok {
		return Parent{}
	}
	return ParentKey(p)
}

func TestMemoryBytesBoundsHoldingsAtHolderBlockBytesEach(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		want int64
	}{
		{"memory budget", Config{MemoryBytes: 1000 * HolderBlockBytes}, 1000},
		{"lower holding budget wins", Config{MemoryBytes: 1000 * HolderBlockBytes, MaxHolderBlocks: 600}, 600},
		{"lower memory budget wins", Config{MemoryBytes: 1000 * HolderBlockBytes, MaxHolderBlocks: 6000}, 1000},
		{"memory budget without holding budget", Config{MemoryBytes: 1000 * HolderBlockBytes, MaxHolderBlocks: -1}, 1000},
		{"neither", Config{}, DefaultMaxHolderBlocks},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ix := New(tc.cfg)
			require.Equal(t, tc.want, ix.Budget())
			if tc.want > 10000 {
				return
			}
			for i := range 50 {
				ix.Store(Blocks{Model: "m", Holder: Holder{Pod: fmt.Sprintf("p%d:1", i%5)}, Tier: TierGPU, Keys: chain(uint64(i+1)<<32, 100)})
			}
			st := ix.Stats()
			require.LessOrEqual(t, st.HolderBlocks, tc.want)
			require.Equal(t, int64(5000)-st.HolderBlocks, int64(st.EvictedBudget))
		})
	}
}

// At its cap, after eviction has replaced its holdings twice, the index's
// live heap stays within MemoryBytes: HolderBlockBytes does not undercount.
func TestMemoryBytesBoundsTheLiveHeapAtTheCap(t *testing.T) {
	if raceEnabled {
		t.Skip("a smaller index has a larger share of per-holder overhead, and this one takes 30 s under the race detector")
	}
	const budget = 32 << 20
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ix := New(Config{MemoryBytes: budget})
	rng := rand.New(rand.NewPCG(3, 4))
	keys := make([]uint64, 2048)
	for stored := int64(0); stored < 3*ix.Budget(); {
		n := 1 + rng.IntN(len(keys))
		for i := range n {
			keys[i] = rng.Uint64()
		}
		ix.Store(Blocks{Model: "m", Holder: Holder{Pod: fmt.Sprintf("10.3.0.%d:8000", rng.IntN(16))}, Tier: TierGPU, Keys: keys[:n]})
		stored += int64(n)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	st := ix.Stats()
	require.NotZero(t, st.EvictedBudget)
	require.Greater(t, st.HolderBlocks, ix.Budget()*9/10)
	heap := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d holdings, %.1f heap bytes each, HolderBlockBytes %d", st.HolderBlocks, float64(heap)/float64(st.HolderBlocks), HolderBlockBytes)
	require.LessOrEqual(t, heap, int64(budget))
	runtime.KeepAlive(ix)
}

// A lookup searches only the holders that start a chain at the prompt's
// first block, however many other holders the model has, and its answers
// stay those of every holder.
func TestLookupSearchesOnlyHoldersStartingAChainAtTheFirstBlock(t *testing.T) {
	ix := New(Config{})
	p := chain(1, 64)
	for i := range 500 {
		h := Holder{Pod: fmt.Sprintf("bg-%d", i)}
		ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: chain(uint64(1000+i), 40)})
	}
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: p[:10]})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierCPU, Parent: ParentKey(p[9]), Keys: p[10:30]})
	ix.Store(Blocks{Model: "m", Holder: podB, Tier: TierCPU, Keys: p[:1]})
	ix.Store(Blocks{Model: "m", Holder: podB, Tier: TierCPU, Keys: p[1:50]})
	// podC's store names an unknown parent: p[0] is held, unanchored.
	ix.Store(Blocks{Model: "m", Holder: podC, Tier: TierGPU, Parent: ParentKey(p[0]), Keys: p[1:5]})
	ix.Store(Blocks{Model: "m", Holder: podC, Tier: TierGPU, Keys: p[:1]})
	require.ElementsMatch(t, []Holder{podA, podB}, ix.HoldersAt("m", p, 20, nil))
	require.ElementsMatch(t, []Holder{podA, podB, podC}, ix.HoldersAt("m", p, 3, nil))

	var res Result
	ix.Lookup("m", p, &res)
	require.Equal(t, map[Holder]Hit{
		podA: {Holder: podA, Prefix: 30, Tiers: []TierPrefix{{TierGPU, 10}}},
		podB: {Holder: podB, Prefix: 50, Tiers: []TierPrefix{{TierCPU, 50}}},
		podC: {Holder: podC, Prefix: 5, Tiers: []TierPrefix{{TierGPU, 5}}},
	}, hitsByHolder(&res))

	// Cleared tiers and removed holders leave the first block's holders.
	ix.ClearHolder("m", podB, TierCPU)
	ix.RemoveHolder(podC)
	for i := range 2000 {
		ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: chain(uint64(5000+i), 4)})
		ix.Remove("m", podA, TierGPU, 0, chain(uint64(5000+i), 4))
	}
	checkInvariants(t, ix, -1)
	require.Equal(t, []Holder{podA}, ix.Holders("m", p[0], nil))
	ix.Lookup("m", p, &res)
	require.Equal(t, map[Holder]Hit{podA: {Holder: podA, Prefix: 30, Tiers: []TierPrefix{{TierGPU, 10}}}}, hitsByHolder(&res))
}
