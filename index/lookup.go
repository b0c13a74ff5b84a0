package index

import (
	"cmp"
	"math/bits"
	"slices"
	"unsafe"
)

// Lookup sets res.Hits to one Hit per holder of model that holds a
// non-empty prefix of keys, in no particular order. keys are a prompt's
// block keys in order from its first block (as the hashing package
// returns them). Lookup takes no lock, and with a reused res it does not
// allocate once res has grown to the number of hits.
//
// The holders of keys[0] are the candidates; the lookup walks the prompt
// once, a probe a block at most, and narrows them: a holder leaves at the first
// block it holds in no tier, and each of its tiers at the first block
// that tier lacks. Its cost follows the prompt and the holders of its
// first block, not the model's holders.
func (ix *Index) Lookup(model string, keys []uint64, res *Result) {
	out := emitter{hits: res.Hits[:0]}
	ms := ix.model(model, false)
	if ms == nil || len(keys) == 0 {
		res.Hits = out.hits
		return
	}
	out.ms, out.r0 = ms, ms.releases.Load()
	id, en := ms.findEntry(keys[0])
	var v view
	ok := en != nil
	if ok {
		v, ok = ms.readEntry(en, keys[0])
	}
	if !ok {
		res.Hits = out.hits
		return
	}
	sc := &res.sc
	sc.begin(v)
	prev := v
	j := 1
walk:
	for j < len(keys) && (sc.count > 0 || len(sc.sp) > 0) {
		// The entries of a batch of blocks are found first: those the key
		// table gives are independent probes, whose cache misses overlap.
		n := min(len(keys)-j, len(sc.ens))
		for i, k := range keys[j : j+n] {
			id, sc.ens[i] = ms.follow(id, k)
		}
		for i := range n {
			if sc.ens[i] == nil {
				break walk
			}
			if v, ok = ms.readEntry(sc.ens[i], keys[j]); !ok {
				break walk
			}
			if sc.count == 0 && v.same(prev) {
				// The same holders in the same lanes as the block before:
				// every candidate left holds this one as it held that one.
				j++
				continue
			}
			sc.step(v, j, &out)
			prev = v
			j++
			if sc.count == 0 && len(sc.sp) == 0 {
				break walk
			}
		}
	}
	sc.finish(j, &out)
	res.Hits = out.hits
}

// scan is a lookup's candidates: dense, as bitsets by holder id, while
// they are the many holders of a large set; sparse, one track each,
// otherwise. A dense candidate holds every block so far in each lane it
// held the first in; one whose lane stops while it goes on becomes a
// track.
type scan struct {
	ens      [32]*entry // a batch of blocks' entries
	words    int
	any      []uint64
	lanes    [maxTiers][]uint64
	laneMask uint8
	count    int // dense candidates
	sp       []track
}

// track is one sparse candidate: the lanes it held the first block in
// (born), those it held every block so far in (alive), and for the others
// the blocks they held.
type track struct {
	id    uint32
	born  uint8
	alive uint8
	at    [maxTiers]int32
}

// denseMin is the fewest dense candidates worth bitsets: fewer are tracks.
const denseMin = 32

func (sc *scan) begin(v view) {
	sc.count, sc.sp, sc.laneMask = 0, sc.sp[:0], 0
	s := v.set
	switch {
	case s == nil:
		if h := elemHeld(v.one); h != 0 {
			sc.sp = append(sc.sp, track{id: elemID(v.one), born: h, alive: h})
		}
		return
	case !s.large():
		for _, e := range s.small {
			if h := elemHeld(e); h != 0 {
				sc.sp = append(sc.sp, track{id: elemID(e), born: h, alive: h})
			}
		}
		return
	}
	sc.words = int(s.words)
	sc.any = grow(sc.any, sc.words)
	sc.laneMask = s.lanes
	for m := s.lanes; m != 0; m &= m - 1 {
		l := bits.TrailingZeros8(m)
		hb := s.heldBits(l)
		ws := grow(sc.lanes[l], sc.words)
		for w := range ws {
			ws[w] = hb[w].Load()
			sc.any[w] |= ws[w]
		}
		sc.lanes[l] = ws
	}
	for _, a := range sc.any {
		sc.count += bits.OnesCount64(a)
	}
	if sc.count < denseMin {
		sc.undense()
	}
}

func grow(ws []uint64, n int) []uint64 {
	if cap(ws) < n {
		return make([]uint64, n)
	}
	ws = ws[:n]
	clear(ws)
	return ws
}

// bornAt returns the lanes of dense candidate id.
func (sc *scan) bornAt(w int, bit uint64) uint8 {
	if sc.laneMask&(sc.laneMask-1) == 0 {
		// One lane, the common case: every dense candidate has it.
		return sc.laneMask
	}
	var b uint8
	for m := sc.laneMask; m != 0; m &= m - 1 {
		l := bits.TrailingZeros8(m)
		if sc.lanes[l][w]&bit != 0 {
			b |= 1 << l
		}
	}
	return b
}

// undense makes every dense candidate a track.
func (sc *scan) undense() {
	for w, a := range sc.any {
		for ; a != 0; a &= a - 1 {
			bit := a & -a
			b := sc.bornAt(w, bit)
			sc.sp = append(sc.sp, track{id: uint32(w*64 + bits.TrailingZeros64(a)), born: b, alive: b})
		}
		sc.any[w] = 0
	}
	sc.count = 0
}

// step narrows the candidates to the holders of block j, v. Tracks are
// kept sorted by id, so that a small set is merged with them in one pass.
func (sc *scan) step(v view, j int, out *emitter) {
	w := 0
	var es []elem
	small := v.set != nil && !v.set.large()
	if small {
		es = v.set.small
	}
	e := 0
	for i := range sc.sp {
		t := &sc.sp[i]
		var m uint8
		switch {
		case small:
			for e < len(es) && elemID(es[e]) < t.id {
				e++
			}
			if e < len(es) && elemID(es[e]) == t.id {
				m = elemHeld(es[e])
			}
		default:
			m = v.heldOf(t.id)
		}
		if m == 0 {
			out.track(t, j)
			continue
		}
		for died := t.alive &^ m; died != 0; died &= died - 1 {
			t.at[bits.TrailingZeros8(died)] = int32(j)
		}
		t.alive &= m
		if w != i {
			sc.sp[w] = *t
		}
		w++
	}
	sc.sp = sc.sp[:w]
	if sc.count == 0 {
		return
	}
	had := len(sc.sp)
	if s := v.set; s != nil && s.large() {
		sc.stepLarge(s, j, out)
	} else {
		sc.stepSmall(v, j, out)
	}
	if sc.count > 0 && sc.count < denseMin {
		sc.undense()
	}
	// stepLarge and undense each append tracks in order, one run after
	// the other and after those kept.
	if len(sc.sp) > had {
		slices.SortFunc(sc.sp, func(a, b track) int { return cmp.Compare(a.id, b.id) })
	}
}

// stepLarge narrows the dense candidates by s, block j's large set, a word
// of holders at a time.
func (sc *scan) stepLarge(s *holderSet, j int, out *emitter) {
	for w, a := range sc.any {
		if a == 0 {
			continue
		}
		var u uint64
		var held [maxTiers]uint64
		if w < int(s.words) {
			for m, i := s.lanes, int32(0); m != 0; m, i = m&(m-1), i+1 {
				x := s.bits[i*s.words+int32(w)].Load()
				held[bits.TrailingZeros8(m)] = x
				u |= x
			}
		}
		stay := a & u
		if stay == a && sc.laneMask&(sc.laneMask-1) == 0 && held[bits.TrailingZeros8(sc.laneMask)]&a == a {
			// Every candidate here holds this block in its one lane.
			continue
		}
		out.denseWord(sc, w, a&^stay, j)
		// Candidates a lane of which stops here while they go on.
		var died uint64
		for m := sc.laneMask; m != 0; m &= m - 1 {
			l := bits.TrailingZeros8(m)
			died |= sc.lanes[l][w] &^ held[l]
		}
		died &= stay
		for d := died; d != 0; d &= d - 1 {
			bit := d & -d
			t := track{id: uint32(w*64 + bits.TrailingZeros64(d)), born: sc.bornAt(w, bit)}
			for m := t.born; m != 0; m &= m - 1 {
				l := bits.TrailingZeros8(m)
				if held[l]&bit != 0 {
					t.alive |= 1 << l
				} else {
					t.at[l] = int32(j)
				}
			}
			sc.sp = append(sc.sp, t)
		}
		keep := stay &^ died
		for m := sc.laneMask; m != 0; m &= m - 1 {
			l := bits.TrailingZeros8(m)
			sc.lanes[l][w] &= keep
		}
		sc.any[w] = keep
		sc.count -= bits.OnesCount64(a &^ keep)
	}
}

// stepSmall ends the dense candidates at block j, v, which has few
// holders: those among them become tracks, the others leave.
func (sc *scan) stepSmall(v view, j int, out *emitter) {
	if v.set == nil {
		sc.adopt(v.one, j)
	} else {
		for _, e := range v.set.small {
			sc.adopt(e, j)
		}
	}
	for w, a := range sc.any {
		out.denseWord(sc, w, a, j)
		sc.any[w] = 0
	}
	sc.count = 0
}

// adopt makes the dense candidate of e, a holder of block j, a track.
func (sc *scan) adopt(e elem, j int) {
	id, h := elemID(e), elemHeld(e)
	w, bit := int(id/64), uint64(1)<<(id%64)
	if h == 0 || w >= len(sc.any) || sc.any[w]&bit == 0 {
		return
	}
	t := track{id: id, born: sc.bornAt(w, bit)}
	t.alive = t.born & h
	for died := t.born &^ h; died != 0; died &= died - 1 {
		t.at[bits.TrailingZeros8(died)] = int32(j)
	}
	sc.sp = append(sc.sp, t)
	sc.any[w] &^= bit
	for m := sc.laneMask; m != 0; m &= m - 1 {
		sc.lanes[bits.TrailingZeros8(m)][w] &^= bit
	}
	sc.count--
}

// finish gives every candidate left a prefix of n blocks.
func (sc *scan) finish(n int, out *emitter) {
	for i := range sc.sp {
		out.track(&sc.sp[i], n)
	}
	sc.sp = sc.sp[:0]
	if sc.count > 0 {
		for w, a := range sc.any {
			out.denseWord(sc, w, a, n)
		}
		sc.count = 0
	}
}

// emitter writes a lookup's hits, reusing what a Result had.
type emitter struct {
	ms    *modelState
	r0    uint64
	hits  []Hit
	names []string // the lanes of the holder of the last hit
	touch uint64   // what denseWord's early loads read, kept so they stay
}

func (o *emitter) track(t *track, prefix int) {
	hit := o.next(t.id, prefix)
	if hit == nil {
		return
	}
	tps := hit.Tiers[:0]
	for m := t.born; m != 0; m &= m - 1 {
		l := bits.TrailingZeros8(m)
		n := prefix
		if t.alive&(1<<l) == 0 {
			n = int(t.at[l])
		}
		tps = o.appendTier(tps, l, n)
	}
	o.setTiers(hit, tps)
}

// denseWord emits the dense candidates of word w in mask, with prefix.
// Their registry records are loaded first, in a loop of independent
// loads, so that the cache misses of a word's holders overlap.
func (o *emitter) denseWord(sc *scan, w int, mask uint64, prefix int) {
	if mask == 0 {
		return
	}
	var refs [64]*holderRef
	n := 0
	for m := mask; m != 0; m &= m - 1 {
		refs[n] = o.ms.reg.at(uint32(w*64 + bits.TrailingZeros64(m)))
		n++
	}
	var touch uint64
	for _, ref := range refs[:n] {
		if ref != nil {
			touch += ref.born
		}
	}
	o.touch += touch
	i := 0
	for m := mask; m != 0; m &= m - 1 {
		o.dense(refs[i], prefix, sc.bornAt(w, m&-m))
		i++
	}
}

func (o *emitter) dense(ref *holderRef, prefix int, lanes uint8) {
	hit := o.nextRef(ref, prefix)
	if hit == nil {
		return
	}
	tps := hit.Tiers[:0]
	for m := lanes; m != 0; m &= m - 1 {
		tps = o.appendTier(tps, bits.TrailingZeros8(m), prefix)
	}
	o.setTiers(hit, tps)
}

// next returns the hit of holder id, or nil when the id is not one
// holder's throughout the lookup.
func (o *emitter) next(id uint32, prefix int) *Hit {
	return o.nextRef(o.ms.reg.at(id), prefix)
}

// nextRef is next with the holder's registry record, read already.
func (o *emitter) nextRef(ref *holderRef, prefix int) *Hit {
	if ref == nil || ref.born > o.r0 {
		// No holder, or one that got its id after the lookup began (see
		// modelState.holderAt).
		return nil
	}
	if len(o.hits) < cap(o.hits) {
		o.hits = o.hits[:len(o.hits)+1]
	} else {
		o.hits = append(o.hits, Hit{})
	}
	hit := &o.hits[len(o.hits)-1]
	// A reused Result mostly gets back the holders and tiers it had:
	// skipping pointer writes that change nothing spares the write
	// barriers they cost while the GC marks.
	if !sameHolder(hit.Holder, ref.h) {
		hit.Holder = ref.h
	}
	hit.Prefix = prefix
	o.names = ref.lanes.slice()
	return hit
}

// sameHolder reports whether a and b are one holder by the same string:
// a comparison of contents would cost more than the write it spares.
func sameHolder(a, b Holder) bool {
	return a.Rank == b.Rank && len(a.Pod) == len(b.Pod) && unsafe.StringData(a.Pod) == unsafe.StringData(b.Pod)
}

func (o *emitter) appendTier(tps []TierPrefix, lane int, n int) []TierPrefix {
	if lane >= len(o.names) {
		// Not reachable: a holder's record names a lane before any entry
		// has a bit of it. Checked, so that no reader can panic.
		return tps
	}
	tier := o.names[lane]
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

func (o *emitter) setTiers(hit *Hit, tps []TierPrefix) {
	if cap(tps) == cap(hit.Tiers) {
		hit.Tiers = hit.Tiers[:len(tps)]
	} else {
		hit.Tiers = tps
	}
}

// Run returns how many consecutive blocks from keys[start] h holds for
// model in any of tiers (nil means any tier): what h could supply after a
// destination's own prefix of start blocks.
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
	mask := hs.lanesOf(tiers)
	n := 0
	id := tomb
	for _, k := range keys[start:] {
		var en *entry
		if id, en = ms.follow(id, k); en == nil {
			break
		}
		if v, ok := ms.readEntry(en, k); !ok || v.heldOf(hs.id)&mask == 0 {
			break
		}
		n++
	}
	if ms.reg.holder(hs.id) != hs {
		// hs left meanwhile, its id maybe another holder's.
		return 0
	}
	return n
}

// Holders appends to dst[:0] the holders of model that hold key in any
// tier: one probe of key, then its holders.
func (ix *Index) Holders(model string, key uint64, dst []Holder) []Holder {
	dst = dst[:0]
	ms := ix.model(model, false)
	if ms == nil {
		return dst
	}
	r0 := ms.releases.Load()
	v, ok := ms.view(key)
	if !ok {
		return dst
	}
	add := func(id uint32) {
		if ref := ms.holderAt(id, r0); ref != nil {
			dst = append(dst, ref.h)
		}
	}
	switch s := v.set; {
	case s == nil:
		if elemHeld(v.one) != 0 {
			add(elemID(v.one))
		}
	case !s.large():
		for _, e := range s.small {
			if elemHeld(e) != 0 {
				add(elemID(e))
			}
		}
	default:
		for w := range s.words {
			var any uint64
			for m, i := s.lanes, int32(0); m != 0; m, i = m&(m-1), i+1 {
				any |= s.bits[i*s.words+w].Load()
			}
			for ; any != 0; any &= any - 1 {
				add(uint32(w)*64 + uint32(bits.TrailingZeros64(any)))
			}
		}
	}
	return dst
}

// HoldersAt appends to dst[:0] the holders of model that hold keys[i] in
// any tier, as Holders(model, keys[i], dst) does; keys is a prompt's keys
// as for Lookup.
func (ix *Index) HoldersAt(model string, keys []uint64, i int, dst []Holder) []Holder {
	if i < 0 || i >= len(keys) {
		return dst[:0]
	}
	return ix.Holders(model, keys[i], dst)
}
