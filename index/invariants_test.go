package index

import (
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// checkInvariants verifies, at rest, every invariant the package doc's
// DESIGN section lists, over every model, entry and holder. Failures are
// collected, and reported once, so that the walk costs no require per
// entry.
func checkInvariants(t *testing.T, ix *Index, op int) {
	t.Helper()
	var errs []string
	fail := func(format string, args ...any) {
		if len(errs) < 10 {
			errs = append(errs, fmt.Sprintf(format, args...))
		}
	}
	var total, shared int64
	ix.models.Range(func(model string, ms *modelState) bool {
		list := *ms.list.Load()
		for _, hs := range list {
			hs.mu.Lock()
		}
		defer func() {
			for _, hs := range list {
				hs.mu.Unlock()
			}
		}()
		byID := make(map[uint32]*holderState)
		for _, hs := range list {
			// 1. Registry: each listed holder has its id, and only it.
			if ref := ms.reg.at(hs.id); ref == nil || ref.hs != hs || ref.h != hs.h || ref.born != hs.born || ref.lanes != hs.lanes.Load() || byID[hs.id] != nil {
				fail("%s %v: id %d not its own", model, hs.h, hs.id)
			}
			byID[hs.id] = hs
			if cur, _ := ms.holders.Load(hs.h); cur != hs {
				fail("%s %v: listed but not in holders", model, hs.h)
			}
		}
		// bitsOf[holder][entry] are the holder's bits, from the entries.
		bitsOf := make(map[*holderState]map[uint32]uint64)
		for _, hs := range list {
			bitsOf[hs] = make(map[uint32]uint64)
		}
		// 2. Key table: each live slot names a live entry of its key, each
		// key once; counts exact.
		named := make(map[uint32]bool)
		for si := range ms.keys {
			sh := &ms.keys[si]
			tab := sh.tab.Load()
			used, tombs := 0, 0
			for i := range tab.slots {
				switch v := tab.slots[i].Load(); v {
				case 0:
				case tomb:
					tombs++
				default:
					used++
					id := v - 1
					en := ms.entry(id)
					if named[id] {
						fail("%s: entry %d named twice", model, id)
					}
					named[id] = true
					if en.word.Load()&kindMask == kindFree {
						fail("%s: slot names freed entry %d", model, id)
					}
					if got, ok := ms.find(en.key.Load()); !ok || got != id {
						fail("%s: key %#x of entry %d not found by its key", model, en.key.Load(), id)
					}
				}
			}
			if used != sh.used || tombs != sh.tombs {
				fail("%s shard %d: %d used %d tombs, counted %d %d", model, si, used, tombs, sh.used, sh.tombs)
			}
		}
		// 3. Entries: every entry is free or named; a named one has a
		// holder bit, and its set is in its form's shape.
		free := make(map[uint32]bool)
		for _, id := range ms.freeEntry[ms.freeHead:] {
			free[id] = true
		}
		var sets int64
		for id := range ms.nextEntry {
			en := ms.entry(id)
			w := en.word.Load()
			if w&wordLock != 0 {
				fail("%s: entry %d locked at rest", model, id)
			}
			if w&kindMask == kindFree {
				if named[id] || !free[id] {
					fail("%s: freed entry %d named or not on the free list", model, id)
				}
				continue
			}
			if !named[id] || free[id] {
				fail("%s: entry %d live but not named, or on the free list", model, id)
				continue
			}
			var es []elem
			switch w & kindMask {
			case kindNone:
				fail("%s: entry %d has no holder at rest", model, id)
			case kindOne:
				es = []elem{w >> oneShift & elemMask}
			case kindSet:
				sets++
				s := ms.setAt(uint32(w >> setSlotShift))
				if s.large() {
					view{set: s}.eachBits(func(x uint32, b uint64) { es = append(es, mkElem(x, b)) })
					if int(s.n) != len(es) || len(es) < smallMin-1 {
						fail("%s: entry %d: large set of %d counts %d", model, id, len(es), s.n)
					}
				} else {
					es = s.small
					if len(es) < 2 || len(es) > largeMin || !slices.IsSortedFunc(es, func(a, b elem) int { return int(elemID(a)) - int(elemID(b)) }) {
						fail("%s: entry %d: small set of %d, sorted %v", model, id, len(es), slices.IsSorted(es))
					}
				}
			}
			for i, e := range es {
				if e&elemBits == 0 || i > 0 && elemID(es[i-1]) == elemID(e) {
					fail("%s: entry %d: element %#x empty or twice", model, id, e)
				}
				hs := byID[elemID(e)]
				if hs == nil {
					fail("%s: entry %d: holder id %d not a holder", model, id, elemID(e))
					continue
				}
				if uint8(e|e>>8)>>len(hs.laneNames()) != 0 {
					fail("%s %v: entry %d: a bit of a lane it lacks", model, hs.h, id)
				}
				bitsOf[hs][id] = e & elemBits
			}
		}
		if sets != ms.setEntries.Load() {
			fail("%s: %d entries with sets, counted %d", model, sets, ms.setEntries.Load())
		}
		shared += sets
		// 4. Queues: each holder's queue names each of its holdings and
		// ghosts outside the guess lane once, its guess queue those in it,
		// and nothing else; counts exact; groups listed only for holdings.
		for _, hs := range list {
			var held [maxTiers]int64
			var ghosts, guessGhosts int64
			want := make(map[uint64]bool)
			for id, b := range bitsOf[hs] {
				for l := range maxTiers {
					if b&laneBit(l) != 0 {
						held[l]++
					}
					if b&ghostBit(l) != 0 {
						if l == hs.guess {
							guessGhosts++
						} else {
							ghosts++
						}
					}
					if b&(laneBit(l)|ghostBit(l)) != 0 {
						want[groupKey(id, l)] = true
					}
				}
			}
			got := make(map[uint64]bool)
			for qi, q := range []*queue{&hs.queue, &hs.guesses} {
				var n int64
				q.each(func(id uint32, lane int) bool {
					n++
					k := groupKey(id, lane)
					if got[k] || (lane == hs.guess) != (qi == 1) {
						fail("%s %v: entry %d lane %d queued twice or in the wrong queue", model, hs.h, id, lane)
					}
					got[k] = true
					return true
				})
				if n != q.n {
					fail("%s %v: queue names %d, counts %d", model, hs.h, n, q.n)
				}
			}
			for k := range want {
				if !got[k] {
					fail("%s %v: entry %d lane %d not queued", model, hs.h, k>>3, k&7)
				}
			}
			for k := range got {
				if !want[k] {
					fail("%s %v: queue names entry %d lane %d it has no bit of", model, hs.h, k>>3, k&7)
				}
			}
			if ghosts != hs.ghosts || guessGhosts != hs.guessGhost {
				fail("%s %v: %d+%d ghosts, counted %d+%d", model, hs.h, ghosts, guessGhosts, hs.ghosts, hs.guessGhost)
			}
			var live int64
			for l := range maxTiers {
				if held[l] != hs.held[l].Load() {
					fail("%s %v: lane %d holds %d, counted %d", model, hs.h, l, held[l], hs.held[l].Load())
				}
				if l != hs.guess {
					live += held[l]
				}
			}
			if live != hs.live.Load() {
				fail("%s %v: %d holdings, counted %d", model, hs.h, live, hs.live.Load())
			}
			if c := hs.capacity.Load(); c > 0 && live > c {
				fail("%s %v: %d holdings past capacity %d", model, hs.h, live, c)
			}
			total += live
			for k, gs := range hs.groups {
				id, l := uint32(k>>3), int(k&7)
				if bitsOf[hs][id]&laneBit(l) == 0 || len(gs) == 0 || len(gs) == 1 && gs[0] == 0 || !slices.IsSorted(gs) || len(slices.Compact(slices.Clone(gs))) != len(gs) {
					fail("%s %v: groups %v of entry %d lane %d", model, hs.h, gs, id, l)
				}
			}
		}
		// 5. Ids: a free id names no holder.
		for _, id := range ms.freeIDs {
			if ms.reg.at(id) != nil {
				fail("%s: free id %d names a holder", model, id)
			}
		}
		return true
	})
	if got := ix.total.Load(); got != total {
		fail("index counts %d holdings, holders %d", got, total)
	}
	if got := ix.shared.Load(); got != shared {
		fail("index counts %d shared blocks, models %d", got, shared)
	}
	require.Empty(t, errs, "op %d", op)
}
