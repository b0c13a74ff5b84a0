package index

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// brute is the reference model: the set of holdings, nested by model,
// holder, tier and key down to the groups, every answer computed by checking
// each block against it.
type brute struct {
	held map[string]map[Holder]map[string]map[uint64]map[int]bool
}

func newBrute() *brute {
	return &brute{held: make(map[string]map[Holder]map[string]map[uint64]map[int]bool)}
}

func (b *brute) store(model string, h Holder, tier string, group int, keys []uint64) {
	if b.held[model] == nil {
		b.held[model] = make(map[Holder]map[string]map[uint64]map[int]bool)
	}
	if b.held[model][h] == nil {
		b.held[model][h] = make(map[string]map[uint64]map[int]bool)
	}
	if b.held[model][h][tier] == nil {
		b.held[model][h][tier] = make(map[uint64]map[int]bool)
	}
	set := b.held[model][h][tier]
	for _, k := range keys {
		if set[k] == nil {
			set[k] = make(map[int]bool)
		}
		set[k][group] = true
	}
}

func (b *brute) remove(model string, h Holder, tier string, group int, keys []uint64) {
	set := b.held[model][h][tier]
	for _, k := range keys {
		if set[k] != nil {
			delete(set[k], group)
			if len(set[k]) == 0 {
				delete(set, k)
			}
		}
	}
}

func (b *brute) clear(model string, h Holder, tier string) {
	for t := range b.held[model][h] {
		if tier == "" || t == tier {
			delete(b.held[model][h], t)
		}
	}
}

func (b *brute) removeHolder(h Holder) {
	for _, hs := range b.held {
		delete(hs, h)
	}
}

// lookup is Lookup by brute force, as a map for order-free comparison.
func (b *brute) lookup(model string, keys []uint64) map[Holder]Hit {
	out := make(map[Holder]Hit)
	for h, tiers := range b.held[model] {
		hit := Hit{Holder: h}
		for tier, set := range tiers {
			n := 0
			for n < len(keys) && set[keys[n]] != nil {
				n++
			}
			if n > 0 {
				hit.Tiers = append(hit.Tiers, TierPrefix{tier, n})
			}
		}
		for hit.Prefix < len(keys) && anyTier(tiers, nil, keys[hit.Prefix]) {
			hit.Prefix++
		}
		if hit.Prefix > 0 {
			sortTiers(hit.Tiers)
			out[h] = hit
		}
	}
	return out
}

func (b *brute) run(model string, h Holder, keys []uint64, start int, tiers []string) int {
	if start < 0 {
		return 0
	}
	ts := b.held[model][h]
	n := 0
	for start+n < len(keys) && anyTier(ts, tiers, keys[start+n]) {
		n++
	}
	return n
}

func (b *brute) holders(model string, key uint64) []Holder {
	var out []Holder
	for h, tiers := range b.held[model] {
		if anyTier(tiers, nil, key) {
			out = append(out, h)
		}
	}
	return out
}

func (b *brute) blocks(model string, h Holder) map[string]int {
	out := make(map[string]int)
	for tier, set := range b.held[model][h] {
		if len(set) > 0 {
			out[tier] = len(set)
		}
	}
	return out
}

func (b *brute) total() int64 {
	var n int64
	for _, hs := range b.held {
		for _, tiers := range hs {
			for _, set := range tiers {
				n += int64(len(set))
			}
		}
	}
	return n
}

func anyTier(tiers map[string]map[uint64]map[int]bool, names []string, key uint64) bool {
	for tier, set := range tiers {
		if set[key] != nil && (names == nil || slices.Contains(names, tier)) {
			return true
		}
	}
	return false
}

func sortTiers(tps []TierPrefix) {
	slices.SortFunc(tps, func(a, b TierPrefix) int {
		if a.Tier < b.Tier {
			return -1
		}
		if a.Tier > b.Tier {
			return 1
		}
		return 0
	})
}

func hitsByHolder(res *Result) map[Holder]Hit {
	out := make(map[Holder]Hit)
	for _, h := range res.Hits {
		tps := slices.Clone(h.Tiers)
		sortTiers(tps)
		out[h.Holder] = Hit{Holder: h.Holder, Prefix: h.Prefix, Tiers: tps}
	}
	return out
}

// chainKey derives a child block's key from its parent's, as vLLM's chained
// hash does: a key has one parent wherever it appears.
func chainKey(parent uint64, branch int) uint64 {
	x := parent*0x9E3779B97F4A7C15 + uint64(branch)*0xBF58476D1CE4E5B9 + 0x94D049BB133111EB
	x ^= x >> 31
	x *= 0xD6E8FEB86659FD93
	return x ^ x>>29
}

// universe is a forest of block chains prompts are drawn from: few roots,
// few branches per block, so different stores and lookups share prefixes.
type universe struct {
	rng   *rand.Rand
	roots []uint64
}

// path returns a random chain of n blocks from a root; depthBias makes it
// stay on branch 0, so paths share long prefixes.
func (u *universe) path(n int) []uint64 {
	keys := make([]uint64, n)
	k := u.roots[u.rng.IntN(len(u.roots))]
	for i := range keys {
		if i > 0 {
			br := 0
			if u.rng.IntN(6) == 0 {
				br = 1 + u.rng.IntN(2)
			}
			k = chainKey(k, br)
		}
		keys[i] = k
	}
	return keys
}

// scattered returns each of keys with probability 1/n, in order: the
// blocks an eviction takes out of a chain, leaving holes.
func scattered(rng *rand.Rand, keys []uint64, n int) []uint64 {
	var out []uint64
	for _, k := range keys {
		if rng.IntN(n) == 0 {
			out = append(out, k)
		}
	}
	return out
}

type propConfig struct {
	models, holders, ops, maxLen int
	// engineLike keeps holdings prefix-closed (no scattered removals), the
	// common case where lookups search by depth.
	engineLike bool
	tiers      []string
	groups     []int
}

func TestIndexMatchesBruteForce(t *testing.T) {
	cases := []propConfig{
		{models: 1, holders: 3, ops: 600, maxLen: 24, tiers: []string{"GPU"}, groups: []int{0}},
		{models: 1, holders: 4, ops: 600, maxLen: 40, tiers: []string{"GPU", "CPU"}, groups: []int{0, 1}},
		{models: 2, holders: 5, ops: 800, maxLen: 64, tiers: []string{"GPU", "CPU", "disk"}, groups: []int{0, 1, 2, 7, 9, -1}},
		{models: 1, holders: 2, ops: 1500, maxLen: 300, tiers: []string{"GPU", "CPU"}, groups: []int{0, 8}},
		{models: 1, holders: 3, ops: 1500, maxLen: 300, tiers: []string{"GPU", "CPU"}, groups: []int{0}, engineLike: true},
		{models: 1, holders: 4, ops: 800, maxLen: 64, tiers: []string{"GPU"}, groups: []int{0, 1}, engineLike: true},
	}
	seeds := sized(12, 3)
	// Share thresholds of 1 and 2 keep blocks in the layer, all of them
	// or those two holders hold; the default keeps these few holders'
	// blocks in their tables.
	for _, share := range []int{0, 1, 2} {
		n := seeds
		if share > 0 {
			n = sized(seeds, 1)
		}
		for ci, pc := range cases {
			// The long chains' cases cost the most: with every block in
			// the layer, 1500 operations took half a minute under -race.
			pc.ops = sized(pc.ops, min(pc.ops, 600))
			for seed := range n {
				t.Run(fmt.Sprintf("share%d/case%d/seed%d", share, ci, seed), func(t *testing.T) {
					checkAgainstBrute(t, pc, uint64(seed)*1000+uint64(ci), share)
				})
			}
		}
	}
}

// workload drives an index and the reference model with the same random
// operations.
type workload struct {
	t       *testing.T
	pc      propConfig
	rng     *rand.Rand
	u       *universe
	models  []string
	holders []Holder
	ref     *brute
	res     Result
	// searched counts runs compared with their searched version; shared
	// the checks that found blocks in the layer.
	searched, shared int
}

func newWorkload(t *testing.T, pc propConfig, seed uint64) *workload {
	rng := rand.New(rand.NewPCG(seed, 42))
	w := &workload{
		t:      t,
		pc:     pc,
		rng:    rng,
		u:      &universe{rng: rng, roots: []uint64{0, 1, chainKey(7, 7)}},
		models: []string{"m0", "m1", "m/2@x"}[:pc.models],
		ref:    newBrute(),
	}
	for i := range pc.holders {
		w.holders = append(w.holders, Holder{Pod: fmt.Sprintf("10.0.0.%d:8000", i%3), Rank: i / 3})
	}
	return w
}

// mutate applies one random write to ix and the model.
func (w *workload) mutate(ix *Index) {
	rng, pc, ref := w.rng, w.pc, w.ref
	model, h := w.models[rng.IntN(len(w.models))], w.holders[rng.IntN(len(w.holders))]
	tier, group := pc.tiers[rng.IntN(len(pc.tiers))], pc.groups[rng.IntN(len(pc.groups))]
	p := w.u.path(1 + rng.IntN(pc.maxLen))
	switch r := rng.IntN(84); {
	case r < 45: // an engine storing a chain segment, usually from block 0
		a := 0
		if rng.IntN(3) == 0 {
			a = rng.IntN(len(p))
		}
		seg := p[a:]
		hasParent := a > 0 && (pc.engineLike || rng.IntN(4) != 0) // else a token-less store
		var parent uint64
		if a > 0 {
			parent = p[a-1]
		}
		ix.Store(Blocks{Model: model, Holder: h, Tier: tier, Group: group, Parent: parentIf(hasParent, parent), Keys: seg})
		ref.store(model, h, tier, group, seg)
	case r < 65 || pc.engineLike && r < 80: // evicting a tail, as engines do
		a := rng.IntN(len(p))
		ix.Remove(model, h, tier, group, p[a:])
		ref.remove(model, h, tier, group, p[a:])
	case r < 80: // evicting scattered blocks: holes
		ks := scattered(rng, p, 3)
		ix.Remove(model, h, tier, group, ks)
		ref.remove(model, h, tier, group, ks)
	case r < 83:
		if rng.IntN(2) == 0 {
			tier = ""
		}
		ix.ClearHolder(model, h, tier)
		ref.clear(model, h, tier)
	default:
		ix.RemoveHolder(h)
		ref.removeHolder(h)
	}
}

// check compares a few random lookups, runs and holder lists of ix with the
// model's.
func (w *workload) check(ix *Index, op int) {
	t, rng, ref := w.t, w.rng, w.ref
	for range 3 {
		model, h := w.models[rng.IntN(len(w.models))], w.holders[rng.IntN(len(w.holders))]
		q := w.u.path(1 + rng.IntN(w.pc.maxLen))
		if rng.IntN(5) == 0 {
			q = append(q, chainKey(q[len(q)-1], 99))
		}
		ix.Lookup(model, q, &w.res)
		require.Equal(t, ref.lookup(model, q), hitsByHolder(&w.res), "op %d lookup", op)
		start := rng.IntN(len(q) + 1)
		var names []string
		if rng.IntN(2) == 0 {
			names = []string{w.pc.tiers[rng.IntN(len(w.pc.tiers))]}
		}
		require.Equal(t, ref.run(model, h, q, start, names), ix.Run(model, h, q, start, names), "op %d run from %d in %v", op, start, names)
		ki := rng.IntN(len(q))
		k := q[ki]
		require.ElementsMatch(t, ref.holders(model, k), ix.Holders(model, k, nil), "op %d holders", op)
		require.ElementsMatch(t, ref.holders(model, k), ix.HoldersAt(model, q, ki, nil), "op %d holders at %d", op, ki)
		if ms := ix.model(model, false); ms != nil {
			require.ElementsMatch(t, ref.holders(model, k), ms.holdersFromRoots(q, ki, nil), "op %d holders from roots at %d", op, ki)
		}
		w.searched += checkSearch(t, ix, model, q, start)
		if ix.Stats().SharedBlocks > 0 {
			w.shared++
		}
	}
}

// checkCounts compares the holdings counts of ix with the model's.
func (w *workload) checkCounts(ix *Index, op int) {
	require.Equal(w.t, w.ref.total(), ix.Stats().HolderBlocks, "op %d total", op)
	for _, m := range w.models {
		for _, h := range w.holders {
			require.Equal(w.t, w.ref.blocks(m, h), ix.HolderBlocks(m, h), "op %d blocks %s %v", op, m, h)
		}
	}
}

func checkAgainstBrute(t *testing.T, pc propConfig, seed uint64, share int) {
	w := newWorkload(t, pc, seed)
	ix := New(Config{MaxHolderBlocks: -1, ShareThreshold: share})
	for op := range pc.ops {
		if w.rng.IntN(100) < 84 {
			w.mutate(ix)
		} else {
			w.check(ix, op)
		}
		if op%50 == 0 {
			w.checkCounts(ix, op)
			checkInvariants(t, ix, op)
		}
	}
	if pc.engineLike {
		require.Positive(t, w.searched, "no lookup searched by depth")
	}
	if share == 1 {
		require.Positive(t, w.shared, "no block was shared")
	}
}

// checkSearch compares, for every table of model with its gaps listed, the
// searching run with the block-by-block one, and returns how many it
// compared.
func checkSearch(t *testing.T, ix *Index, model string, keys []uint64, start int) int {
	ms := ix.model(model, false)
	if ms == nil || start >= len(keys) {
		return 0
	}
	n := 0
	for _, hs := range *ms.list.Load() {
		for _, ts := range hs.tierList() {
			tab := ts.tab.Load()
			g := int(tab.gapN.Load())
			if g < 0 {
				continue
			}
			require.Equal(t, tab.linear(keys, start), tab.search(keys, start, g), "search of %v %s from %d", hs.h, ts.name, start)
			n++
		}
		ly := ms.layer
		v := hs.lid.Load()
		for lane := range ly.lanes {
			g := int(ly.lanes[lane].gapN.Load())
			if v == 0 || g < 0 {
				continue
			}
			require.Equal(t, ly.linear(keys, start, lane, v-1, nil), ly.search(keys, start, lane, v-1, g, nil), "layer search of %v lane %d from %d", hs.h, lane, start)
			n++
		}
	}
	return n
}

func TestLookupsStayExactThroughEvictions(t *testing.T) {
	pc := propConfig{models: 1, holders: 3, ops: 800, maxLen: 64, tiers: []string{"GPU", "CPU"}, groups: []int{0, 1}, engineLike: true}
	for seed := range uint64(6) {
		w := newWorkload(t, pc, 500+seed)
		// Small limits: the oldest blocks, often parents, go first. The
		// reference model no longer knows what is held, so the oracle
		// asks the tables and the layer block by block.
		ix := New(Config{HolderCapacity: 150, MaxHolderBlocks: 300, ShareThreshold: []int{0, 1, 2}[seed%3]})
		for op := range pc.ops {
			w.mutate(ix)
			if op%40 == 0 {
				checkInvariants(t, ix, op)
			}
			if op%4 != 0 {
				continue
			}
			q := w.u.path(1 + w.rng.IntN(pc.maxLen))
			var res Result
			ix.Lookup("m0", q, &res)
			require.Equal(t, oracleLookup(ix, "m0", q), hitsByHolder(&res), "seed %d op %d", seed, op)
			w.searched += checkSearch(t, ix, "m0", q, w.rng.IntN(len(q)))
		}
		s := ix.Stats()
		require.Positive(t, s.EvictedCapacity+s.EvictedBudget)
		require.LessOrEqual(t, s.HolderBlocks, int64(300))
		require.Positive(t, w.searched)
	}
}

// oracleLookup is Lookup computed by probing every block of every table.
func oracleLookup(ix *Index, model string, keys []uint64) map[Holder]Hit {
	out := make(map[Holder]Hit)
	ms := ix.model(model, false)
	if ms == nil {
		return out
	}
	ly := ms.layer
	for _, hs := range *ms.list.Load() {
		hit := Hit{Holder: hs.h}
		tiers := hs.tierList()
		inTier := func(ts *tierState, k uint64) bool {
			if held(ts.tab.Load().get(k)) {
				return true
			}
			lane, v := ly.laneOf(ts.name), hs.lid.Load()
			if lane < 0 || v == 0 {
				return false
			}
			h, _ := ly.look([]uint64{k}, 0, lane, v-1, nil)
			return h
		}
		heldAt := func(i int) bool {
			for _, ts := range tiers {
				if inTier(ts, keys[i]) {
					return true
				}
			}
			return false
		}
		for _, ts := range tiers {
			n := 0
			for n < len(keys) && inTier(ts, keys[n]) {
				n++
			}
			if n > 0 {
				hit.Tiers = append(hit.Tiers, TierPrefix{ts.name, n})
			}
		}
		for hit.Prefix < len(keys) && heldAt(hit.Prefix) {
			hit.Prefix++
		}
		if hit.Prefix > 0 {
			sortTiers(hit.Tiers)
			out[hs.h] = hit
		}
	}
	return out
}

// checkInvariants verifies the writer-side bookkeeping lookups rely on, for
// every holder: each anchor names a slot whose depth is one less, children
// counts and the gap set match the held slots, the published gap list
// matches the gap set (or is -1 past maxGaps), and every held slot is in
// the eviction queue, so capacity can always be enforced; and the roots
// lookups start from (checkRoots). As in checkLayer, a per-slot require
// runs only once its condition failed.
func checkInvariants(t *testing.T, ix *Index, op int) {
	checkRoots(t, ix, op)
	checkLayer(t, ix, op)
	ix.models.Range(func(model string, ms *modelState) bool {
		for _, hs := range *ms.list.Load() {
			hs.mu.Lock()
			tiers := hs.tierList()
			queued := make([]map[uint32]bool, len(tiers))
			for ti := range queued {
				queued[ti] = make(map[uint32]bool)
			}
			for r := hs.head; r < len(hs.fifoSlot); r++ {
				if hs.fifoTier[r] < fifoLayer {
					queued[hs.fifoTier[r]][hs.fifoSlot[r]] = true
				}
			}
			var live int64
			for ti, ts := range tiers {
				tab := ts.tab.Load()
				children := make([]int, len(tab.slots))
				var held64 int64
				for i := range tab.slots {
					m := tab.slots[i].meta
					if m == 0 {
						continue
					}
					if p := parentOf(m); p >= 0 {
						if pm := tab.slots[p].meta; pm == 0 || depthOf(m) != min(depthOf(pm)+1, metaDepthMax) {
							require.NotZero(t, pm, "op %d %s %v: anchor of an empty slot", op, model, hs.h)
							require.Equal(t, min(depthOf(pm)+1, metaDepthMax), depthOf(m), "op %d %s %v: depth", op, model, hs.h)
						}
						if held(m) {
							children[p]++
						}
					}
					if held(m) {
						held64++
						if !queued[ti][uint32(i)] {
							require.True(t, queued[ti][uint32(i)], "op %d %s %v: held slot not in the eviction queue", op, model, hs.h)
						}
					}
				}
				gaps := make(map[uint64]uint64)
				for i := range tab.slots {
					m := tab.slots[i].meta
					if m == 0 {
						continue
					}
					if c := ts.children(tab, i, m); c != children[i] {
						require.Equal(t, children[i], c, "op %d %s %v: children", op, model, hs.h)
					}
					if !held(m) && children[i] > 0 {
						gaps[tab.slots[i].key] = uint64(depthOf(m))
					}
				}
				require.Equal(t, gaps, orEmpty(ts.gaps), "op %d %s %v: gaps", op, model, hs.h)
				if g := int(tab.gapN.Load()); g >= 0 {
					listed := make(map[uint64]uint64)
					for j := range g {
						listed[tab.gaps[j].key.Load()] = tab.gaps[j].depth.Load()
					}
					require.Equal(t, gaps, listed, "op %d %s %v: published gaps", op, model, hs.h)
				} else {
					require.Greater(t, len(gaps), maxGaps, "op %d %s %v: gaps unlisted although few", op, model, hs.h)
				}
				require.Equal(t, held64, ts.live, "op %d %s %v: tier count", op, model, hs.h)
				live += held64
			}
			for _, n := range hs.laneLive {
				live += n
			}
			require.Equal(t, live, hs.live.Load(), "op %d %s %v: holder count", op, model, hs.h)
			if c := hs.capacity.Load(); c > 0 {
				require.LessOrEqual(t, live, c, "op %d %s %v: capacity", op, model, hs.h)
			}
			hs.mu.Unlock()
		}
		return true
	})
}

// checkRoots verifies the model's roots: each holder is listed under a key
// exactly once while one of its tiers has a depth-0 slot for it, and only
// then.
func checkRoots(t *testing.T, ix *Index, op int) {
	ix.models.Range(func(model string, ms *modelState) bool {
		want := make(map[uint64]map[*holderState]int)
		for _, hs := range *ms.list.Load() {
			hs.mu.Lock()
			for _, ts := range hs.tierList() {
				tab := ts.tab.Load()
				for i := range tab.slots {
					if m := tab.slots[i].meta; m != 0 && depthOf(m) == 0 {
						k := tab.slots[i].key
						if want[k] == nil {
							want[k] = make(map[*holderState]int)
						}
						want[k][hs] = 1
					}
				}
			}
			hs.mu.Unlock()
		}
		got := make(map[uint64]map[*holderState]int)
		ms.roots.Range(func(k uint64, rs *rootSet) bool {
			got[k] = make(map[*holderState]int)
			for _, hs := range *rs.holders.Load() {
				got[k][hs]++
			}
			return true
		})
		require.Equal(t, want, got, "op %d %s: roots", op, model)
		return true
	})
}

func orEmpty(m map[uint64]uint64) map[uint64]uint64 {
	if m == nil {
		return map[uint64]uint64{}
	}
	return m
}
