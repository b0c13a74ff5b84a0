package index

import (
	"math/bits"
	"sync"
	"sync/atomic"

	"github.com/puzpuzpuz/xsync/v4"
)

// modelState is one model's store: its blocks, each kept once, and its
// holders.
//
// Blocks are entries in an arena of fixed-size chunks (an entry's id is
// its place, for life), found by key through the key table, with their
// holder sets in the set table. Holders have a model-local id (the id in
// their elements) listed in the registry.
type modelState struct {
	holders *xsync.Map[Holder, *holderState]
	// mu serialises holder creation and removal: the list, the registry
	// and the ids.
	mu   sync.Mutex
	list atomic.Pointer[[]*holderState]
	reg  registry
	// nextID and freeIDs are the holder ids to give; releases counts ids
	// freed, so that a reader can tell an id it read from one given since.
	nextID   uint32
	freeIDs  []uint32
	releases atomic.Uint64
	// dead: the model's last holder went and the model left
	// Index.models, under mu; a holder made in it would be lost.
	dead bool

	// laneLists has the lane lists holders share (internLanes).
	laneMu    sync.Mutex
	laneLists map[laneList]*laneList

	keys [keyShards]keyShard

	// allocMu guards the arena's and set table's growth and free lists.
	allocMu    sync.Mutex
	arena      atomic.Pointer[[]entryChunk]
	nextEntry  uint32
	freeEntry  []uint32 // first in, first out: ids freed in order come back in order
	freeHead   int
	sets       atomic.Pointer[[]setChunk]
	nextSet    uint32
	freeSets   []uint32
	setGen     uint32
	entries    atomic.Int64 // entries in use
	setEntries atomic.Int64 // entries with a holder set
	// shared is the Index's count of entries with a holder set.
	shared *atomic.Int64
}

// The arena, the set table and the registry grow by chunks that never
// move: 16 items, then twice as many each time up to 4,096, then 4,096
// each, so that a model with a few blocks costs little and one with
// millions copies no items as it grows.
const (
	firstChunkBits = 4
	lastChunkBits  = 12
	// geometric is how many items the growing chunks hold.
	geometric = 1<<(lastChunkBits+1) - 1<<firstChunkBits
)

// chunkOf returns the chunk that holds item i, and i's place in it.
func chunkOf(i uint32) (c int, off uint32) {
	if i < geometric {
		k := bits.Len32(i>>firstChunkBits+1) - 1
		return k, i - (1<<firstChunkBits<<k - 1<<firstChunkBits)
	}
	x := i - geometric
	return lastChunkBits - firstChunkBits + 1 + int(x>>lastChunkBits), x & (1<<lastChunkBits - 1)
}

// chunkLen is the size of chunk c.
func chunkLen(c int) int {
	return 1 << firstChunkBits << min(c, lastChunkBits-firstChunkBits)
}

// growChunks makes the chunks up to the one of item i, publishing the
// new directory in p.
func growChunks[T any](p *atomic.Pointer[[][]T], i uint32) {
	dir := *p.Load()
	c, _ := chunkOf(i)
	if c < len(dir) {
		return
	}
	next := make([][]T, c+1)
	copy(next, dir)
	for k := len(dir); k <= c; k++ {
		next[k] = make([]T, chunkLen(k))
	}
	p.Store(&next)
}

type entryChunk = []entry
type setChunk = []atomic.Pointer[holderSet]

func newModelState(shared *atomic.Int64) *modelState {
	ms := &modelState{holders: xsync.NewMap[Holder, *holderState](), shared: shared}
	empty := []*holderState{}
	ms.list.Store(&empty)
	ms.arena.Store(&[]entryChunk{})
	ms.sets.Store(&[]setChunk{})
	ms.reg.dir.Store(&[]regChunk{})
	for i := range ms.keys {
		ms.keys[i].tab.Store(newKeyTab(minKeyTab))
	}
	return ms
}

func (ms *modelState) entry(id uint32) *entry {
	c, off := chunkOf(id)
	return &(*ms.arena.Load())[c][off]
}

func (ms *modelState) setAt(slot uint32) *holderSet {
	dir := *ms.sets.Load()
	c, off := chunkOf(slot)
	if c >= len(dir) {
		return nil
	}
	return dir[c][off].Load()
}

// read returns what entry id says of key: false when it is not (or no
// longer) key's entry.
func (ms *modelState) read(id uint32, key uint64) (view, bool) {
	return ms.readEntry(ms.entry(id), key)
}

func (ms *modelState) readEntry(en *entry, key uint64) (view, bool) {
	for {
		w := en.word.Load()
		if en.key.Load() != key {
			return view{}, false
		}
		switch w & kindMask {
		case kindOne:
			return view{one: w >> oneShift & elemMask}, true
		case kindSet:
			s := ms.setAt(uint32(w >> setSlotShift))
			if en.word.Load()&^wordLock != w&^wordLock || s == nil {
				// Changed meanwhile: the slot may be another entry's.
				continue
			}
			return view{set: s}, true
		case kindNone:
			return view{}, true
		default:
			return view{}, false
		}
	}
}

// view returns key's holders; false when no entry has key.
func (ms *modelState) view(key uint64) (view, bool) {
	_, en := ms.findEntry(key)
	if en == nil {
		return view{}, false
	}
	return ms.readEntry(en, key)
}

// allocEntries appends n entry ids to dst, for keys, and sets their keys:
// they are free to publish.
func (ms *modelState) allocEntries(keys []uint64, dst []uint32) []uint32 {
	ms.allocMu.Lock()
	defer ms.allocMu.Unlock()
	for _, k := range keys {
		var id uint32
		if ms.freeHead < len(ms.freeEntry) {
			id = ms.freeEntry[ms.freeHead]
			ms.freeHead++
			if ms.freeHead == len(ms.freeEntry) {
				ms.freeEntry, ms.freeHead = ms.freeEntry[:0], 0
			}
		} else {
			id = ms.nextEntry
			ms.nextEntry++
			growChunks(&ms.arena, id)
		}
		// Locked until published (resolve) or released: a writer holding
		// the id from the entry's last life waits, then finds it the key's
		// or free.
		en := ms.entry(id)
		en.word.Store(kindNone | wordLock)
		en.key.Store(k)
		dst = append(dst, id)
	}
	ms.entries.Add(int64(len(keys)))
	return dst
}

// releaseEntry returns an id allocated and not published, still locked.
func (ms *modelState) releaseEntry(id uint32) {
	ms.entry(id).unlock(kindFree)
	ms.allocMu.Lock()
	ms.freeEntry = append(ms.freeEntry, id)
	ms.allocMu.Unlock()
	ms.entries.Add(-1)
}

// free frees entry id of key, whose lock the caller holds and whose last
// holder bit it just cleared.
func (ms *modelState) free(en *entry, id uint32, key uint64) {
	en.unlock(kindFree)
	ms.shard(key).remove(key, id)
	ms.allocMu.Lock()
	if ms.freeHead > 0 && ms.freeHead*2 >= len(ms.freeEntry) {
		n := copy(ms.freeEntry, ms.freeEntry[ms.freeHead:])
		ms.freeEntry, ms.freeHead = ms.freeEntry[:n], 0
	}
	ms.freeEntry = append(ms.freeEntry, id)
	ms.allocMu.Unlock()
	ms.entries.Add(-1)
}

// allocSet gives s a slot and returns the holder word that names it,
// with a generation: a reader that loaded the word, then the slot, then
// the word again, tells a slot freed and given back meanwhile.
func (ms *modelState) allocSet(s *holderSet) uint64 {
	ms.allocMu.Lock()
	var slot uint32
	if n := len(ms.freeSets); n > 0 {
		slot = ms.freeSets[n-1]
		ms.freeSets = ms.freeSets[:n-1]
	} else {
		slot = ms.nextSet
		ms.nextSet++
		growChunks(&ms.sets, slot)
	}
	ms.putSet(slot, s)
	ms.setGen++
	gen := ms.setGen
	ms.allocMu.Unlock()
	ms.setEntries.Add(1)
	ms.shared.Add(1)
	return kindSet | uint64(slot)<<setSlotShift | uint64(gen)&setGenMask<<setGenShift
}

func (ms *modelState) putSet(slot uint32, s *holderSet) {
	c, off := chunkOf(slot)
	(*ms.sets.Load())[c][off].Store(s)
}

func (ms *modelState) freeSet(slot uint32) {
	ms.allocMu.Lock()
	ms.putSet(slot, nil)
	ms.freeSets = append(ms.freeSets, slot)
	ms.allocMu.Unlock()
	ms.setEntries.Add(-1)
	ms.shared.Add(-1)
}

// registry maps holder ids to holders, for readers: chunks of pointers,
// so that a new holder copies nothing. Each names a holderRef, what a
// lookup reads of the holder it reports, small and made in the order
// holders come, so that a lookup of many holders reads them from few
// cache lines.
type registry struct {
	dir atomic.Pointer[[]regChunk]
}

// holderRef is what the registry keeps of a holder; replaced whole when
// its lanes change.
type holderRef struct {
	h     Holder
	born  uint64 // ms.releases when it got its id (see holderAt)
	lanes *laneList
	hs    *holderState
}

type regChunk = []atomic.Pointer[holderRef]

func (r *registry) at(id uint32) *holderRef {
	dir := *r.dir.Load()
	c, off := chunkOf(id)
	if c >= len(dir) {
		return nil
	}
	return dir[c][off].Load()
}

// holder returns the holder with id, nil for none.
func (r *registry) holder(id uint32) *holderState {
	if ref := r.at(id); ref != nil {
		return ref.hs
	}
	return nil
}

// set names ref (nil: none) by id. The model's mu is held, or the
// holder's while it lives (its lanes changed).
func (r *registry) set(id uint32, ref *holderRef) {
	growChunks(&r.dir, id)
	c, off := chunkOf(id)
	(*r.dir.Load())[c][off].Store(ref)
}

// holderAt returns the holder with id if it had the id before a reader
// that loaded releases r0 started: an id freed and given again since may
// have the blocks of the holder before it in what the reader saw.
func (ms *modelState) holderAt(id uint32, r0 uint64) *holderRef {
	ref := ms.reg.at(id)
	if ref == nil || ref.born > r0 {
		return nil
	}
	return ref
}
