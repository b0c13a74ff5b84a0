package index

import (
	"slices"
	"sync"
	"sync/atomic"
)

// maxTiers bounds the tiers of one holder: FIFO entries name a tier in a
// byte, below the bytes of layer entries (fifoLayer on).
const maxTiers = fifoLayer

// tierState is one holder's blocks in one tier.
type tierState struct {
	name string
	// guess is set for TierSpeculative, whose holdings are in no eviction
	// queue nor budget (see storeGuesses).
	guess bool
	tab   atomic.Pointer[table]
	// ext holds, per key, the groups outside 0-6 (rare: hybrid models with
	// many KV cache groups). Writer only.
	ext map[uint64][]int
	// childOver holds held-children counts past what a slot's byte holds,
	// as the excess over metaChildMask. Writer only.
	childOver map[uint64]int
	// gaps maps the key of every gap (an unheld slot with held children)
	// to its depth. Writer only; the table publishes it to readers.
	gaps map[uint64]uint64
	// live counts held slots (writer only); held publishes it for
	// HolderBlocks after each write.
	live int64
	held atomic.Int64
	// migrated counts the table's slots marked metaMigrated, and
	// migratedKept those its last rebuild kept. Writer only.
	migrated, migratedKept int
}

// holderState is one holder's blocks for one model. Its mutex serialises
// writers (normally a single event worker); readers never take it.
type holderState struct {
	h     Holder
	ms    *modelState
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
	// sink keeps prefetching loads from being optimised away.
	sink uint64
	// scratch holds Remove's slots between its two passes, dropped the
	// keys of the chain starts a rebuild drops.
	scratch []int32
	dropped []uint64
	// queued counts the holdings the FIFO names from head on (a run of
	// layer entries names several).
	queued int

	// The holder's part of its model's layer: its id there + 1 (0 while
	// it has none), its holdings per lane (laneLive, writer only;
	// laneHeld, published), and the groups of layer holdings held for
	// groups other than just 0, by layerGroupKey.
	lid        atomic.Uint32
	laneLive   [layerLanes]int64
	laneHeld   [layerLanes]atomic.Int64
	laneGroups map[uint64][]int
}

func newHolderState(ms *modelState, h Holder, capacity int64) *holderState {
	hs := &holderState{h: h, ms: ms}
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
	ts := &tierState{name: name, guess: name == TierSpeculative}
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
		c += ts.childOver[t.slots[i].loadKey()]
	}
	return c
}

func (ts *tierState) addChild(t *table, p int) {
	s := &t.slots[p]
	m := s.loadMeta()
	if c := childrenOf(m); c == metaChildMask {
		if ts.childOver == nil {
			ts.childOver = make(map[uint64]int)
		}
		ts.childOver[s.loadKey()]++
		return
	}
	s.storeMeta(m + 1<<metaChildShift)
}

func (ts *tierState) dropChild(t *table, p int) {
	s := &t.slots[p]
	m := s.loadMeta()
	if childrenOf(m) == metaChildMask {
		k := s.loadKey()
		if n := ts.childOver[k]; n > 0 {
			if n == 1 {
				delete(ts.childOver, k)
			} else {
				ts.childOver[k] = n - 1
			}
			return
		}
	}
	s.storeMeta(m - 1<<metaChildShift)
}

// setGroups replaces slot i's groups and keeps gaps, children counts and
// live in step. It returns +1 when the slot became held, -1 when it stopped
// being held, 0 otherwise. A gap is published before the change that opens
// it and withdrawn after the change that closes it, so a reader that saw
// the epoch unchanged across its probes knew every gap it could meet.
func (ts *tierState) setGroups(t *table, i int, groups uint64) int {
	s := &t.slots[i]
	m := s.loadMeta()
	was := held(m)
	now := groups != 0
	next := m&^metaGroups | groups
	switch {
	case !was && now:
		if next&metaMigrated != 0 {
			next &^= metaMigrated
			ts.migrated--
		}
		p := parentOf(m)
		if p >= 0 {
			if pm := t.slots[p].loadMeta(); !held(pm) {
				ts.addGap(t, t.slots[p].loadKey(), pm)
			}
		}
		s.storeMeta(next)
		if ts.children(t, i, m) > 0 {
			ts.removeGap(t, s.loadKey())
		}
		if p >= 0 {
			ts.addChild(t, p)
		}
		ts.live++
		return 1
	case was && !now:
		if ts.children(t, i, m) > 0 {
			ts.addGap(t, s.loadKey(), m)
		}
		s.storeMeta(next)
		if p := parentOf(m); p >= 0 {
			ts.dropChild(t, p)
			if pm := t.slots[p].loadMeta(); !held(pm) && ts.children(t, p, pm) == 0 {
				ts.removeGap(t, t.slots[p].loadKey())
			}
		}
		ts.live--
		return -1
	default:
		if next != m {
			s.storeMeta(next)
		}
		return 0
	}
}

// addGap records the unheld slot with key k and meta m as a gap and
// publishes it, before the caller opens it.
func (ts *tierState) addGap(t *table, k uint64, m uint64) {
	if _, ok := ts.gaps[k]; ok {
		return
	}
	if ts.gaps == nil {
		ts.gaps = make(map[uint64]uint64)
	}
	d := uint64(depthOf(m))
	ts.gaps[k] = d
	if n := int(t.gapN.Load()); n >= 0 && n < maxGaps {
		t.gaps[n].key.Store(k)
		t.gaps[n].depth.Store(d)
		t.gapN.Store(int32(n + 1))
	} else {
		t.gapN.Store(-1)
	}
	t.epoch.Add(1)
}

// removeGap withdraws the gap with key k, if any, after the caller closed
// it. A reader that loaded the old count may still see a stale gap, which
// only makes it probe more.
func (ts *tierState) removeGap(t *table, k uint64) {
	if _, ok := ts.gaps[k]; !ok {
		return
	}
	delete(ts.gaps, k)
	n := int(t.gapN.Load())
	if n < 0 {
		if len(ts.gaps) <= maxGaps {
			ts.publishGaps(t)
		}
		return
	}
	for j := range n {
		if t.gaps[j].key.Load() == k {
			t.gaps[j].key.Store(t.gaps[n-1].key.Load())
			t.gaps[j].depth.Store(t.gaps[n-1].depth.Load())
			t.gapN.Store(int32(n - 1))
			return
		}
	}
}

// publishGaps lists all gaps in t, or marks them too many.
func (ts *tierState) publishGaps(t *table) {
	if len(ts.gaps) > maxGaps {
		t.gapN.Store(-1)
		return
	}
	n := 0
	for k, d := range ts.gaps {
		t.gaps[n].key.Store(k)
		t.gaps[n].depth.Store(d)
		n++
	}
	t.gapN.Store(int32(n))
}

// addGroup marks group g held in slot i (key k), reporting whether the slot
// became held.
func (ts *tierState) addGroup(t *table, i int, k uint64, g int) bool {
	m := t.slots[i].loadMeta()
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
	m := t.slots[i].loadMeta()
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
	if t.slots[i].loadMeta()&metaExtGroup != 0 {
		delete(ts.ext, k)
	}
	return ts.setGroups(t, i, 0) < 0
}

// publish makes the writer's counts visible to readers.
func (hs *holderState) publish() {
	for _, ts := range hs.tierList() {
		if ts.held.Load() != ts.live {
			ts.held.Store(ts.live)
		}
	}
	for l := range hs.laneLive {
		if hs.laneHeld[l].Load() != hs.laneLive[l] {
			hs.laneHeld[l].Store(hs.laneLive[l])
		}
	}
}

func (hs *holderState) push(ti int, i int) {
	hs.fifoTier = append(hs.fifoTier, uint8(ti))
	hs.fifoSlot = append(hs.fifoSlot, uint32(i))
	hs.queued++
}

// pushLayer queues the holding of layer entry e in lane, in the run of the
// entry before it when the last item is that run. ly.mu is held.
func (hs *holderState) pushLayer(ly *layer, e int, lane int) {
	ly.at(uint32(e)).refs++
	hs.queued++
	var w fifoWriter
	w.tier, w.slot, w.w, w.floor = hs.fifoTier, hs.fifoSlot, len(hs.fifoSlot), hs.head
	w.putLayer(uint32(e), lane)
	hs.fifoTier, hs.fifoSlot = w.tier[:w.w], w.slot[:w.w]
}

// fifoWriter writes FIFO items at w, merging layer entries into runs with
// the items from floor on; w never passes the item being read when it
// rewrites a FIFO in place.
type fifoWriter struct {
	tier     []uint8
	slot     []uint32
	w, floor int
}

func (f *fifoWriter) put(t uint8, s uint32) {
	if f.w < len(f.tier) {
		f.tier[f.w], f.slot[f.w] = t, s
	} else {
		f.tier, f.slot = append(f.tier[:f.w], t), append(f.slot[:f.w], s)
	}
	f.w++
}

func (f *fifoWriter) putLayer(e uint32, lane int) {
	if n := f.w; n > f.floor {
		switch t := f.tier[n-1]; {
		case t == fifoRunLen && n-2 >= f.floor:
			ln := f.slot[n-1]
			if int(ln>>runLaneShift) == lane && f.slot[n-2]+ln&runMax == e && ln&runMax < runMax {
				f.slot[n-1]++
				return
			}
		case t == fifoLayer+uint8(lane) && f.slot[n-1]+1 == e:
			f.tier[n-1] = fifoRun
			f.put(fifoRunLen, uint32(lane)<<runLaneShift|2)
			return
		}
	}
	f.put(fifoLayer+uint8(lane), e)
}

// runAt decodes the run whose first item is at r.
func (hs *holderState) runAt(r int) (first uint32, lane int, n uint32) {
	ln := hs.fifoSlot[r+1]
	return hs.fifoSlot[r], int(ln >> runLaneShift), ln & runMax
}

// evict drops up to n of the oldest holdings and returns how many it dropped.
func (hs *holderState) evict(n int64) int64 {
	tiers := hs.tierList()
	var done int64
	if len(tiers) == 1 {
		ahead := hs.fifoSlot[hs.head:min(len(hs.fifoSlot), hs.head+int(min(n, 64)))]
		hs.sink += tiers[0].tab.Load().prefetchSlots(ahead)
	}
	// The layer's mutex is taken at the first layer entry met, and let go
	// before compacting, which takes it itself.
	var ly *layer
	lock := func() *layer {
		if ly == nil {
			ly = hs.ms.layer
			ly.mu.Lock()
		}
		return ly
	}
	for done < n && hs.head < len(hs.fifoSlot) {
		ti, i := hs.fifoTier[hs.head], hs.fifoSlot[hs.head]
		switch {
		case ti < fifoLayer:
			hs.head++
			hs.queued--
			ts := tiers[ti]
			t := ts.tab.Load()
			m := t.slots[i].loadMeta()
			switch {
			case held(m):
				if ts.drop(t, int(i), t.slots[i].loadKey()) {
					done++
				}
			case m&metaMigrated != 0 && hs.lid.Load() != 0:
				if hs.dropMigrated(lock(), ts.name, t.slots[i].loadKey()) {
					done++
				}
			}
		case ti == fifoRun:
			ly := lock()
			e, lane, cnt := hs.runAt(hs.head)
			for cnt > 0 && done < n {
				if hs.dropIfHeld(ly, e, lane) {
					done++
				}
				ly.release(e)
				e, cnt = e+1, cnt-1
				hs.queued--
			}
			if cnt == 0 {
				hs.head += 2
			} else {
				hs.fifoSlot[hs.head], hs.fifoSlot[hs.head+1] = e, uint32(lane)<<runLaneShift|cnt
			}
		default:
			ly := lock()
			hs.head++
			hs.queued--
			if hs.dropIfHeld(ly, i, int(ti-fifoLayer)) {
				done++
			}
			ly.release(i)
		}
	}
	hs.live.Add(-done)
	if ly != nil {
		ly.mu.Unlock()
	}
	hs.maybeCompact()
	return done
}

// maybeCompact drops FIFO entries of removed blocks once they outnumber the
// live ones, and the consumed front once it outgrows the rest, so the FIFO
// stays proportional to what the holder holds.
func (hs *holderState) maybeCompact() {
	if hs.queued >= 1024 && int64(hs.queued) >= 2*hs.live.Load() {
		hs.compact()
		return
	}
	pending := len(hs.fifoSlot) - hs.head
	if hs.head >= 1024 && hs.head >= pending {
		n := copy(hs.fifoSlot, hs.fifoSlot[hs.head:])
		copy(hs.fifoTier, hs.fifoTier[hs.head:])
		hs.fifoSlot, hs.fifoTier, hs.head = hs.fifoSlot[:n], hs.fifoTier[:n], 0
	}
}

// compact rewrites the FIFO keeping, for every holding, its newest entry.
func (hs *holderState) compact() {
	if hs.lid.Load() != 0 {
		ly := hs.ms.layer
		ly.mu.Lock()
		hs.compactLayered(ly)
		ly.mu.Unlock()
		return
	}
	tiers := hs.tierList()
	seen := make([][]uint64, len(tiers))
	for ti, ts := range tiers {
		seen[ti] = make([]uint64, (len(ts.tab.Load().slots)+63)/64)
	}
	w := len(hs.fifoSlot)
	for r := len(hs.fifoSlot) - 1; r >= hs.head; r-- {
		ti, i := int(hs.fifoTier[r]), hs.fifoSlot[r]
		t := tiers[ti].tab.Load()
		if !held(t.slots[i].loadMeta()) || seen[ti][i/64]&(1<<(i%64)) != 0 {
			continue
		}
		seen[ti][i/64] |= 1 << (i % 64)
		w--
		hs.fifoTier[w], hs.fifoSlot[w] = uint8(ti), i
	}
	n := copy(hs.fifoSlot, hs.fifoSlot[w:])
	copy(hs.fifoTier, hs.fifoTier[w:])
	hs.fifoSlot, hs.fifoTier, hs.head = hs.fifoSlot[:n], hs.fifoTier[:n], 0
	hs.queued = n
}

// compactLayered is compact for a holder with layer holdings. ly.mu is held.
func (hs *holderState) compactLayered(ly *layer) {
	tiers := hs.tierList()
	id := hs.lid.Load() - 1
	seen := make([][]uint64, len(tiers))
	for ti, ts := range tiers {
		seen[ti] = make([]uint64, (len(ts.tab.Load().slots)+63)/64)
	}
	seenLayer := make(map[uint64]bool)
	type item struct {
		tier uint8
		slot uint32
	}
	var kept []item // newest first
	keepLayer := func(e uint32, lane int) {
		k := layerGroupKey(e, lane)
		if en := ly.at(e); en.lanes[lane].has(id) && !seenLayer[k] {
			seenLayer[k] = true
			kept = append(kept, item{fifoLayer + uint8(lane), e})
		}
	}
	for r := len(hs.fifoSlot) - 1; r >= hs.head; r-- {
		ti, i := hs.fifoTier[r], hs.fifoSlot[r]
		switch {
		case ti < fifoLayer:
			t := tiers[ti].tab.Load()
			m := t.slots[i].loadMeta()
			if seen[ti][i/64]&(1<<(i%64)) != 0 {
				continue
			}
			switch {
			case held(m):
			case m&metaMigrated != 0:
				// Kept while its layer holding is, as the holding's entry.
				lane := ly.laneOf(tiers[ti].name)
				en, e := ly.find(t.slots[i].loadKey())
				if lane < 0 || en == nil || !en.lanes[lane].has(id) || seenLayer[layerGroupKey(uint32(e), lane)] {
					continue
				}
				seenLayer[layerGroupKey(uint32(e), lane)] = true
			default:
				continue
			}
			seen[ti][i/64] |= 1 << (i % 64)
			kept = append(kept, item{ti, i})
		case ti == fifoRunLen:
			e, lane, cnt := hs.runAt(r - 1)
			for x := cnt; x > 0; x-- {
				keepLayer(e+x-1, lane)
				ly.release(e + x - 1)
			}
			r--
		default:
			keepLayer(i, int(ti-fifoLayer))
			ly.release(i)
		}
	}
	f := fifoWriter{tier: hs.fifoTier[:0], slot: hs.fifoSlot[:0]}
	for x := len(kept) - 1; x >= 0; x-- {
		it := kept[x]
		if it.tier < fifoLayer {
			f.put(it.tier, it.slot)
			continue
		}
		ly.at(it.slot).refs++
		f.putLayer(it.slot, int(it.tier-fifoLayer))
	}
	hs.fifoTier, hs.fifoSlot, hs.head = f.tier[:f.w], f.slot[:f.w], 0
	hs.queued = len(kept)
	hs.shrinkFIFO()
}

// dropTiers removes the FIFO entries of the tiers marked gone and of the
// layer lanes marked goneLane, dropping the layer holdings they name (the
// caller drops the tables'), and returns how many it dropped; every layer
// holding has a FIFO entry. ly.mu is held when the holder has layer
// holdings.
func (hs *holderState) dropTiers(gone []bool, goneLane *[layerLanes]bool) int64 {
	ly := hs.ms.layer
	tiers := hs.tierList()
	layered := hs.lid.Load() != 0
	var n int64
	w, queued := 0, 0
	for r := hs.head; r < len(hs.fifoSlot); r++ {
		t, s := hs.fifoTier[r], hs.fifoSlot[r]
		switch {
		case t < fifoLayer:
			if gone[t] {
				tab := tiers[t].tab.Load()
				if layered && tab.slots[s].loadMeta()&metaMigrated != 0 && hs.dropMigrated(ly, tiers[t].name, tab.slots[s].loadKey()) {
					n++
				}
				continue
			}
			queued++
		case t == fifoRun:
			e, lane, cnt := hs.runAt(r)
			if goneLane[lane] {
				for x := range cnt {
					if hs.dropIfHeld(ly, e+x, lane) {
						n++
					}
					ly.release(e + x)
				}
				r++
				continue
			}
			queued += int(cnt)
			hs.fifoTier[w], hs.fifoSlot[w] = t, s
			w++
			r++
			t, s = hs.fifoTier[r], hs.fifoSlot[r]
		default:
			if lane := int(t - fifoLayer); goneLane[lane] {
				if hs.dropIfHeld(ly, s, lane) {
					n++
				}
				ly.release(s)
				continue
			}
			queued++
		}
		hs.fifoTier[w], hs.fifoSlot[w] = t, s
		w++
	}
	hs.fifoSlot, hs.fifoTier, hs.head = hs.fifoSlot[:w], hs.fifoTier[:w], 0
	hs.queued = queued
	return n
}

// ancestors marks with 1 the unheld ancestors of held slots in t (gaps and
// the chains above them), the unheld slots a rebuild or a snapshot keeps.
// It returns the marks, in marks[:0] grown and cleared, and their number.
func (ts *tierState) ancestors(t *table, marks []uint32) ([]uint32, int) {
	marks = slices.Grow(marks[:0], len(t.slots))[:len(t.slots)]
	clear(marks)
	n := 0
	for k := range ts.gaps {
		for j := t.find(k); j >= 0 && marks[j] == 0 && !held(t.slots[j].loadMeta()); j = parentOf(t.slots[j].loadMeta()) {
			marks[j] = 1
			n++
		}
	}
	return marks, n
}

// remapPool holds rehash's slot maps. Under churn a holder rebuilds its
// table every few thousand stores; a fresh map each time was a fifth of the
// writer's garbage, and garbage is what brings the GC cycles that slow
// concurrent lookups. A pool rather than a per-holder buffer, which would
// cost 4 bytes per slot of every holder.
// Maps past maxPooledRemap slots (256 KiB) are left to the GC, so that the
// pool does not keep a big table's map alive for a GC cycle or two after
// its rebuild.
var remapPool = sync.Pool{New: func() any { return new([]uint32) }}

const maxPooledRemap = 1 << 16

// rehash rebuilds tier ti's table with room for extra more slots, dropping
// slots that are neither held nor an ancestor of a held slot, and publishes
// it. Readers still on the old table see it as it was: it is not written
// again. Slots whose holdings moved to the layer are dropped, and their
// FIFO entries become the layer's; locked says whether the caller holds
// the layer's mutex.
func (hs *holderState) rehash(ti int, extra int, locked bool) *table {
	ts := hs.tierList()[ti]
	old := ts.tab.Load()
	// remap[i] becomes slot i's new index + 1; first it marks the unheld
	// slots to keep with 1.
	rp := remapPool.Get().(*[]uint32)
	remap, kept := ts.ancestors(old, *rp)
	defer func() {
		if cap(remap) <= maxPooledRemap {
			*rp = remap
			remapPool.Put(rp)
		}
	}()
	kept += int(ts.live)
	size := tableSizeFor(kept + extra)
	if size <= len(old.slots) {
		// Removals, not growth, filled the table: a holder at its steady
		// state. Leave more room so that rebuilds come less often.
		size = max(size, (kept+extra)*loadDen/churnNum+1)
	}
	// nt is private until published: plain writes. Parents keep their old
	// index until every slot has its new one.
	nt := newTable(size)
	dropped := hs.dropped[:0]
	for i := range old.slots {
		m := old.slots[i].loadMeta()
		if !held(m) && remap[i] == 0 {
			if m != 0 && depthOf(m) == 0 {
				dropped = append(dropped, old.slots[i].key)
			}
			continue
		}
		k := old.slots[i].loadKey()
		j := nt.home(k)
		for nt.slots[j].meta != 0 {
			j = nt.next(j)
		}
		nt.slots[j].key = k
		nt.slots[j].meta = m
		remap[i] = uint32(j) + 1
	}
	nt.used = kept
	migrated := ts.migrated
	ts.migrated = 0
	for j := range nt.slots {
		m := nt.slots[j].meta
		if p := parentOf(m); p >= 0 {
			nt.slots[j].meta = m&^(metaParentMask<<metaParentShift) | uint64(remap[p])<<metaParentShift
		}
		if m&metaMigrated != 0 {
			ts.migrated++
		}
	}
	ts.migratedKept = ts.migrated
	ts.publishGaps(nt)
	nt.epoch.Store(old.epoch.Load())
	ts.tab.Store(nt)
	for _, k := range dropped {
		hs.rootDropped(ti, k)
	}
	hs.dropped = dropped[:0]
	if migrated == ts.migrated {
		hs.remapFIFO(ti, remap, nil, nil)
		return nt
	}
	ly := hs.ms.layer
	if !locked {
		ly.mu.Lock()
		defer ly.mu.Unlock()
	}
	hs.remapFIFO(ti, remap, old, ly)
	return nt
}

// remapFIFO translates the FIFO entries of tier ti to a rebuilt table,
// dropping those of slots the rebuild dropped. With ly (locked), an entry
// of a dropped slot of old whose holding moved to the layer becomes the
// layer entry's, in place.
func (hs *holderState) remapFIFO(ti int, remap []uint32, old *table, ly *layer) {
	f := fifoWriter{tier: hs.fifoTier, slot: hs.fifoSlot}
	queued := 0
	lane := -1
	if ly != nil {
		lane = ly.laneOf(hs.tierList()[ti].name)
	}
	id := hs.lid.Load() - 1
	for r := hs.head; r < len(hs.fifoSlot); r++ {
		t, i := hs.fifoTier[r], hs.fifoSlot[r]
		switch {
		case int(t) == ti && remap[i] != 0:
			i = remap[i] - 1
		case int(t) == ti:
			if ly == nil || lane < 0 || old.slots[i].meta&metaMigrated == 0 {
				continue
			}
			en, e := ly.find(old.slots[i].key)
			if en == nil || !en.lanes[lane].has(id) {
				continue
			}
			en.refs++
			f.putLayer(uint32(e), lane)
			queued++
			continue
		case t == fifoRun:
			_, _, cnt := hs.runAt(r)
			f.put(t, i)
			r++
			t, i = hs.fifoTier[r], hs.fifoSlot[r]
			queued += int(cnt) - 1
		}
		f.put(t, i)
		queued++
	}
	hs.fifoSlot, hs.fifoTier, hs.head = f.slot[:f.w], f.tier[:f.w], 0
	hs.queued = queued
	hs.shrinkFIFO()
}

// shrinkFIFO gives back the room of a FIFO whose entries became runs of
// layer entries.
func (hs *holderState) shrinkFIFO() {
	if n := len(hs.fifoSlot); cap(hs.fifoSlot) > 4*n+1024 {
		hs.fifoSlot = append(make([]uint32, 0, n+n/4), hs.fifoSlot...)
		hs.fifoTier = append(make([]uint8, 0, n+n/4), hs.fifoTier...)
	}
}
