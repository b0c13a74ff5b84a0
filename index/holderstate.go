package index

import (
	"slices"
	"sync"
	"sync/atomic"
)

// maxTiers bounds the tiers of one holder per model: its lanes, a held
// and a ghost bit each in an element.
const maxTiers = 8

// holderState is one holder's state under one model: its lanes, counts,
// KV cache groups and eviction queues. Its holdings are bits in the
// model's entries; they change only under mu.
type holderState struct {
	// What a lookup reads of each holder it reports comes first, in one
	// cache line.
	h    Holder
	born uint64 // ms.releases when it got id (see modelState.holderAt)
	id   uint32 // in elements; the holder's for its life
	// lanes names the holder's tiers by lane, in the order it first stored
	// in them; replaced whole (readers), never shrunk. guess is the lane of
	// TierSpeculative, -1 before there is one.
	lanes atomic.Pointer[laneList]
	ms    *modelState

	mu sync.Mutex
	// dead: the holder left its model; a writer that waited for mu
	// makes a new state.
	dead  bool
	guess int
	held  [maxTiers]atomic.Int64 // holdings per lane
	// live counts the holdings outside the guess lane: what capacity and
	// the budget bound.
	live     atomic.Int64
	capacity atomic.Int64
	// groups has the KV cache groups of holdings whose groups are not
	// group 0 alone, by groupKey; most holdings have none here.
	groups map[uint64][]int
	// queue is the eviction order of the holdings outside the guess lane;
	// guesses lists those in it, never evicted (Speculative bounds them).
	// ghosts counts the ghosts each names.
	queue, guesses     queue
	ghosts, guessGhost int64

	memo    setMemo
	scratch []uint32
}

func groupKey(id uint32, lane int) uint64 { return uint64(id)<<3 | uint64(lane) }

// laneList is a holder's lane names, in one allocation.
type laneList struct {
	n     int
	names [maxTiers]string
}

// maxLaneLists bounds the lane lists a model shares: holders with the
// same tiers in the same order share one, which lookups then read from
// cache; past the bound, a holder's list is its own.
const maxLaneLists = 1024

// internLanes returns the model's copy of ll.
func (ms *modelState) internLanes(ll laneList) *laneList {
	ms.laneMu.Lock()
	defer ms.laneMu.Unlock()
	if p, ok := ms.laneLists[ll]; ok {
		return p
	}
	p := &ll
	if len(ms.laneLists) < maxLaneLists {
		if ms.laneLists == nil {
			ms.laneLists = make(map[laneList]*laneList)
		}
		ms.laneLists[ll] = p
	}
	return p
}

func (hs *holderState) laneNames() []string { return hs.lanes.Load().slice() }

func (ll *laneList) slice() []string { return ll.names[:ll.n] }

// lane returns the lane of tier, adding it when create is set; -1 when
// absent, or when the holder has maxTiers lanes.
func (hs *holderState) lane(tier string, create bool) int {
	names := hs.laneNames()
	if i := slices.Index(names, tier); i >= 0 {
		return i
	}
	if !create || len(names) >= maxTiers {
		return -1
	}
	next := laneList{n: len(names) + 1}
	copy(next.names[:], names)
	next.names[len(names)] = tier
	ll := hs.ms.internLanes(next)
	hs.lanes.Store(ll)
	hs.ms.reg.set(hs.id, &holderRef{h: hs.h, born: hs.born, lanes: ll, hs: hs})
	if tier == TierSpeculative {
		hs.guess = len(names)
	}
	return len(names)
}

// lanesOf returns the mask of the lanes named in tiers, all for nil.
func (hs *holderState) lanesOf(tiers []string) uint8 {
	if tiers == nil {
		return 0xFF
	}
	var m uint8
	for l, name := range hs.laneNames() {
		if slices.Contains(tiers, name) {
			m |= 1 << l
		}
	}
	return m
}

// queueOf returns the queue of lane's holdings and its ghost count.
func (hs *holderState) queueOf(lane int) (*queue, *int64) {
	if lane == hs.guess {
		return &hs.guesses, &hs.guessGhost
	}
	return &hs.queue, &hs.ghosts
}

// addGroup records that the holding of (id, lane), held with groups
// before (new when !held), has group g too.
func (hs *holderState) addGroup(id uint32, lane int, g int, held bool) {
	k := groupKey(id, lane)
	gs, listed := hs.groups[k]
	switch {
	case !held:
		if g != 0 {
			hs.setGroups(k, []int{g})
		}
	case !listed:
		if g != 0 {
			hs.setGroups(k, []int{min(0, g), max(0, g)})
		}
	default:
		if i, found := slices.BinarySearch(gs, g); !found {
			hs.groups[k] = slices.Insert(gs, i, g)
		}
	}
}

func (hs *holderState) setGroups(k uint64, gs []int) {
	if hs.groups == nil {
		hs.groups = make(map[uint64][]int)
	}
	hs.groups[k] = gs
}

// removeGroup records that group g no longer holds (id, lane), and
// reports whether the holding is gone: no group holds it.
func (hs *holderState) removeGroup(id uint32, lane int, g int) bool {
	k := groupKey(id, lane)
	gs, listed := hs.groups[k]
	if !listed {
		return g == 0
	}
	i, found := slices.BinarySearch(gs, g)
	if !found {
		return false
	}
	gs = slices.Delete(gs, i, i+1)
	switch {
	case len(gs) == 0:
		delete(hs.groups, k)
		return true
	case len(gs) == 1 && gs[0] == 0:
		delete(hs.groups, k)
	default:
		hs.groups[k] = gs
	}
	return false
}

// groupsOf returns the groups of (id, lane): nil for group 0 alone.
func (hs *holderState) groupsOf(id uint32, lane int) []int {
	return hs.groups[groupKey(id, lane)]
}

// drop takes hs's bits of (id, lane) out of its entry, as the queue drops
// the item naming it, and reports whether it was held: then the caller
// counts it gone. hs.mu is held.
func (hs *holderState) drop(id uint32, lane int) bool {
	ms := hs.ms
	key := ms.entry(id).key.Load()
	old, ok := ms.update(hs, id, key, lane, opDrop)
	if !ok {
		return false
	}
	_, ghosts := hs.queueOf(lane)
	if old&ghostBit(lane) != 0 {
		*ghosts--
	}
	if old&laneBit(lane) == 0 {
		return false
	}
	delete(hs.groups, groupKey(id, lane))
	hs.held[lane].Add(-1)
	if lane != hs.guess {
		hs.live.Add(-1)
	}
	return true
}

// evict drops up to n of hs's oldest holdings and returns how many.
func (hs *holderState) evict(n int64) int64 {
	var done int64
	for done < n {
		id, lane, ok := hs.queue.pop()
		if !ok {
			break
		}
		if hs.drop(id, lane) {
			done++
		}
	}
	return done
}

// Ghosts are dropped once they pass ghostNum/ghostDen of the holdings
// (and 64): ghost entries are memory a removal does not free at once.
const ghostNum, ghostDen = 1, 4

// maybeCompact drops the ghosts from lane's queue once there are too many.
func (hs *holderState) maybeCompact(lane int) {
	q, ghosts := hs.queueOf(lane)
	if *ghosts <= (q.n-*ghosts)*ghostNum/ghostDen+64 {
		return
	}
	ms := hs.ms
	q.keep(func(id uint32, lane int) bool {
		b, _ := ms.ownBits(hs, id, ms.entry(id).key.Load())
		if b&ghostBit(lane) == 0 {
			return true
		}
		hs.drop(id, lane)
		return false
	})
}

// clearLanes drops every holding of hs in the lanes of mask and returns
// how many there were outside the guess lane, and in it.
func (hs *holderState) clearLanes(mask uint8) (n, guesses int64) {
	for _, q := range []*queue{&hs.queue, &hs.guesses} {
		q.keep(func(id uint32, lane int) bool {
			if mask&(1<<lane) == 0 {
				return true
			}
			if hs.drop(id, lane) {
				if lane == hs.guess {
					guesses++
				} else {
					n++
				}
			}
			return false
		})
	}
	return n, guesses
}
