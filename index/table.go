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
// engine reported (its anchor) and its depth, the number of anchored links
// above it; a child's depth is its parent's plus one. An unheld slot with a
// held child is a gap. Without gaps, a held block at depth d has its d
// anchored ancestors held; with a few gaps, a lookup can tell from depths
// where on the prompt each gap would sit and check just those blocks. So a
// lookup searches the prompt instead of probing every block.
type table struct {
	slots []slot
	size  uint64
	// gapN is the number of gaps listed in gaps, -1 when there are more
	// than fit (lookups then check block by block).
	gapN atomic.Int32
	gaps [maxGaps]gap
	// epoch grows before a gap appears, so a reader that searched while a
	// writer opened one notices and checks block by block instead.
	epoch atomic.Uint64
	// used counts occupied slots (held, or kept as the ancestor of a held
	// slot, or dropped but not yet rehashed away). Writer only.
	used int
}

type gap struct {
	key   atomic.Uint64
	depth atomic.Uint64
}

// maxGaps bounds the gaps a lookup checks per table before it gives up
// searching by depth.
const maxGaps = 32

// A slot's words are written with atomic stores while its table is
// published, and plainly while a rehash builds the table, before it is.
type slot struct {
	key  uint64
	meta uint64
}

func (s *slot) loadKey() uint64   { return atomic.LoadUint64(&s.key) }
func (s *slot) loadMeta() uint64  { return atomic.LoadUint64(&s.meta) }
func (s *slot) storeKey(k uint64) { atomic.StoreUint64(&s.key, k) }
func (s *slot) storeMeta(m uint64) {
	atomic.StoreUint64(&s.meta, m)
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
	metaParentMask  = 0x3FFFFFFF
	// metaMigrated marks an unheld slot whose holding moved to the
	// model's layer (see layer.go): its eviction-queue entry stands for
	// the layer holding until a rebuild turns it into a layer entry.
	metaMigrated = 1 << 62
	metaExists   = 1 << 63

	minTableSize = 16
	// Tables are rebuilt past 13/16 occupancy, at most 10/16 full (8/16 when
	// removals rather than growth filled them).
	maxLoadNum = 13
	rebuildNum = 10
	churnNum   = 8
	loadDen    = 16
)

func newTable(size int) *table {
	size = max(size, minTableSize)
	return &table{slots: make([]slot, size), size: uint64(size)}
}

// tableSizeFor returns the table size that holds n slots at most
// rebuildNum/loadDen full. Sizes are not powers of two, so that tables
// grow by 13/10 rather than doubling, which keeps memory per block low.
func tableSizeFor(n int) int {
	return n*loadDen/rebuildNum + 1
}

// home maps key to a slot by multiplying its mixed bits into [0, size).
func (t *table) home(key uint64) uint64 {
	hi, _ := bits.Mul64(key*0x9E3779B97F4A7C15, t.size)
	return hi
}

// next is the slot after i, wrapping around.
func (t *table) next(i uint64) uint64 {
	i++
	if i == t.size {
		return 0
	}
	return i
}

// get returns the meta of key's slot, or 0 when the table has no slot for it.
func (t *table) get(key uint64) uint64 {
	i := t.home(key)
	for {
		s := &t.slots[i]
		m := s.loadMeta()
		if m == 0 {
			return 0
		}
		if s.loadKey() == key {
			return m
		}
		i = t.next(i)
	}
}

// find returns key's slot index or -1. Writer only.
func (t *table) find(key uint64) int {
	if i, ok := t.probe(key); ok {
		return i
	}
	return -1
}

// prefetch touches the home slots of keys, so that their cache misses
// overlap instead of following one another in the probe loop. Writer only:
// plain loads of words only the writer writes.
func (t *table) prefetch(keys []uint64) uint64 {
	var sum uint64
	for _, k := range keys {
		sum += t.slots[t.home(k)].meta
	}
	return sum
}

// prefetchSlots is prefetch for known slots.
func (t *table) prefetchSlots(slots []uint32) uint64 {
	var sum uint64
	for _, i := range slots {
		if uint64(i) < t.size {
			sum += t.slots[i].meta
		}
	}
	return sum
}

// probe returns key's slot and true, or the free slot where key would go
// and false. Writer only.
func (t *table) probe(key uint64) (int, bool) {
	i := t.home(key)
	for {
		s := &t.slots[i]
		if s.loadMeta() == 0 {
			return int(i), false
		}
		if s.loadKey() == key {
			return int(i), true
		}
		i = t.next(i)
	}
}

// put occupies the free slot i with key and meta. The key is published
// before the meta so that a reader that sees the slot occupied also sees
// its key.
func (t *table) put(i int, key, meta uint64) {
	t.slots[i].storeKey(key)
	t.slots[i].storeMeta(meta | metaExists)
	t.used++
}

// insert puts key, known to be absent, in a free slot. The caller has made
// room.
func (t *table) insert(key, meta uint64) int {
	i, _ := t.probe(key)
	t.put(i, key, meta)
	return i
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
