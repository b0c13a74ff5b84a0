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
	for ci, pc := range cases {
		pc.ops = sized(pc.ops, min(pc.ops, 600))
		for seed := range seeds {
			t.Run(fmt.Sprintf("case%d/seed%d", ci, seed), func(t *testing.T) {
				checkAgainstBrute(t, pc, uint64(seed)*1000+uint64(ci))
			})
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
	// shared counts the checks that found blocks with two or more holders.
	shared int
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

func checkAgainstBrute(t *testing.T, pc propConfig, seed uint64) {
	w := newWorkload(t, pc, seed)
	ix := New(Config{MaxHolderBlocks: -1})
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
	if pc.holders > 1 {
		require.Positive(t, w.shared, "no block had two holders")
	}
}

func TestLookupsStayExactThroughEvictions(t *testing.T) {
	pc := propConfig{models: 1, holders: 3, ops: 800, maxLen: 64, tiers: []string{"GPU", "CPU"}, groups: []int{0, 1}, engineLike: true}
	for seed := range uint64(6) {
		w := newWorkload(t, pc, 500+seed)
		// Small limits: the oldest blocks, often parents, go first. The
		// reference model no longer knows what is held, so the oracle
		// asks the entries block by block.
		ix := New(Config{HolderCapacity: 150, MaxHolderBlocks: 300})
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
		}
		s := ix.Stats()
		require.Positive(t, s.EvictedCapacity+s.EvictedBudget)
		require.LessOrEqual(t, s.HolderBlocks, int64(300))
	}
}

// oracleLookup is Lookup computed by reading every block's entry for
// every holder.
func oracleLookup(ix *Index, model string, keys []uint64) map[Holder]Hit {
	out := make(map[Holder]Hit)
	ms := ix.model(model, false)
	if ms == nil {
		return out
	}
	for _, hs := range *ms.list.Load() {
		hit := Hit{Holder: hs.h}
		held := func(i int) uint8 {
			v, ok := ms.view(keys[i])
			if !ok {
				return 0
			}
			return v.heldOf(hs.id)
		}
		for l, name := range hs.laneNames() {
			n := 0
			for n < len(keys) && held(n)&(1<<l) != 0 {
				n++
			}
			if n > 0 {
				hit.Tiers = append(hit.Tiers, TierPrefix{name, n})
			}
		}
		for hit.Prefix < len(keys) && held(hit.Prefix) != 0 {
			hit.Prefix++
		}
		if hit.Prefix > 0 {
			sortTiers(hit.Tiers)
			out[hs.h] = hit
		}
	}
	return out
}
