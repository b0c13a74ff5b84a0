package index

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// ordered is the reference model of TestIndexMatchesOrderedModel: per
// model and holder, its holdings in the order they became held, which is
// the order evictions take them in. A holding dropped (removed, evicted)
// is burned: the workload does not store it again until its tier is
// cleared, so that its place in that order is never in question (the
// index keeps a re-stored holding's first place until it next compacts).
type ordered struct {
	holders                        map[string]map[Holder]*orderedHolder
	caps                           map[Holder]int
	evictedCapacity, evictedBudget int
}

type orderedHolding struct {
	tier   string
	key    uint64
	groups map[int]bool
}

type orderedHolder struct {
	order  []*orderedHolding // oldest first; dropped ones have no groups
	held   map[string]map[uint64]*orderedHolding
	burned map[string]map[uint64]bool
}

func newOrdered() *ordered {
	return &ordered{holders: make(map[string]map[Holder]*orderedHolder), caps: make(map[Holder]int)}
}

func (o *ordered) holder(model string, h Holder) *orderedHolder {
	if o.holders[model] == nil {
		o.holders[model] = make(map[Holder]*orderedHolder)
	}
	oh := o.holders[model][h]
	if oh == nil {
		oh = &orderedHolder{held: make(map[string]map[uint64]*orderedHolding), burned: make(map[string]map[uint64]bool)}
		o.holders[model][h] = oh
	}
	return oh
}

func (oh *orderedHolder) live() int {
	n := 0
	for _, set := range oh.held {
		n += len(set)
	}
	return n
}

// usable returns keys up to the first that h burned in tier.
func (oh *orderedHolder) usable(tier string, keys []uint64) []uint64 {
	for i, k := range keys {
		if oh.burned[tier][k] {
			return keys[:i]
		}
	}
	return keys
}

func (oh *orderedHolder) drop(hd *orderedHolding) {
	delete(oh.held[hd.tier], hd.key)
	clear(hd.groups)
	if oh.burned[hd.tier] == nil {
		oh.burned[hd.tier] = make(map[uint64]bool)
	}
	oh.burned[hd.tier][hd.key] = true
}

// evict drops h's n oldest holdings.
func (oh *orderedHolder) evict(n int) int {
	done := 0
	for done < n && len(oh.order) > 0 {
		hd := oh.order[0]
		oh.order = oh.order[1:]
		if len(hd.groups) > 0 {
			oh.drop(hd)
			done++
		}
	}
	return done
}

func (o *ordered) total() int {
	n := 0
	for _, hs := range o.holders {
		for _, oh := range hs {
			n += oh.live()
		}
	}
	return n
}

func (o *ordered) store(model string, h Holder, tier string, group int, keys []uint64) {
	oh := o.holder(model, h)
	if oh.held[tier] == nil {
		oh.held[tier] = make(map[uint64]*orderedHolding)
	}
	for _, k := range keys {
		hd := oh.held[tier][k]
		if hd == nil {
			hd = &orderedHolding{tier: tier, key: k, groups: make(map[int]bool)}
			oh.held[tier][k] = hd
			oh.order = append(oh.order, hd)
		}
		hd.groups[group] = true
	}
}

// enforceCapacity evicts past h's capacity, as a store does.
func (o *ordered) enforceCapacity(model string, h Holder, fallback int) {
	oh := o.holder(model, h)
	c, ok := o.caps[h]
	if !ok {
		c = fallback
	}
	if over := oh.live() - c; c > 0 && over > 0 {
		o.evictedCapacity += oh.evict(over)
	}
}

func (o *ordered) remove(model string, h Holder, tier string, group int, keys []uint64) {
	oh := o.holders[model][h]
	if oh == nil {
		return
	}
	for _, k := range keys {
		if hd := oh.held[tier][k]; hd != nil && hd.groups[group] {
			delete(hd.groups, group)
			if len(hd.groups) == 0 {
				oh.drop(hd)
			}
		}
	}
}

func (o *ordered) clear(model string, h Holder, tier string) {
	oh := o.holders[model][h]
	if oh == nil {
		return
	}
	for t, set := range oh.held {
		if tier != "" && t != tier {
			continue
		}
		for _, hd := range set {
			clear(hd.groups)
		}
		delete(oh.held, t)
		delete(oh.burned, t)
	}
	oh.order = slices.DeleteFunc(oh.order, func(hd *orderedHolding) bool { return len(hd.groups) == 0 })
}

func (o *ordered) removeHolder(h Holder) {
	for _, hs := range o.holders {
		delete(hs, h)
	}
}

// brute returns the holdings as the brute-force model, for its answers.
func (o *ordered) brute() *brute {
	b := newBrute()
	for model, hs := range o.holders {
		for h, oh := range hs {
			for tier, set := range oh.held {
				for k, hd := range set {
					for g := range hd.groups {
						b.store(model, h, tier, g, []uint64{k})
					}
				}
			}
		}
	}
	return b
}

// orderedWorkload drives an index and the ordered model, and readers that
// look up concurrently.
type orderedWorkload struct {
	*workload
	o        *ordered
	cfg      Config
	ix       atomic.Pointer[Index]
	stable   Holder
	stableP  []uint64
	dir      string
	reloads  int
	evicting bool
	// budgetEvictions counts the model's budget evictions over reloads.
	budgetEvictions int
}

// applyBudget follows the index's eviction past the total budget: the
// largest holder's oldest holdings, a little more than the excess. Which
// of several largest holders pays the index decides; the model checks it
// was one of them.
func (w *orderedWorkload) applyBudget(model string, h Holder) {
	budget := w.ix.Load().Budget()
	over := w.o.total() - int(budget)
	if budget < 0 || over <= 0 {
		return
	}
	over += int(min(1024, budget/256))
	most := -1
	var largest []HolderModel
	for m, hs := range w.o.holders {
		for hh, oh := range hs {
			switch n := oh.live(); {
			case n > most:
				most, largest = n, []HolderModel{{m, hh}}
			case n == most:
				largest = append(largest, HolderModel{m, hh})
			}
		}
	}
	victim := largest[0]
	if len(largest) > 1 {
		// The one whose holdings the index dropped.
		for _, c := range largest {
			if sumBlocks(w.ix.Load().HolderBlocks(c.Model, c.Holder)) < most {
				victim = c
			}
		}
	}
	n := w.o.holders[victim.Model][victim.Holder].evict(over)
	w.o.evictedBudget += n
	w.budgetEvictions += n
}

func sumBlocks(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func (w *orderedWorkload) step(op int) {
	ix, o, rng, pc := w.ix.Load(), w.o, w.rng, w.pc
	model, h := w.models[rng.IntN(len(w.models))], w.holders[rng.IntN(len(w.holders))]
	tier, group := pc.tiers[rng.IntN(len(pc.tiers))], pc.groups[rng.IntN(len(pc.groups))]
	p := w.u.path(1 + rng.IntN(pc.maxLen))
	switch r := rng.IntN(100); {
	case r < 50:
		a := 0
		if rng.IntN(3) == 0 {
			a = rng.IntN(len(p))
		}
		seg := o.holder(model, h).usable(tier, p[a:])
		if len(seg) == 0 {
			return
		}
		b := Blocks{Model: model, Holder: h, Tier: tier, Group: group, Keys: seg}
		if a > 0 && rng.IntN(4) != 0 {
			b.Parent = ParentKey(p[a-1])
		}
		ix.Store(b)
		o.store(model, h, tier, group, seg)
		o.enforceCapacity(model, h, w.cfg.HolderCapacity)
		w.applyBudget(model, h)
	case r < 70:
		a := rng.IntN(len(p))
		ix.Remove(model, h, tier, group, p[a:])
		o.remove(model, h, tier, group, p[a:])
	case r < 82:
		ks := scattered(rng, p, 3)
		ix.Remove(model, h, tier, group, ks)
		o.remove(model, h, tier, group, ks)
	case r < 86:
		if rng.IntN(2) == 0 {
			tier = ""
		}
		ix.ClearHolder(model, h, tier)
		o.clear(model, h, tier)
	case r < 88:
		ix.RemoveHolder(h)
		o.removeHolder(h)
	case r < 92 && w.evicting:
		c := 20 + rng.IntN(200)
		ix.SetHolderCapacity(h, c)
		o.caps[h] = c
		// A capacity applies at the holder's next store in each model.
		for _, m := range w.models {
			k := []uint64{chainKey(uint64(op), 12345)}
			ix.Store(Blocks{Model: m, Holder: h, Tier: tier, Keys: k})
			o.store(m, h, tier, 0, k)
			o.enforceCapacity(m, h, w.cfg.HolderCapacity)
			w.applyBudget(m, h)
		}
	case r < 94:
		w.reload(op)
	default:
		w.compare(op)
	}
}

// reload saves the index, loads it back and carries on with the copy.
func (w *orderedWorkload) reload(op int) {
	ix := w.ix.Load()
	seqs := map[Holder]uint64{w.holders[0]: uint64(op)}
	path := filepath.Join(w.dir, fmt.Sprintf("snap-%d", op))
	require.NoError(w.t, ix.SaveFile(path, seqs))
	loaded, got, err := LoadFile(path, w.cfg)
	require.NoError(w.t, err)
	require.Equal(w.t, seqs, got)
	// Counters start again with the loaded index, which applies the
	// capacities set since the holders' last stores.
	w.o.evictedCapacity, w.o.evictedBudget = 0, 0
	for m, hs := range w.o.holders {
		for h := range hs {
			w.o.enforceCapacity(m, h, w.cfg.HolderCapacity)
		}
	}
	w.ix.Store(loaded)
	w.reloads++
	w.compare(op)
}

// compare checks every answer of the index against the model's.
func (w *orderedWorkload) compare(op int) {
	t, ix, rng := w.t, w.ix.Load(), w.rng
	checkInvariants(t, ix, op)
	ref := w.o.brute()
	st := ix.Stats()
	require.Equal(t, int64(w.o.total()), st.HolderBlocks, "op %d holdings", op)
	require.Equal(t, uint64(w.o.evictedCapacity), st.EvictedCapacity, "op %d evicted past capacity", op)
	require.Equal(t, uint64(w.o.evictedBudget), st.EvictedBudget, "op %d evicted past the budget", op)
	for _, m := range append(slices.Clone(w.models), "stable") {
		for _, h := range append(slices.Clone(w.holders), w.stable) {
			require.Equal(t, ref.blocks(m, h), ix.HolderBlocks(m, h), "op %d blocks of %v in %s", op, h, m)
		}
	}
	for range 4 {
		model := w.models[rng.IntN(len(w.models))]
		q := w.u.path(1 + rng.IntN(w.pc.maxLen))
		ix.Lookup(model, q, &w.res)
		require.Equal(t, ref.lookup(model, q), hitsByHolder(&w.res), "op %d lookup", op)
		h := w.holders[rng.IntN(len(w.holders))]
		start := rng.IntN(len(q))
		require.Equal(t, ref.run(model, h, q, start, nil), ix.Run(model, h, q, start, nil), "op %d run", op)
		require.ElementsMatch(t, ref.holders(model, q[start]), ix.HoldersAt(model, q, start, nil), "op %d holders at %d", op, start)
	}
}

// TestIndexMatchesOrderedModel drives the index and a model that keeps
// each holder's blocks in order (so that it knows which ones evictions
// take) with random adds, removals, clears, removed holders, ranks, tiers
// and groups, capacities and the total budget, and snapshots reloaded
// midway, while readers look up concurrently: a holder no write touches
// must read exactly throughout, and every answer must be possible.
func TestIndexMatchesOrderedModel(t *testing.T) {
	cases := []struct {
		name string
		pc   propConfig
		cfg  Config
	}{
		{"no limits", propConfig{models: 2, holders: 6, ops: 1000, maxLen: 64, tiers: []string{"GPU", "CPU"}, groups: []int{0, 1, 9}}, Config{MaxHolderBlocks: -1}},
		{"capacities", propConfig{models: 1, holders: 5, ops: 1000, maxLen: 100, tiers: []string{"GPU", "CPU", "disk"}, groups: []int{0}}, Config{HolderCapacity: 150, MaxHolderBlocks: -1}},
		{"budget", propConfig{models: 2, holders: 7, ops: 1000, maxLen: 80, tiers: []string{"GPU", "CPU"}, groups: []int{0, 2}}, Config{MaxHolderBlocks: 400}},
	}
	seeds := sized(3, 1)
	for _, tc := range cases {
		tc.pc.ops = sized(tc.pc.ops, 400)
		for seed := range seeds {
			t.Run(fmt.Sprintf("%s/seed%d", tc.name, seed), func(t *testing.T) {
				w := &orderedWorkload{
					workload: newWorkload(t, tc.pc, 900+uint64(seed)),
					o:        newOrdered(),
					cfg:      tc.cfg,
					stable:   Holder{Pod: "stable:8000", Rank: 1},
					dir:      t.TempDir(),
					evicting: tc.cfg.HolderCapacity > 0,
				}
				w.ix.Store(New(tc.cfg))
				w.stableP = chain(77, 8)
				w.ix.Load().Store(Blocks{Model: "stable", Holder: w.stable, Tier: TierGPU, Keys: w.stableP})
				w.o.store("stable", w.stable, TierGPU, 0, w.stableP)

				var stop atomic.Bool
				var wg sync.WaitGroup
				var reads atomic.Int64
				for r := range 2 {
					wg.Go(func() {
						var res Result
						u := &universe{rng: rand.New(rand.NewPCG(uint64(r), 5)), roots: w.u.roots}
						var dst []Holder
						for !stop.Load() {
							ix := w.ix.Load()
							ix.Lookup("stable", w.stableP, &res)
							if len(res.Hits) != 1 || res.Hits[0].Prefix != len(w.stableP) || res.Hits[0].Tier(TierGPU) != len(w.stableP) {
								t.Errorf("stable chain: %+v", res.Hits)
								return
							}
							q := u.path(1 + u.rng.IntN(tc.pc.maxLen))
							ix.Lookup(w.models[0], q, &res)
							for _, hit := range res.Hits {
								if hit.Prefix < 1 || hit.Prefix > len(q) || !slices.Contains(w.holders, hit.Holder) {
									t.Errorf("impossible hit %+v for %d keys", hit, len(q))
									return
								}
								for _, tp := range hit.Tiers {
									if tp.Blocks < 1 || tp.Blocks > hit.Prefix {
										t.Errorf("impossible tier %+v in %+v", tp, hit)
										return
									}
								}
							}
							dst = ix.HoldersAt(w.models[0], q, len(q)-1, dst)
							if len(dst) > len(w.holders) {
								t.Errorf("%d holders of one block", len(dst))
								return
							}
							reads.Add(1)
						}
					})
				}
				for op := range tc.pc.ops {
					w.step(op)
				}
				w.compare(tc.pc.ops)
				stop.Store(true)
				wg.Wait()
				t.Logf("reads %d reloads %d budget evictions %d capacity evictions %d", reads.Load(), w.reloads, w.budgetEvictions, w.o.evictedCapacity)
				require.Positive(t, reads.Load())
				require.Positive(t, w.reloads)
				if tc.cfg.MaxHolderBlocks > 0 {
					require.Positive(t, w.budgetEvictions, "the budget never evicted")
				}
			})
		}
	}
}
