package index

import (
	"math/bits"
	"runtime"
	"slices"
	"sync/atomic"
)

// An entry is one block of one model: its key and its holder word, which
// says who holds it in which of their lanes. It is 16 bytes and never
// moves: its id, its place in the model's arena, is what eviction queues
// and the key table name.
type entry struct {
	key  atomic.Uint64
	word atomic.Uint64
}

// The holder word. Bit 0 is the writers' lock; bits 1-2 the kind:
//
//	kindNone  no holder (a new entry, before its first holding)
//	kindOne   one holder, inline: its element in bits 8-47
//	kindSet   two or more: bits 24-55 are the slot of the entry's
//	          holderSet in the model's set table, bits 3-23 the slot's
//	          generation
//	kindFree  freed: the key table no longer names it
//
// Readers take no lock: they load the word, then check the key (a freed
// entry reused for another key changes its key before its word), and for
// a set load the set and check the word again.
const (
	wordLock     = 1
	kindMask     = 3 << 1
	kindNone     = 0 << 1
	kindOne      = 1 << 1
	kindSet      = 2 << 1
	kindFree     = 3 << 1
	oneShift     = 8
	setGenShift  = 3
	setGenMask   = 1<<21 - 1
	setSlotShift = 24
)

// An element is one holder's part of an entry: its id (24 bits) and, per
// lane (the holder's tiers, in the order it first stored in them), a held
// bit and a ghost bit. A ghost is a holding removed while its place in the
// holder's eviction queue stays: stored again before the queue drops it,
// the holding keeps that place, and the queue never names a holding twice.
//
//	bits 0-7 held lanes, 8-15 ghost lanes, 16-39 holder id
type elem = uint64

const (
	elemIDShift = 16
	elemBits    = 0xFFFF // held and ghost bits
	ghostMask   = 0xFF00
	elemMask    = 1<<40 - 1
	maxHolderID = 1<<24 - 1
)

func elemID(e elem) uint32   { return uint32(e >> elemIDShift) }
func elemHeld(e elem) uint8  { return uint8(e) }
func elemGhost(e elem) uint8 { return uint8(e >> 8) }
func mkElem(id uint32, b uint64) elem {
	return elem(id)<<elemIDShift | b&elemBits
}

func laneBit(lane int) uint64  { return 1 << uint(lane) }
func ghostBit(lane int) uint64 { return 1 << uint(8+lane) }

// A holderSet lists an entry's holders when there are two or more, in one
// of two forms. The small form is a sorted array of elements that is
// never changed once published: a write publishes a new one, and entries
// with the same holders may share one (consecutive blocks a holder stores
// together do), which lets a lookup pass over a run of them at one
// comparison each. The large form keeps, per lane present, a bitset of the
// holders by id (held bits, then ghost bits), written in place with atomic
// operations; it replaces the small form past smallMax holders when the
// bitsets are no larger than the array, or past largeMin regardless, and
// goes back below smallMin.
type holderSet struct {
	small []elem
	// The large form: lanes and ghosts are the lanes with a held, and a
	// ghost, bitset of words words each, in bits in that order. n counts
	// the holders with a bit (written under the entry's lock).
	lanes, ghosts uint8
	words         int32
	n             int32
	bits          []atomic.Uint64
}

const (
	smallMax = 64
	smallMin = 32
	largeMin = 256
)

func (s *holderSet) large() bool { return s.small == nil }

// heldBits returns lane's held bitset of a large set, nil when absent.
func (s *holderSet) heldBits(lane int) []atomic.Uint64 {
	if s.lanes&(1<<lane) == 0 {
		return nil
	}
	i := int32(bits.OnesCount8(s.lanes & (1<<lane - 1)))
	return s.bits[i*s.words : (i+1)*s.words]
}

func (s *holderSet) ghostBits(lane int) []atomic.Uint64 {
	if s.ghosts&(1<<lane) == 0 {
		return nil
	}
	i := int32(bits.OnesCount8(s.lanes)) + int32(bits.OnesCount8(s.ghosts&(1<<lane-1)))
	return s.bits[i*s.words : (i+1)*s.words]
}

func hasBit(ws []atomic.Uint64, id uint32) bool {
	w := int(id / 64)
	return w < len(ws) && ws[w].Load()&(1<<(id%64)) != 0
}

// bitsOf returns id's held and ghost bits in a large set.
func (s *holderSet) bitsOf(id uint32) uint64 {
	var b uint64
	for m := s.lanes; m != 0; m &= m - 1 {
		l := bits.TrailingZeros8(m)
		if hasBit(s.heldBits(l), id) {
			b |= laneBit(l)
		}
	}
	for m := s.ghosts; m != 0; m &= m - 1 {
		l := bits.TrailingZeros8(m)
		if hasBit(s.ghostBits(l), id) {
			b |= ghostBit(l)
		}
	}
	return b
}

// heldOf returns the lanes in which id holds the block, for readers.
func (s *holderSet) heldOf(id uint32) uint8 {
	if !s.large() {
		if i, ok := searchElem(s.small, id); ok {
			return elemHeld(s.small[i])
		}
		return 0
	}
	var held uint8
	w := int32(id / 64)
	if w >= s.words {
		return 0
	}
	bit := uint64(1) << (id % 64)
	i := int32(0)
	for m := s.lanes; m != 0; m &= m - 1 {
		if s.bits[i*s.words+w].Load()&bit != 0 {
			held |= m & -m
		}
		i++
	}
	return held
}

func searchElem(es []elem, id uint32) (int, bool) {
	if len(es) <= 8 {
		for i, e := range es {
			if x := elemID(e); x >= id {
				return i, x == id
			}
		}
		return len(es), false
	}
	return slices.BinarySearchFunc(es, id, func(e elem, id uint32) int {
		x := elemID(e)
		switch {
		case x < id:
			return -1
		case x > id:
			return 1
		}
		return 0
	})
}

// view is what a reader sees of an entry: one element, or a set.
type view struct {
	one elem
	set *holderSet
}

// heldOf returns the lanes in which holder id holds the viewed block.
func (v view) heldOf(id uint32) uint8 {
	if v.set != nil {
		return v.set.heldOf(id)
	}
	if elemID(v.one) == id {
		return elemHeld(v.one)
	}
	return 0
}

// same reports whether v and o are the same holders with the same lanes
// for certain: one element alike, or one small set shared.
func (v view) same(o view) bool {
	if v.set != nil {
		return v.set == o.set && !v.set.large()
	}
	return o.set == nil && v.one&^ghostMask == o.one&^ghostMask
}

// lock takes en's writer lock and returns the word it holds.
func (en *entry) lock() uint64 {
	for spins := 0; ; spins++ {
		w := en.word.Load()
		if w&wordLock == 0 && en.word.CompareAndSwap(w, w|wordLock) {
			return w
		}
		if spins > 32 {
			runtime.Gosched()
		}
	}
}

// unlock publishes w, unlocked.
func (en *entry) unlock(w uint64) { en.word.Store(w &^ wordLock) }
