package index

// Lookup sets res.Hits to one Hit per holder of model that holds a
// non-empty prefix of keys. keys must be a prompt's block keys in order,
// each the child of the one before (as the hashing package returns them).
// Lookup takes no lock, and with a reused res it does not allocate once
// res has grown to the number of hits.
func (ix *Index) Lookup(model string, keys []uint64, res *Result) {
	hits := res.Hits[:0]
	ms := ix.model(model, false)
	if ms == nil || len(keys) == 0 {
		res.Hits = hits
		return
	}
	for _, hs := range *ms.list.Load() {
		tiers := hs.tierList()
		if len(hits) < cap(hits) {
			hits = hits[:len(hits)+1]
		} else {
			hits = append(hits, Hit{})
		}
		hit := &hits[len(hits)-1]
		tps := hit.Tiers[:0]
		prefix := 0
		for _, ts := range tiers {
			if n := runFrom(ts.tab.Load(), keys, 0); n > 0 {
				tps = append(tps, TierPrefix{Tier: ts.name, Blocks: n})
				prefix = max(prefix, n)
			}
		}
		if prefix > 0 && len(tiers) > 1 {
			prefix = extend(tiers, nil, keys, prefix)
		}
		hit.Tiers = tps
		if prefix == 0 {
			hits = hits[:len(hits)-1]
			continue
		}
		hit.Holder = hs.h
		hit.Prefix = prefix
	}
	res.Hits = hits
}

// Run returns how many consecutive blocks from keys[start] h holds for
// model in any of tiers (nil means any tier): what h could supply after a
// destination's own prefix of start blocks. keys must be a chain as for
// Lookup.
func (ix *Index) Run(model string, h Holder, keys []uint64, start int, tiers []string) int {
	if start < 0 || start >= len(keys) {
		return 0
	}
	ms := ix.model(model, false)
	if ms == nil {
		return 0
	}
	hs, ok := ms.holders.Load(h)
	if !ok {
		return 0
	}
	return extend(hs.tierList(), tiers, keys, start) - start
}

// extend returns the end of the run starting at pos held in any of the
// holder's tiers named in names (all when names is nil): a block counts
// when one tier holds it, so the run hops between tiers.
func extend(tiers []*tierState, names []string, keys []uint64, pos int) int {
	for pos < len(keys) {
		best := 0
		for _, ts := range tiers {
			if names != nil && !contains(names, ts.name) {
				continue
			}
			best = max(best, runFrom(ts.tab.Load(), keys, pos))
		}
		if best == 0 {
			break
		}
		pos += best
	}
	return pos
}

func contains(names []string, s string) bool {
	for _, n := range names {
		if n == s {
			return true
		}
	}
	return false
}

// Holders appends to dst[:0] the holders of model that hold key in any tier.
func (ix *Index) Holders(model string, key uint64, dst []Holder) []Holder {
	dst = dst[:0]
	ms := ix.model(model, false)
	if ms == nil {
		return dst
	}
	for _, hs := range *ms.list.Load() {
		for _, ts := range hs.tierList() {
			if held(ts.tab.Load().get(key)) {
				dst = append(dst, hs.h)
				break
			}
		}
	}
	return dst
}

// runFrom returns how many consecutive blocks from keys[b] t holds. With no
// broken link in t it gallops; if a writer broke a link meanwhile, or one
// was broken already, it checks block by block.
func runFrom(t *table, keys []uint64, b int) int {
	if b >= len(keys) {
		return 0
	}
	e := t.epoch.Load()
	if t.brk.Load() == 0 {
		n := t.gallop(keys, b)
		if t.epoch.Load() == e {
			return n
		}
	}
	return t.linear(keys, b)
}

func (t *table) linear(keys []uint64, b int) int {
	i := b
	for i < len(keys) && held(t.get(keys[i])) {
		i++
	}
	return i - b
}

// gallop is runFrom for a table without broken links. A held block whose
// depth is at least j-pos has j-pos held ancestors; keys being a chain,
// those are keys[pos:j]. That predicate only gets false further along a
// segment, so exponential then binary search finds the segment's end
// exactly. A segment ends early where a block was stored without its
// anchor; the next one starts right after.
func (t *table) gallop(keys []uint64, b int) int {
	n := len(keys)
	pos := b
	next := t.get(keys[pos])
	for held(next) {
		lo, hi := pos, n
		var him uint64
		for step := 1; ; step <<= 1 {
			j := lo + step
			if j >= hi {
				break
			}
			m := t.get(keys[j])
			if held(m) && depthOf(m) >= j-pos {
				lo = j
				continue
			}
			hi, him = j, m
			break
		}
		for hi-lo > 1 {
			mid := int(uint(lo+hi) >> 1)
			m := t.get(keys[mid])
			if held(m) && depthOf(m) >= mid-pos {
				lo = mid
			} else {
				hi, him = mid, m
			}
		}
		pos = lo + 1
		if pos >= n {
			break
		}
		if hi == pos {
			next = him
		} else {
			next = t.get(keys[pos])
		}
	}
	return pos - b
}
