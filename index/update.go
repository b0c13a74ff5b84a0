package index

import (
	"math/bits"
	"sync/atomic"
)

// An op is what a writer does to one holder's bits in one lane of an
// entry.
type op uint8

const (
	opStore  op = iota // held (a ghost is held again)
	opRemove           // held becomes a ghost: the eviction queue still names it
	opDrop             // neither held nor ghost: the queue no longer names it
)

func apply(b uint64, lane int, o op) uint64 {
	switch o {
	case opStore:
		return (b | laneBit(lane)) &^ ghostBit(lane)
	case opRemove:
		if b&laneBit(lane) != 0 {
			return b&^laneBit(lane) | ghostBit(lane)
		}
		return b
	default:
		return b &^ (laneBit(lane) | ghostBit(lane))
	}
}

// setMemo remembers a holder's last change of a small set, so that the
// consecutive blocks it stores or removes together, which had one set,
// share the new one too.
type setMemo struct {
	from    *holderSet
	fromOne elem // with from nil: the other holder of an inline entry
	old, nb uint64
	to      *holderSet
}

// update applies o in lane to hs's bits in entry id, key's, and returns
// the bits before. ok is false when the entry is no longer key's (freed
// since the caller found it): nothing was done. hs's mutex is held: a
// holder's bits change only under it.
func (ms *modelState) update(hs *holderState, id uint32, key uint64, lane int, o op) (old uint64, ok bool) {
	en := ms.entry(id)
	w := en.lock()
	if w&kindMask == kindFree || en.key.Load() != key {
		en.unlock(w)
		return 0, false
	}
	hid := hs.id
	switch w & kindMask {
	case kindNone:
		if nb := apply(0, lane, o); nb != 0 {
			w = kindOne | mkElem(hid, nb)<<oneShift
		}
		en.unlock(w)
		return 0, true
	case kindOne:
		e := w >> oneShift & elemMask
		if elemID(e) == hid {
			old = e & elemBits
			switch nb := apply(old, lane, o); {
			case nb == old:
				en.unlock(w)
			case nb == 0:
				ms.free(en, id, key)
			default:
				en.unlock(kindOne | mkElem(hid, nb)<<oneShift)
			}
			return old, true
		}
		nb := apply(0, lane, o)
		if nb == 0 {
			en.unlock(w)
			return 0, true
		}
		m := &hs.memo
		if m.from != nil || m.fromOne != e || m.nb != nb || m.to == nil {
			pair := []elem{e, mkElem(hid, nb)}
			if hid < elemID(e) {
				pair[0], pair[1] = pair[1], pair[0]
			}
			*m = setMemo{fromOne: e, nb: nb, to: &holderSet{small: pair}}
		}
		en.unlock(ms.allocSet(m.to))
		return 0, true
	}
	slot := uint32(w >> setSlotShift)
	s := ms.setAt(slot)
	if s.large() {
		old = s.bitsOf(hid)
		if nb := apply(old, lane, o); nb != old {
			ms.updateLarge(en, w, slot, s, hid, old, nb)
			return old, true
		}
		en.unlock(w)
		return old, true
	}
	i, found := searchElem(s.small, hid)
	if found {
		old = s.small[i] & elemBits
	}
	nb := apply(old, lane, o)
	if nb == old {
		en.unlock(w)
		return old, true
	}
	m := &hs.memo
	if m.from != s || m.old != old || m.nb != nb || m.to == nil {
		es := make([]elem, 0, len(s.small)+1)
		es = append(es, s.small[:i]...)
		if nb != 0 {
			es = append(es, mkElem(hid, nb))
		}
		if found {
			i++
		}
		es = append(es, s.small[i:]...)
		*m = setMemo{from: s, old: old, nb: nb, to: &holderSet{small: es}}
	}
	ns := m.to
	switch {
	case len(ns.small) == 1:
		en.unlock(kindOne | ns.small[0]<<oneShift)
		ms.freeSet(slot)
	case len(ns.small) > smallMax && (len(ns.small) > largeMin || denseEnough(ns.small)):
		ms.putSet(slot, largeOf(ns.small))
		en.unlock(w)
	default:
		ms.putSet(slot, ns)
		en.unlock(w)
	}
	return old, true
}

// denseEnough reports whether bitsets of es's lanes by id take no more
// room than es.
func denseEnough(es []elem) bool {
	var lanes, ghosts uint8
	for _, e := range es {
		lanes |= elemHeld(e)
		ghosts |= elemGhost(e)
	}
	words := int(elemID(es[len(es)-1]))/64 + 1
	return words*(bits.OnesCount8(lanes)+bits.OnesCount8(ghosts)) <= len(es)
}

// largeOf returns the large form of es.
func largeOf(es []elem) *holderSet {
	var lanes, ghosts uint8
	for _, e := range es {
		lanes |= elemHeld(e)
		ghosts |= elemGhost(e)
	}
	s := newLarge(lanes, ghosts, int32(elemID(es[len(es)-1])/64+1))
	for _, e := range es {
		s.setBits(elemID(e), e&elemBits)
	}
	s.n = int32(len(es))
	return s
}

func newLarge(lanes, ghosts uint8, words int32) *holderSet {
	n := int32(bits.OnesCount8(lanes) + bits.OnesCount8(ghosts))
	return &holderSet{lanes: lanes, ghosts: ghosts, words: words, bits: make([]atomic.Uint64, n*words)}
}

// setBits sets id's bits b, whose lanes s has.
func (s *holderSet) setBits(id uint32, b uint64) {
	w, bit := id/64, uint64(1)<<(id%64)
	for m := uint8(b); m != 0; m &= m - 1 {
		s.heldBits(bits.TrailingZeros8(m))[w].Or(bit)
	}
	for m := uint8(b >> 8); m != 0; m &= m - 1 {
		s.ghostBits(bits.TrailingZeros8(m))[w].Or(bit)
	}
}

func (s *holderSet) clearBits(id uint32, b uint64) {
	w, bit := id/64, uint64(1)<<(id%64)
	for m := uint8(b); m != 0; m &= m - 1 {
		s.heldBits(bits.TrailingZeros8(m))[w].And(^bit)
	}
	for m := uint8(b >> 8); m != 0; m &= m - 1 {
		s.ghostBits(bits.TrailingZeros8(m))[w].And(^bit)
	}
}

// updateLarge changes hid's bits from old to nb in s, entry en's large
// set in slot; en is locked with word w, and unlocked on return.
func (ms *modelState) updateLarge(en *entry, w uint64, slot uint32, s *holderSet, hid uint32, old, nb uint64) {
	add := nb &^ old
	if lanes, ghosts := s.lanes|uint8(add), s.ghosts|uint8(add>>8); lanes != s.lanes || ghosts != s.ghosts || int32(hid/64) >= s.words {
		// A lane or holder id beyond the bitsets: a larger copy, published
		// before it is written to.
		words := s.words
		for words <= int32(hid/64) {
			words *= 2
		}
		g := newLarge(lanes, ghosts, words)
		for m := s.lanes; m != 0; m &= m - 1 {
			l := bits.TrailingZeros8(m)
			copyBits(g.heldBits(l), s.heldBits(l))
		}
		for m := s.ghosts; m != 0; m &= m - 1 {
			l := bits.TrailingZeros8(m)
			copyBits(g.ghostBits(l), s.ghostBits(l))
		}
		g.n = s.n
		ms.putSet(slot, g)
		s = g
	}
	s.setBits(hid, add)
	s.clearBits(hid, old&^nb)
	switch {
	case old == 0:
		s.n++
	case nb == 0:
		s.n--
	}
	if s.n >= smallMin {
		en.unlock(w)
		return
	}
	var es []elem
	view{set: s}.eachBits(func(id uint32, b uint64) { es = append(es, mkElem(id, b)) })
	ms.putSet(slot, &holderSet{small: es})
	en.unlock(w)
}

func copyBits(dst, src []atomic.Uint64) {
	for i := range src {
		dst[i].Store(src[i].Load())
	}
}

// eachBits calls f with each holder id of a large set that has a bit, held
// or ghost, in ascending order, and its bits. Writers only.
func (v view) eachBits(f func(id uint32, b uint64)) {
	s := v.set
	for w := range s.words {
		var any uint64
		for i := range int32(bits.OnesCount8(s.lanes) + bits.OnesCount8(s.ghosts)) {
			any |= s.bits[i*s.words+w].Load()
		}
		for ; any != 0; any &= any - 1 {
			id := uint32(w)*64 + uint32(bits.TrailingZeros64(any))
			f(id, s.bitsOf(id))
		}
	}
}

// ownBits returns hs's bits in entry id of key, read as a reader does;
// exact for hs's writer, under hs's mutex. false: key has no entry there.
func (ms *modelState) ownBits(hs *holderState, id uint32, key uint64) (uint64, bool) {
	v, ok := ms.read(id, key)
	if !ok {
		return 0, false
	}
	switch s := v.set; {
	case s == nil:
		if elemID(v.one) == hs.id {
			return v.one & elemBits, true
		}
		return 0, true
	case s.large():
		return s.bitsOf(hs.id), true
	default:
		if i, found := searchElem(s.small, hs.id); found {
			return s.small[i] & elemBits, true
		}
		return 0, true
	}
}
