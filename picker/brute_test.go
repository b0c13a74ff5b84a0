package picker

import (
	"github.com/kvsource/kvsource/index"
)

// bruteIndex is a reference index: plain maps, every answer by exhaustive
// search. Its methods do not allocate once warm, so allocation tests can run
// against it.
type bruteIndex struct {
	m map[string]map[index.Holder]map[string]map[uint64]bool
}

func newBrute() *bruteIndex {
	return &bruteIndex{m: map[string]map[index.Holder]map[string]map[uint64]bool{}}
}

func (b *bruteIndex) store(model string, h index.Holder, tier string, keys ...uint64) {
	hs := b.m[model]
	if hs == nil {
		hs = map[index.Holder]map[string]map[uint64]bool{}
		b.m[model] = hs
	}
	ts := hs[h]
	if ts == nil {
		ts = map[string]map[uint64]bool{}
		hs[h] = ts
	}
	ks := ts[tier]
	if ks == nil {
		ks = map[uint64]bool{}
		ts[tier] = ks
	}
	for _, k := range keys {
		ks[k] = true
	}
}

func (b *bruteIndex) holds(model string, h index.Holder, tier string, k uint64) bool {
	return b.m[model][h][tier][k]
}

func (b *bruteIndex) holdsAny(model string, h index.Holder, tiers []string, k uint64) bool {
	if tiers == nil {
		for _, ks := range b.m[model][h] {
			if ks[k] {
				return true
			}
		}
		return false
	}
	for _, t := range tiers {
		if b.holds(model, h, t, k) {
			return true
		}
	}
	return false
}

func (b *bruteIndex) Run(model string, h index.Holder, keys []uint64, start int, tiers []string) int {
	n := 0
	for i := start; i < len(keys) && b.holdsAny(model, h, tiers, keys[i]); i++ {
		n++
	}
	return n
}

func (b *bruteIndex) Holders(model string, key uint64, dst []index.Holder) []index.Holder {
	dst = dst[:0]
	for h := range b.m[model] {
		if b.holdsAny(model, h, nil, key) {
			dst = append(dst, h)
		}
	}
	return dst
}

func (b *bruteIndex) Lookup(model string, keys []uint64, res *index.Result) {
	res.Hits = res.Hits[:0]
	for h, ts := range b.m[model] {
		p := b.Run(model, h, keys, 0, nil)
		if p == 0 {
			continue
		}
		n := len(res.Hits)
		if n < cap(res.Hits) {
			res.Hits = res.Hits[:n+1]
		} else {
			res.Hits = append(res.Hits, index.Hit{})
		}
		hit := &res.Hits[n]
		hit.Holder, hit.Prefix, hit.Tiers = h, p, hit.Tiers[:0]
		for t, ks := range ts {
			tp := 0
			for tp < len(keys) && ks[keys[tp]] {
				tp++
			}
			if tp > 0 {
				hit.Tiers = append(hit.Tiers, index.TierPrefix{Tier: t, Blocks: tp})
			}
		}
	}
}

func (b *bruteIndex) Models(dst []string) []string {
	dst = dst[:0]
	for m, hs := range b.m {
		if len(hs) > 0 {
			dst = append(dst, m)
		}
	}
	return dst
}
