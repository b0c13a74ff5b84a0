package index

import (
	"sync"
	"sync/atomic"
)

// maxTiers bounds the tiers of one holder: FIFO entries name a tier in a byte.
const maxTiers = 255

// tierState is one holder's blocks in one tier.
type tierState struct {
	name string
	tab  atomic.Pointer[table]
	// ext holds, per key, the groups outside 0-6 (rare: hybrid models with
	// many KV cache groups). Writer only.
	ext map[uint64][]int
	// childOver holds held-children counts past what a slot's byte holds,
	// as the excess over metaChildMask. Writer only.
	childOver map[uint64]int
}

// holderState is one holder's blocks for one model. Its mutex serialises
// writers (normally a single event worker); readers never take it.
type holderState struct {
	h     Holder
	mu    sync.Mutex
	tiers atomic.Pointer[[]*tierState]
	// live counts held (key, tier) pairs; read by the budget's victim scan.
	live     atomic.Int64
	capacity atomic.Int64
	dead     bool
	// fifo lists (tier, slot) pairs in the order they became held, from
	// head on; entries of blocks removed since are skipped when reached.
	fifoSlot []uint32
	fifoTier []uint8
	head     int
}

func newHolderState(h Holder, capacity int64) *holderState {
	hs := &holderState{h: h}
	hs.capacity.Store(capacity)
	empty := []*tierState{}
	hs.tiers.Store(&empty)
	return hs
}

func (hs *holderState) tierList() []*tierState { return *hs.tiers.Load() }

// tier returns the index and state of the named tier, adding it when create
// is set; ti is -1 when the tier is absent or the holder has maxTiers tiers.
func (hs *holderState) tier(name string, create bool) (int, *tierState) {
	list := hs.tierList()
	for i, ts := range list {
		if ts.name == name {
			return i, ts
		}
	}
	if !create || len(list) >= maxTiers {
		return -1, nil
	}
	ts := &tierState{name: name}
	ts.tab.Store(newTable(minTableSize))
	next := make([]*tierState, len(list), len(list)+1)
	copy(next, list)
	next = append(next, ts)
	hs.tiers.Store(&next)
	return len(next) - 1, ts
}

func groupBit(g int) uint64 {
	if g >= 0 && g < 7 {
		return 1 << uint(g)
	}
	return metaExtGroup
}

// children returns the number of held slots anchored to slot i.
func (ts *tierState) children(t *table, i int, m uint64) int {
	c := childrenOf(m)
	if c == metaChildMask {
		c += ts.childOver[t.slots[i].key.Load()]
	}
	return c
}

func (ts *tierState) addChild(t *table, p int) {
	s := &t.slots[p]
	m := s.meta.Load()
	if c := childrenOf(m); c == metaChildMask {
		if ts.childOver == nil {
			ts.childOver = make(map[uint64]int)
		}
		ts.childOver[s.key.Load()]++
		return
	}
	s.meta.Store(m + 1<<metaChildShift)
}

func (ts *tierState) dropChild(t *table, p int) {
	s := &t.slots[p]
	m := s.meta.Load()
	if childrenOf(m) == metaChildMask {
		k := s.key.Load()
		if n := ts.childOver[k]; n > 0 {
			if n == 1 {
				delete(ts.childOver, k)
			} else {
				ts.childOver[k] = n - 1
			}
			return
		}
	}
	s.meta.Store(m - 1<<metaChildShift)
}

// setGroups replaces slot i's groups and keeps brk, children counts and live
// in step. It returns +1 when the slot became held, -1 when it stopped being
// held, 0 otherwise. Increases of brk are published before the change that
// breaks a link, decreases after the change that repairs one, so a reader
// that saw brk at zero before and the epoch unchanged after its probes saw
// no broken link.
func (ts *tierState) setGroups(t *table, i int, groups uint64) int {
	s := &t.slots[i]
	m := s.meta.Load()
	was := held(m)
	now := groups != 0
	next := m&^metaGroups | groups
	switch {
	case !was && now:
		p := parentOf(m)
		orphan := p >= 0 && !held(t.slots[p].meta.Load())
		if orphan {
			t.brk.Add(1)
			t.epoch.Add(1)
		}
		s.meta.Store(next)
		if c := ts.children(t, i, m); c > 0 {
			t.brk.Add(int64(-c))
		}
		if p >= 0 {
			ts.addChild(t, p)
		}
		t.live.Add(1)
		return 1
	case was && !now:
		if c := ts.children(t, i, m); c > 0 {
			t.brk.Add(int64(c))
			t.epoch.Add(1)
		}
		s.meta.Store(next)
		if p := parentOf(m); p >= 0 {
			if !held(t.slots[p].meta.Load()) {
				t.brk.Add(-1)
			}
			ts.dropChild(t, p)
		}
		t.live.Add(-1)
		return -1
	default:
		if next != m {
			s.meta.Store(next)
		}
		return 0
	}
}

// addGroup marks group g held in slot i (key k), reporting whether the slot
// became held.
func (ts *tierState) addGroup(t *table, i int, k uint64, g int) bool {
	m := t.slots[i].meta.Load()
	bit := groupBit(g)
	if bit == metaExtGroup {
		gs := ts.ext[k]
		for _, x := range gs {
			if x == g {
				return false
			}
		}
		if ts.ext == nil {
			ts.ext = make(map[uint64][]int)
		}
		ts.ext[k] = append(gs, g)
	}
	return ts.setGroups(t, i, m&metaGroups|bit) > 0
}

// removeGroup clears group g in slot i (key k), reporting whether the slot
// stopped being held.
func (ts *tierState) removeGroup(t *table, i int, k uint64, g int) bool {
	m := t.slots[i].meta.Load()
	bit := groupBit(g)
	if m&bit == 0 {
		return false
	}
	if bit == metaExtGroup {
		gs := ts.ext[k]
		j := -1
		for x := range gs {
			if gs[x] == g {
				j = x
			}
		}
		if j < 0 {
			return false
		}
		gs = append(gs[:j], gs[j+1:]...)
		if len(gs) > 0 {
			ts.ext[k] = gs
			return false
		}
		delete(ts.ext, k)
	}
	return ts.setGroups(t, i, m&metaGroups&^bit) < 0
}

// drop clears every group of slot i (key k), reporting whether it was held.
func (ts *tierState) drop(t *table, i int, k uint64) bool {
	if t.slots[i].meta.Load()&metaExtGroup != 0 {
		delete(ts.ext, k)
	}
	return ts.setGroups(t, i, 0) < 0
}

func (hs *holderState) push(ti int, i int) {
	hs.fifoTier = append(hs.fifoTier, uint8(ti))
	hs.fifoSlot = append(hs.fifoSlot, uint32(i))
}

// evict drops up to n of the oldest holdings and returns how many it dropped.
func (hs *holderState) evict(n int64) int64 {
	tiers := hs.tierList()
	var done int64
	for done < n && hs.head < len(hs.fifoSlot) {
		ti, i := hs.fifoTier[hs.head], int(hs.fifoSlot[hs.head])
		hs.head++
		ts := tiers[ti]
		t := ts.tab.Load()
		if held(t.slots[i].meta.Load()) && ts.drop(t, i, t.slots[i].key.Load()) {
			done++
		}
	}
	hs.live.Add(-done)
	hs.maybeCompact()
	return done
}

// maybeCompact drops FIFO entries of removed blocks once they outnumber the
// live ones, so the FIFO stays proportional to what the holder holds.
func (hs *holderState) maybeCompact() {
	pending := len(hs.fifoSlot) - hs.head
	if pending < 1024 || int64(pending) < 2*hs.live.Load() {
		if hs.head > 0 && hs.head == len(hs.fifoSlot) {
			hs.fifoSlot, hs.fifoTier, hs.head = hs.fifoSlot[:0], hs.fifoTier[:0], 0
		}
		return
	}
	hs.compact(-1, nil)
}

// compact rewrites the FIFO keeping, for every held (tier, slot), its newest
// entry. When remap is set, entries of tier rt are translated through it
// (new slot + 1, 0 for a dropped slot) for a rehashed table.
func (hs *holderState) compact(rt int, remap []uint32) {
	tiers := hs.tierList()
	seen := make([][]uint64, len(tiers))
	for ti, ts := range tiers {
		seen[ti] = make([]uint64, (len(ts.tab.Load().slots)+63)/64)
	}
	w := len(hs.fifoSlot)
	for r := len(hs.fifoSlot) - 1; r >= hs.head; r-- {
		ti, i := int(hs.fifoTier[r]), hs.fifoSlot[r]
		if ti == rt {
			if remap[i] == 0 {
				continue
			}
			i = remap[i] - 1
		}
		t := tiers[ti].tab.Load()
		if !held(t.slots[i].meta.Load()) || seen[ti][i/64]&(1<<(i%64)) != 0 {
			continue
		}
		seen[ti][i/64] |= 1 << (i % 64)
		w--
		hs.fifoTier[w], hs.fifoSlot[w] = uint8(ti), i
	}
	n := copy(hs.fifoSlot, hs.fifoSlot[w:])
	copy(hs.fifoTier, hs.fifoTier[w:])
	hs.fifoSlot, hs.fifoTier, hs.head = hs.fifoSlot[:n], hs.fifoTier[:n], 0
}

// dropTiers removes the FIFO entries of the tiers marked gone.
func (hs *holderState) dropTiers(gone []bool) {
	w := 0
	for r := hs.head; r < len(hs.fifoSlot); r++ {
		if !gone[hs.fifoTier[r]] {
			hs.fifoTier[w], hs.fifoSlot[w] = hs.fifoTier[r], hs.fifoSlot[r]
			w++
		}
	}
	hs.fifoSlot, hs.fifoTier, hs.head = hs.fifoSlot[:w], hs.fifoTier[:w], 0
}

// rehash rebuilds tier ti's table with room for extra more slots, dropping
// slots that are neither held nor an ancestor of a held slot, and publishes
// it. Readers still on the old table see it as it was: it is not written
// again.
func (hs *holderState) rehash(ti int, extra int) *table {
	ts := hs.tierList()[ti]
	old := ts.tab.Load()
	remap := make([]uint32, len(old.slots))
	kept := 0
	for i := range old.slots {
		if !held(old.slots[i].meta.Load()) {
			continue
		}
		for j := i; j >= 0 && remap[j] == 0; j = parentOf(old.slots[j].meta.Load()) {
			remap[j] = 1
			kept++
		}
	}
	nt := newTable(tableSizeFor(kept + extra))
	for i := range old.slots {
		if remap[i] != 0 {
			m := old.slots[i].meta.Load()
			remap[i] = uint32(nt.insert(old.slots[i].key.Load(), m&^(metaParentMask<<metaParentShift))) + 1
		}
	}
	for i := range old.slots {
		if remap[i] == 0 {
			continue
		}
		if p := parentOf(old.slots[i].meta.Load()); p >= 0 {
			s := &nt.slots[remap[i]-1]
			s.meta.Store(s.meta.Load() | uint64(remap[p])<<metaParentShift)
		}
	}
	nt.brk.Store(old.brk.Load())
	nt.epoch.Store(old.epoch.Load())
	nt.live.Store(old.live.Load())
	ts.tab.Store(nt)
	hs.compact(ti, remap)
	return nt
}
