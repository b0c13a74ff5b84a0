package index

import "slices"

// This file holds the writers' side of the layer (layer.go): which blocks
// a store puts there, how holdings move there from holders' tables, and a
// holder's layer holdings as its eviction queue and groups see them.

// layerGroupKey keys a layer holding in holderState.laneGroups.
func layerGroupKey(e uint32, lane int) uint64 { return uint64(e)<<1 | uint64(lane) }

// dropIfHeld drops hs's holding of entry e in lane, reporting whether it
// had one. ly.mu is held.
func (hs *holderState) dropIfHeld(ly *layer, e uint32, lane int) bool {
	id := hs.lid.Load() - 1
	if !ly.at(e).lanes[lane].has(id) {
		return false
	}
	hs.dropLayer(ly, e, lane, id)
	return true
}

func (hs *holderState) dropLayer(ly *layer, e uint32, lane int, id uint32) {
	ly.dropHolder(int(e), lane, id)
	if hs.laneGroups != nil {
		delete(hs.laneGroups, layerGroupKey(e, lane))
	}
	hs.laneLive[lane]--
}

// dropMigrated drops hs's layer holding of key in tier, which a table slot
// of hs moved there, reporting whether it had one. ly.mu is held.
func (hs *holderState) dropMigrated(ly *layer, tier string, key uint64) bool {
	lane := ly.laneOf(tier)
	if lane < 0 {
		return false
	}
	en, e := ly.find(key)
	if en == nil {
		return false
	}
	return hs.dropIfHeld(ly, uint32(e), lane)
}

// addLaneGroup records that hs holds entry e in lane for group g too.
func (hs *holderState) addLaneGroup(e int, lane int, g int) {
	k := layerGroupKey(uint32(e), lane)
	gs, ok := hs.laneGroups[k]
	if !ok {
		if g == 0 {
			return
		}
		gs = []int{0}
	}
	if slices.Contains(gs, g) {
		return
	}
	if hs.laneGroups == nil {
		hs.laneGroups = make(map[uint64][]int)
	}
	hs.laneGroups[k] = append(gs, g)
}

// removeLaneGroup drops group g of hs's holding of entry e in lane, and the
// holding with its last group, reporting whether the holding went.
func (hs *holderState) removeLaneGroup(ly *layer, e int, lane int, g int) bool {
	k := layerGroupKey(uint32(e), lane)
	gs, ok := hs.laneGroups[k]
	if !ok {
		if g != 0 {
			return false
		}
		hs.dropLayer(ly, uint32(e), lane, hs.lid.Load()-1)
		return true
	}
	i := slices.Index(gs, g)
	if i < 0 {
		return false
	}
	gs = slices.Delete(gs, i, i+1)
	if len(gs) > 0 {
		hs.laneGroups[k] = gs
		if len(gs) == 1 && gs[0] == 0 {
			delete(hs.laneGroups, k)
		}
		return false
	}
	hs.dropLayer(ly, uint32(e), lane, hs.lid.Load()-1)
	return true
}

// sharers appends to ly.hits the holders other than hs whose table for
// tier holds key, the holders a promotion of key moves to the layer. It
// asks the holders that start a chain at key when root (a store of key
// without a parent), else the layer holders of entry parent, stopping
// when they are clearly too few.
func (ix *Index) sharers(ly *layer, hs *holderState, tier string, key uint64, root bool, parent int) []*holderState {
	hits := ly.hits[:0]
	check := func(x *holderState) bool {
		if x == hs || x.dead {
			return false
		}
		_, ts := x.tier(tier, false)
		return ts != nil && held(ts.tab.Load().get(key))
	}
	switch {
	case ix.share <= 1:
	case root:
		for _, x := range hs.ms.rootHolders(key) {
			if check(x) {
				hits = append(hits, x)
			}
		}
	case parent >= 0:
		lane := ly.laneOf(tier)
		if lane < 0 {
			break
		}
		ly.ids = ly.at(uint32(parent)).lanes[lane].appendIDs(ly.ids[:0])
		misses := 0
		for _, id := range ly.ids {
			x := ly.holderAt(id)
			if x == nil {
				continue
			}
			if check(x) {
				hits = append(hits, x)
			} else if misses++; misses > len(hits)+8 && len(hits) < ix.share-1 {
				break
			}
		}
	}
	ly.hits = hits
	return hits
}

// migrate moves the table holdings of key in tier of holders to entry e's
// lane, with their groups, keeping each one's place in its holder's FIFO:
// its slot is marked metaMigrated, and a rebuild, forced once migrated
// slots are most of the table, turns the FIFO entry into the layer
// entry's. A holder busy writing keeps its table holding. ly.mu is held.
func (ly *layer) migrate(holders []*holderState, tier string, key uint64, e int, lane int) {
	for _, x := range holders {
		if !x.mu.TryLock() {
			continue
		}
		ti, ts := x.tier(tier, false)
		if x.dead || ts == nil {
			x.mu.Unlock()
			continue
		}
		t := ts.tab.Load()
		i := t.find(key)
		m := uint64(0)
		if i >= 0 {
			m = t.slots[i].loadMeta()
		}
		if !held(m) {
			x.mu.Unlock()
			continue
		}
		var gs []int
		for g := range 7 {
			if m&(1<<g) != 0 {
				gs = append(gs, g)
			}
		}
		if m&metaExtGroup != 0 {
			gs = append(gs, ts.ext[key]...)
		}
		leaf := ts.children(t, i, m) == 0
		ly.addHolder(e, lane, ly.idOf(x))
		if len(gs) != 1 || gs[0] != 0 {
			if x.laneGroups == nil {
				x.laneGroups = make(map[uint64][]int)
			}
			x.laneGroups[layerGroupKey(uint32(e), lane)] = gs
		}
		ts.drop(t, i, key)
		t.slots[i].storeMeta(t.slots[i].loadMeta() | metaMigrated)
		ts.migrated++
		x.laneLive[lane]++
		// Rebuilt once moved slots are most of the table. A rebuild keeps
		// those that are ancestors of slots still held, so the next one
		// waits for twice as many, or for 1,024 more and a moved block
		// that ends its chain (the chain above it may now go): rebuilds
		// stay a bounded cost per move.
		if ts.migrated >= 1024 && 2*ts.migrated >= t.used &&
			(ts.migrated >= 2*ts.migratedKept || leaf && ts.migrated >= ts.migratedKept+1024) {
			x.rehash(ti, 0, true)
		}
		x.publish()
		x.mu.Unlock()
	}
}

// storeShared is Store while the model's layer has entries, or when
// keys[0] may start one: each block goes to the layer when it is there (or
// enough holders hold it to put it there) and b is for group 0, else to
// hs's table for tier ti, ts. hs is locked. It returns the holdings added.
//
// The layer's mutex is held only across blocks that may be shared: blocks
// the layer has, and those a store may put there (see mayShare). The rest,
// such as a holder's own blocks after a shared prefix, go to the table
// without it, so that the model's other writers proceed meanwhile. What
// they read of the layer without the mutex is hs's own holdings, which
// change only under hs's mutex; an entry another writer creates for one of
// them meanwhile finds hs busy and leaves its table holding, as migrate
// does for any holder busy writing.
func (ix *Index) storeShared(b Blocks, hs *holderState, ti int, ts *tierState) int64 {
	keys, group := b.Keys, b.Group
	t := ts.tab.Load()
	if !t.fits(2*len(keys) + 1) {
		t = hs.rehash(ti, 2*len(keys)+1, false)
	}
	ly := hs.ms.layer
	locked := false
	defer func() {
		if locked {
			ly.mu.Unlock()
		}
	}()
	bit := groupBit(group)
	lane := ly.laneOf(ts.name)
	var added int64
	// The block before the next one: its key, its slot in t (-2 until
	// looked up, -1 none) and its layer entry (-2 until looked up, -1 none).
	pkey, hasParent := b.Parent.Key()
	pslot, pentry := -2, -2
	for i, k := range keys {
		if hasParent && pentry == -2 {
			_, pentry = ly.find(pkey)
		}
		en, e := ly.find(k)
		if en != nil && lane >= 0 {
			if v := hs.lid.Load(); v != 0 && en.lanes[lane].has(v-1) {
				hs.addLaneGroup(e, lane, group)
				pkey, hasParent, pslot, pentry = k, true, -2, e
				continue
			}
		}
		si, found := t.probe(k)
		toLayer := false
		root := i == 0 && !hasParent
		if bit == 1 && !(found && held(t.slots[si].loadMeta())) && (en != nil || ix.mayShare(hs, k, root, pentry)) {
			if !locked {
				ly.mu.Lock()
				locked = true
				// What was found without the mutex may have been freed
				// or created since.
				en, e = ly.find(k)
				if hasParent {
					_, pentry = ly.find(pkey)
				}
				lane = ly.laneOf(ts.name)
			}
			switch {
			case en != nil:
				toLayer = lane >= 0
			case ix.share > 0:
				hits := ix.sharers(ly, hs, ts.name, k, root, pentry)
				if len(hits) < ix.share-1 {
					break
				}
				if lane < 0 {
					lane = ly.laneFor(ts.name)
				}
				if lane >= 0 {
					e = ly.create(k, pentry)
					ly.migrate(hits, ts.name, k, e, lane)
					toLayer = true
				}
			}
		}
		if toLayer {
			ly.addHolder(e, lane, ly.idOf(hs))
			hs.pushLayer(ly, e, lane)
			hs.laneLive[lane]++
			added++
			pkey, hasParent, pslot, pentry = k, true, -2, e
			continue
		}
		if locked {
			ly.mu.Unlock()
			locked = false
		}
		if pslot == -2 {
			pslot = -1
			if hasParent {
				if pslot = t.find(pkey); pslot < 0 {
					pslot = t.insert(pkey, 0)
					hs.rootAdded(ti, pkey)
				}
			}
			si, _ = t.probe(k)
		}
		var ok bool
		pslot, ok = hs.storeSlot(t, ts, ti, pslot, si, k, group)
		if ok {
			added++
		}
		pkey, hasParent, pentry = k, true, e
	}
	return added
}

// mayShare reports whether a store may put key, not in the layer, there:
// whether sharers may find enough holders of it. It asks sharers' sources
// without the layer's mutex, so a holder that starts a chain at key or an
// entry pentry (the block before key's, -1 for none) created meanwhile may
// be missed: a later store of key finds them.
func (ix *Index) mayShare(hs *holderState, key uint64, root bool, pentry int) bool {
	switch {
	case ix.share <= 0:
		return false
	case ix.share == 1:
		return true
	case root:
		return len(hs.ms.rootHolders(key)) >= ix.share-1
	default:
		return pentry >= 0
	}
}
