package index

import (
	"math/bits"
	"slices"
	"sync"
)

// Lookup sets res.Hits to one Hit per holder of model that holds a
// non-empty prefix of keys. keys must be a prompt's block keys in order
// from its first block, each the child of the one before (as the hashing
// package returns them). Lookup takes no lock, and with a reused res it
// does not allocate once res has grown to the number of hits.
//
// Its cost follows the holders of keys[0], not the model's: the first
// block of a prompt has no parent, so every holder of it has it in the
// layer's entry for it or at depth 0 in a table, listed under it in the
// model's roots.
func (ix *Index) Lookup(model string, keys []uint64, res *Result) {
	hits := res.Hits[:0]
	ms := ix.model(model, false)
	if ms == nil || len(keys) == 0 {
		res.Hits = hits
		return
	}
	// The roots are read before the layer: a holder whose table slot for
	// keys[0] a rebuild drops after it moved to the layer is then in one
	// or the other.
	roots := ms.rootHolders(keys[0])
	ly := ms.layer
	var ids []uint32
	var memo *layerMemo
	if ly.active() {
		memo = &res.memo
		memo.reset(len(keys))
		released := ly.releases.Load()
		ids, res.union = ly.holdersOf(keys[0], res.ids[:0], res.union)
		res.ids = ids
		var lanes [layerLanes]bool
		if len(ids) > 0 {
			n := int(ids[len(ids)-1]) + 1
			for l := range res.pre {
				if lanes[l] = ly.laneName(l) != ""; lanes[l] {
					res.pre[l] = slices.Grow(res.pre[l][:0], n)[:n]
					res.alive, res.gone = ly.groupRun(keys, l, ids, res.pre[l], res.alive, res.gone, memo)
				}
			}
		}
		first := len(hits)
		for _, id := range ids {
			if hs := ly.holderAt(id); hs != nil {
				var start [layerLanes]int
				for l := range start {
					start[l] = -1
					if lanes[l] {
						start[l] = int(res.pre[l][id])
					}
				}
				hits = appendHit(hits, hs, ly, keys, memo, &start)
			}
		}
		if ly.releases.Load() != released {
			// An id read from the entries may now be another holder's:
			// ask each holder the ids name now about its own blocks.
			hits = hits[:first]
			for _, id := range ids {
				if hs := ly.holderAt(id); hs != nil {
					hits = appendHit(hits, hs, ly, keys, memo, &unknownStart)
				}
			}
		}
	}
	for _, hs := range roots {
		// A holder listed by the layer was asked already.
		if v := hs.lid.Load(); v != 0 && int((v-1)/64) < len(res.union) && len(ids) > 0 && res.union[(v-1)/64]&(1<<((v-1)%64)) != 0 {
			continue
		}
		hits = appendHit(hits, hs, ly, keys, memo, &unknownStart)
	}
	res.Hits = hits
}

// unknownStart is appendHit's start for a holder the layer did not list.
var unknownStart = [layerLanes]int{-1, -1}

// holdersOf appends to dst the ids of key's holders in any lane, sorted,
// using words as scratch for their union; it returns both grown.
func (ly *layer) holdersOf(key uint64, dst []uint32, words []uint64) ([]uint32, []uint64) {
	en, _ := ly.find(key)
	if en == nil {
		return dst, words
	}
	words = words[:0]
	for l := range en.lanes {
		words = en.lanes[l].addMembers(words)
	}
	if en.key.Load() != key {
		return dst, words
	}
	for w, x := range words {
		for ; x != 0; x &= x - 1 {
			dst = append(dst, uint32(w*64+bits.TrailingZeros64(x)))
		}
	}
	return dst, words
}

// appendHit appends hs's hit for keys to hits, or leaves hits as they are
// when hs holds no prefix of keys.
//
// start holds, per lane, how many blocks from keys[0] hs holds there
// when the caller knows it, else -1.
func appendHit(hits []Hit, hs *holderState, ly *layer, keys []uint64, memo *layerMemo, start *[layerLanes]int) []Hit {
	tiers := hs.tierList()
	if len(hits) < cap(hits) {
		hits = hits[:len(hits)+1]
	} else {
		hits = append(hits, Hit{})
	}
	hit := &hits[len(hits)-1]
	tps := hit.Tiers[:0]
	prefix := 0
	v := hs.lid.Load()
	for _, ts := range tiers {
		lane := -1
		if v != 0 {
			lane = ly.laneOf(ts.name)
		}
		var n int
		if lane >= 0 {
			n = extendTier(ts, ly, lane, v-1, keys, memo, start[lane])
		} else {
			n = runFrom(ts.tab.Load(), keys, 0)
			// A holder whose blocks move to the layer gets its id there
			// before its table lets them go.
			if w := hs.lid.Load(); n < len(keys) && w != 0 && w != v {
				if lane = ly.laneOf(ts.name); lane >= 0 {
					v = w
					n = extendTier(ts, ly, lane, w-1, keys, memo, -1)
				}
			}
		}
		if n > 0 {
			tps = appendTier(tps, ts.name, n)
			prefix = max(prefix, n)
		}
	}
	if prefix > 0 && len(tiers) > 1 {
		prefix = extend(hs, ly, nil, keys, prefix, memo)
	}
	if v != 0 && hs.lid.Load() != v {
		// hs is gone, its id freed, maybe to a holder whose blocks the
		// layer answered for: hs holds nothing now.
		prefix = 0
	}
	// A reused Result mostly gets back the holders and tiers it had:
	// skipping pointer writes that change nothing spares the write
	// barriers they cost while the GC marks, which lookups under
	// ingest spend a good part of their time in.
	if cap(tps) == cap(hit.Tiers) {
		hit.Tiers = hit.Tiers[:len(tps)]
	} else {
		hit.Tiers = tps
	}
	if prefix == 0 {
		return hits[:len(hits)-1]
	}
	if hit.Holder != hs.h {
		hit.Holder = hs.h
	}
	hit.Prefix = prefix
	return hits
}

// extendTier returns the prefix of keys held in tier ts, in its table or
// in lane of the layer (the holder's id there is id), from start blocks
// the caller knows held in the layer (-1: none known): a block counts when
// either holds it. The layer is asked again wherever the table's run
// stops, since a block moves to the layer before it leaves the table.
func extendTier(ts *tierState, ly *layer, lane int, id uint32, keys []uint64, memo *layerMemo, start int) int {
	pos := start
	if pos < 0 {
		pos = ly.run(keys, 0, lane, id, memo)
	}
	t := ts.tab.Load()
	for pos < len(keys) {
		a := runFrom(t, keys, pos)
		pos += a
		b := ly.run(keys, pos, lane, id, memo)
		pos += b
		if a == 0 && b == 0 {
			break
		}
	}
	return pos
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
	return extend(hs, ms.layer, tiers, keys, start, nil) - start
}

// extend returns the end of the run starting at pos held in any of the
// tiers of hs named in names (all when names is nil), in its tables or in
// the layer: a block counts when one tier holds it, so the run hops
// between tiers. The layer is asked after the tables, with the holder's
// id there read after them: a block moves to the layer, and its holder
// gets that id, before the table lets the block go.
func extend(hs *holderState, ly *layer, names []string, keys []uint64, pos int, memo *layerMemo) int {
	tiers := hs.tierList()
	for pos < len(keys) {
		best := 0
		for _, ts := range tiers {
			if names == nil || slices.Contains(names, ts.name) {
				best = max(best, runFrom(ts.tab.Load(), keys, pos))
			}
		}
		if v := hs.lid.Load(); v != 0 {
			shared := 0
			for _, ts := range tiers {
				if names != nil && !slices.Contains(names, ts.name) {
					continue
				}
				if lane := ly.laneOf(ts.name); lane >= 0 {
					shared = max(shared, ly.run(keys, pos, lane, v-1, memo))
				}
			}
			// Unless hs is gone and its id another holder's meanwhile.
			if hs.lid.Load() == v {
				best = max(best, shared)
			}
		}
		if best == 0 {
			break
		}
		pos += best
	}
	return pos
}

// Holders appends to dst[:0] the holders of model that hold key in any tier.
// It asks every holder of the model; HoldersAt, given the prompt before
// the key, asks only those whose chains can reach it.
func (ix *Index) Holders(model string, key uint64, dst []Holder) []Holder {
	dst = dst[:0]
	ms := ix.model(model, false)
	if ms == nil {
		return dst
	}
	return appendHolders(dst, ms, *ms.list.Load(), key)
}

func appendHolders(dst []Holder, ms *modelState, list []*holderState, key uint64) []Holder {
	ly := ms.layer
	for _, hs := range list {
		// The table first: a block moves to the layer, and its holder
		// gets its id there, before the table lets it go.
		if holds(hs, key) {
			dst = append(dst, hs.h)
		} else if v := hs.lid.Load(); v != 0 && ly.holds(key, v-1) && hs.lid.Load() == v {
			// hs had the id throughout: an id is freed only once its
			// holder is gone and its blocks with it.
			dst = append(dst, hs.h)
		}
	}
	return dst
}

func holds(hs *holderState, key uint64) bool {
	for _, ts := range hs.tierList() {
		if held(ts.tab.Load().get(key)) {
			return true
		}
	}
	return false
}

// HoldersAt appends to dst[:0] the holders of model that hold keys[i] in
// any tier, as Holders(model, keys[i], dst) does, for keys a chain from a
// prompt's first block as for Lookup. Its cost follows the prompt's first
// i+1 blocks and the holders that start a chain at one of them, or the
// model's holders when they are fewer, rather than the model's holders:
// a holder's chain through keys[i] in a tier starts at keys[i-d], d its
// depth there, so the holder is in that key's roots.
func (ix *Index) HoldersAt(model string, keys []uint64, i int, dst []Holder) []Holder {
	dst = dst[:0]
	if i < 0 || i >= len(keys) {
		return dst
	}
	ms := ix.model(model, false)
	if ms == nil {
		return dst
	}
	if list := *ms.list.Load(); len(list) <= i+1 {
		return appendHolders(dst, ms, list, keys[i])
	}
	return ms.holdersFromRoots(keys, i, dst)
}

// holdersFromRoots is HoldersAt by the roots of keys[:i+1] and the
// layer's entry of keys[i], read in that order: a holder whose slot a
// rebuild drops after it moved to the layer is then in one or the other.
func (ms *modelState) holdersFromRoots(keys []uint64, i int, dst []Holder) []Holder {
	key := keys[i]
	ly := ms.layer
	buf := idsPool.Get().(*holdersScratch)
	defer idsPool.Put(buf)
	seen := buf.seen[:0]
	for j := range keys[:i+1] {
		for _, hs := range ms.rootHolders(keys[j]) {
			// hs is listed under the start of each of its tiers' chains
			// through key; it is taken at the first. A depth past what a
			// slot counts hides the start: then dst says whether hs was
			// taken.
			first, saturated := -1, false
			for _, ts := range hs.tierList() {
				m := ts.tab.Load().get(key)
				switch {
				case !held(m):
				case depthOf(m) == metaDepthMax:
					saturated = true
				case first < 0 || i-depthOf(m) < first:
					first = i - depthOf(m)
				}
			}
			if saturated && !slices.Contains(dst, hs.h) || !saturated && first == j {
				dst = append(dst, hs.h)
				if v := hs.lid.Load(); v != 0 {
					seen = growWords(seen, int((v-1)/64))
					seen[(v-1)/64] |= 1 << ((v - 1) % 64)
				}
			}
		}
	}
	if ly.active() {
		released := ly.releases.Load()
		ids, _ := ly.holdersOf(key, buf.ids[:0], nil)
		buf.ids = ids
		for _, id := range ids {
			if int(id/64) < len(seen) && seen[id/64]&(1<<(id%64)) != 0 {
				continue
			}
			hs := ly.holderAt(id)
			// An id may be another holder's since the entry was read.
			if hs != nil && (ly.releases.Load() == released || ly.holds(key, id) && hs.lid.Load() == id+1) {
				dst = append(dst, hs.h)
			}
		}
	}
	buf.seen = seen
	return dst
}

// holdersScratch is holdersFromRoots's scratch: the layer's holders of
// the key, and the ids of the holders the roots gave.
type holdersScratch struct {
	ids  []uint32
	seen []uint64
}

// idsPool holds holdersFromRoots's scratch.
var idsPool = sync.Pool{New: func() any { return new(holdersScratch) }}

// runFrom returns how many consecutive blocks from keys[b] t holds. It
// searches by depth unless t has too many gaps; if a writer opened a gap
// meanwhile it searches again, and after a few such tries it checks block
// by block, so that a lookup's cost stays bounded.
func runFrom(t *table, keys []uint64, b int) int {
	if b >= len(keys) {
		return 0
	}
	for range searchTries {
		e := t.epoch.Load()
		g := int(t.gapN.Load())
		if g < 0 {
			break
		}
		n := t.search(keys, b, g)
		if t.epoch.Load() == e {
			return n
		}
	}
	return t.linear(keys, b)
}

// searchTries bounds the searches runFrom repeats while writers open gaps.
const searchTries = 3

func (t *table) linear(keys []uint64, b int) int {
	i := b
	for i < len(keys) && held(t.get(keys[i])) {
		i++
	}
	return i - b
}

// search is runFrom for a table with g listed gaps. Within a segment
// starting at a held keys[pos], keys[j] is certified when it is held at a
// depth of at least j-pos and no gap sits between: keys being a chain, its
// j-pos anchored ancestors are keys[pos:j], all held. Certification only
// gets false further along a segment, so a binary search finds the
// segment's end exactly, in about log2(len(keys)) probes; it probes the
// last key first, which settles a fully cached prompt at once. A segment
// ends early where a block was stored without its anchor; the next one
// starts right after.
func (t *table) search(keys []uint64, b int, g int) int {
	n := len(keys)
	pos := b
	next := t.get(keys[pos])
	for held(next) {
		lo, hi := pos, n
		var him uint64
		for j := n - 1; hi-lo > 1; j = int(uint(lo+hi) >> 1) {
			m := t.get(keys[j])
			if t.certified(keys, pos, j, m, g) {
				lo = j
			} else {
				hi, him = j, m
			}
		}
		pos = lo + 1
		if pos >= n {
			break
		}
		// The search ends with hi == lo+1 == pos, and hi < n was probed.
		next = him
	}
	return pos - b
}

// certified reports whether keys[j], with meta m, proves keys[pos:j] held.
// A gap at depth gd is an ancestor of keys[j] only at position
// j-(d-gd), depths growing by one per link; it matters if it is there.
func (t *table) certified(keys []uint64, pos, j int, m uint64, g int) bool {
	d := depthOf(m)
	if !held(m) || d < j-pos {
		return false
	}
	if g == 0 {
		return true
	}
	if d == metaDepthMax {
		return false
	}
	for i := range g {
		gd := int(t.gaps[i].depth.Load())
		if jg := j - d + gd; jg > pos && jg < j && keys[jg] == t.gaps[i].key.Load() {
			return false
		}
	}
	return true
}

// appendTier is append(tps, TierPrefix{tier, n}) without rewriting the
// tier's name where the reused element already has it.
func appendTier(tps []TierPrefix, tier string, n int) []TierPrefix {
	if len(tps) == cap(tps) {
		return append(tps, TierPrefix{Tier: tier, Blocks: n})
	}
	tps = tps[:len(tps)+1]
	tp := &tps[len(tps)-1]
	if tp.Tier != tier {
		tp.Tier = tier
	}
	tp.Blocks = n
	return tps
}
