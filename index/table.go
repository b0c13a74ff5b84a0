package index

import (
	"math/bits"
	"sync/atomic"
)

// A table is one holder's blocks in one tier: an open-addressing hash table
// (linear probing) of block keys, written by the holder's writer only and
// read concurrently by any number of lookups. Readers see each slot through
// two atomic words; a slot, once occupied, keeps its key until the table is
// replaced by a rehash, so a reader never confuses two keys.
//
// Each slot also records the block's chain: the slot of the parent block the
// engine reported (its anchor) and the depth, the number of anchored links
// above it. Together with brk (held blocks whose anchor is not held) this
// lets a lookup skip over a run of blocks: when brk is zero, a held block at
// depth d implies its d ancestors are held too.
type table struct {
	slots []slot
	mask  uint64
	shift uint8
	// brk counts held slots whose anchor is not held in this table.
	brk atomic.Int64
	// epoch grows whenever brk grows, so a reader that galloped while a
	// writer broke a link notices and verifies block by block instead.
	epoch atomic.Uint64
	// live counts held slots; used counts occupied slots (held, or kept as
	// the ancestor of a held slot, or dropped but not yet rehashed away).
	live atomic.Int64
	used int
}

type slot struct {
	key  atomic.Uint64
	meta atomic.Uint64
}

// Slot meta layout. Group bits 0-6 are KV cache groups 0-6; bit 7 stands
// for any other group, tracked exactly in the tier's writer-only ext map.
const (
	metaGroups      = 0xFF
	metaExtGroup    = 0x80
	metaChildShift  = 8
	metaChildMask   = 0xFF
	metaDepthShift  = 16
	metaDepthMax    = 0xFFFF
	metaParentShift = 32
	metaParentMask  = 0x7FFFFFFF
	metaExists      = 1 << 63

	minTableSize = 16
	// Tables grow past 13/16 occupancy and are rebuilt at most 9/16 full.
	maxLoadNum = 13
	rebuildNum = 9
	loadDen    = 16
)

func newTable(size int) *table {
	if size < minTableSize {
		size = minTableSize
	}
	b := bits.Len(uint(size - 1))
	return &table{
		slots: make([]slot, 1<<b),
		mask:  1<<b - 1,
		shift: uint8(64 - b),
	}
}

// tableSizeFor returns the table size that holds n slots at most rebuildNum/loadDen full.
func tableSizeFor(n int) int {
	return n*loadDen/rebuildNum + 1
}

func (t *table) home(key uint64) uint64 {
	return (key * 0x9E3779B97F4A7C15) >> t.shift
}

// get returns the meta of key's slot, or 0 when the table has no slot for it.
func (t *table) get(key uint64) uint64 {
	i := t.home(key)
	for {
		s := &t.slots[i]
		m := s.meta.Load()
		if m == 0 {
			return 0
		}
		if s.key.Load() == key {
			return m
		}
		i = (i + 1) & t.mask
	}
}

// find returns key's slot index or -1. Writer only.
func (t *table) find(key uint64) int {
	i := t.home(key)
	for {
		s := &t.slots[i]
		if s.meta.Load() == 0 {
			return -1
		}
		if s.key.Load() == key {
			return int(i)
		}
		i = (i + 1) & t.mask
	}
}

// insert puts key, known to be absent, in a free slot. The caller has made
// room. The key is published before the meta so that a reader that sees the
// slot occupied also sees its key.
func (t *table) insert(key, meta uint64) int {
	i := t.home(key)
	for t.slots[i].meta.Load() != 0 {
		i = (i + 1) & t.mask
	}
	t.slots[i].key.Store(key)
	t.slots[i].meta.Store(meta | metaExists)
	t.used++
	return int(i)
}

// fits reports whether n more slots can be inserted without passing the load limit.
func (t *table) fits(n int) bool {
	return (t.used+n)*loadDen <= len(t.slots)*maxLoadNum
}

func held(m uint64) bool { return m&metaGroups != 0 }

func depthOf(m uint64) int { return int(m>>metaDepthShift) & metaDepthMax }

// parentOf returns the anchor slot of m, or -1 for an unanchored slot.
func parentOf(m uint64) int {
	return int((m>>metaParentShift)&metaParentMask) - 1
}

func childrenOf(m uint64) int { return int(m>>metaChildShift) & metaChildMask }

// anchoredMeta is the meta of a new slot whose parent is the slot p with meta pm.
func anchoredMeta(p int, pm uint64) uint64 {
	d := depthOf(pm) + 1
	if d > metaDepthMax {
		d = metaDepthMax
	}
	return uint64(p+1)<<metaParentShift | uint64(d)<<metaDepthShift
}
