package index

import (
	"math/bits"
	"sync"
	"sync/atomic"
)

// The key table maps a model's block keys to entry ids: open addressing
// over 32-bit slots (0 empty, tomb a removed key, else id+1), split into
// shards by the key's top bits so that writers of different blocks seldom
// share a lock and a growing shard rebuilds only itself. Readers take no
// lock: a shard's table is rebuilt aside and swapped in, and a slot's id
// is checked against the entry's key.
const (
	keyShardBits = 5
	keyShards    = 1 << keyShardBits
	minKeyTab    = 16
	tomb         = ^uint32(0)
	// A shard's table is rebuilt past 3/4 full (tombs count), to twice its
	// size when its live keys fill more than 3/8 of it.
	keyLoadNum, keyLoadDen = 3, 4
)

type keyShard struct {
	mu          sync.Mutex
	tab         atomic.Pointer[keyTab]
	used, tombs int
}

type keyTab struct {
	slots []atomic.Uint32
	shift uint
	mask  uint64
}

func newKeyTab(size int) *keyTab {
	return &keyTab{slots: make([]atomic.Uint32, size), shift: uint(64 - bits.TrailingZeros(uint(size))), mask: uint64(size - 1)}
}

func keyHash(key uint64) uint64 { return key * 0x9E3779B97F4A7C15 }

func (ms *modelState) shard(key uint64) *keyShard {
	return &ms.keys[keyHash(key)>>(64-keyShardBits)]
}

func (t *keyTab) home(h uint64) uint64 { return (h << keyShardBits) >> t.shift }

// find returns the id of key's entry.
func (ms *modelState) find(key uint64) (uint32, bool) {
	id, en := ms.findEntry(key)
	return id, en != nil
}

// findEntry returns key's entry and its id; nil when there is none.
func (ms *modelState) findEntry(key uint64) (uint32, *entry) {
	h := keyHash(key)
	t := ms.keys[h>>(64-keyShardBits)].tab.Load()
	for i := t.home(h); ; i = (i + 1) & t.mask {
		switch v := t.slots[i].Load(); v {
		case 0:
			return 0, nil
		case tomb:
		default:
			if en := ms.entry(v - 1); en.key.Load() == key {
				return v - 1, en
			}
		}
	}
}

// follow returns key's entry and its id, trying first the entries beside
// prev (tomb: none): a chain one store made has consecutive ids, so a walk
// along a prompt mostly finds each block beside the last, without the key
// table. A guessed entry counts only with holders: one made for key and
// not yet published has none.
func (ms *modelState) follow(prev uint32, key uint64) (uint32, *entry) {
	if prev != tomb {
		dir := *ms.arena.Load()
		// After prev, for a walk along a prompt; before it, for a removal
		// of a chain leaf first, as engines report evictions.
		for _, g := range [2]uint32{prev + 1, prev - 1} {
			if c, off := chunkOf(g); c < len(dir) {
				en := &dir[c][off]
				// The key again after the word: a freed entry keeps its
				// key until it is reused, and reuse sets the word first.
				if en.key.Load() == key {
					if k := en.word.Load() & kindMask; (k == kindOne || k == kindSet) && en.key.Load() == key {
						return g, en
					}
				}
			}
		}
	}
	return ms.findEntry(key)
}

// insert publishes id as key's entry, unless key has one: then it returns
// that one and false.
func (ms *modelState) insert(key uint64, id uint32) (uint32, bool) {
	sh := ms.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	h := keyHash(key)
	t := sh.tab.Load()
	for i := t.home(h); ; i = (i + 1) & t.mask {
		v := t.slots[i].Load()
		if v == 0 {
			break
		}
		if v != tomb && ms.entry(v-1).key.Load() == key {
			return v - 1, false
		}
	}
	if (sh.used+sh.tombs+1)*keyLoadDen > len(t.slots)*keyLoadNum {
		size := len(t.slots)
		if (sh.used+1)*keyLoadDen*2 > size*keyLoadNum {
			size *= 2
		}
		t = ms.rebuild(t, size)
		sh.tab.Store(t)
		sh.tombs = 0
	}
	for i := t.home(h); ; i = (i + 1) & t.mask {
		if v := t.slots[i].Load(); v == 0 || v == tomb {
			if v == tomb {
				sh.tombs--
			}
			t.slots[i].Store(id + 1)
			sh.used++
			return id, true
		}
	}
}

// rebuild returns t's live slots in a new table of size slots.
func (ms *modelState) rebuild(t *keyTab, size int) *keyTab {
	n := newKeyTab(size)
	for i := range t.slots {
		v := t.slots[i].Load()
		if v == 0 || v == tomb {
			continue
		}
		h := keyHash(ms.entry(v - 1).key.Load())
		j := n.home(h)
		for n.slots[j].Load() != 0 {
			j = (j + 1) & n.mask
		}
		n.slots[j].Store(v)
	}
	return n
}

// remove takes entry id out of key's slot.
func (sh *keyShard) remove(key uint64, id uint32) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	t := sh.tab.Load()
	for i := t.home(keyHash(key)); ; i = (i + 1) & t.mask {
		switch v := t.slots[i].Load(); v {
		case 0:
			return
		case id + 1:
			t.slots[i].Store(tomb)
			sh.used--
			sh.tombs++
			return
		}
	}
}
