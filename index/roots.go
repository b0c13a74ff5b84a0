package index

import (
	"slices"
	"sync/atomic"
)

// Roots are the block-major part of the index: per model, for every block
// key that starts a chain in some holder's table (a slot at depth 0: a
// block stored without a parent, or a parent a store named but the holder
// never reported), the holders whose tables start a chain there. A holder
// with a non-empty prefix of a prompt holds its first block, which has no
// parent, so at depth 0: the holders listed under the prompt's first key
// are the only ones a lookup needs to search, however many the model has.
//
// A holder is listed under k exactly while one of its tiers has a depth-0
// slot for k. Slots keep their depth for their life, so the list changes
// only when such a slot is created (Store, LoadFile) or dropped (a rebuild,
// ClearHolder, RemoveHolder): per chain, not per block.

// rootSet lists the holders under one key. Readers load the slice without
// a lock. The writer, under modelState.rootMu, appends in place past the
// length readers see, so that a key thousands of holders share (a system
// prompt) costs an amortised O(1) per holder, and copies on removal, so
// that no element a reader may see is ever overwritten.
type rootSet struct {
	holders atomic.Pointer[[]*holderState]
}

// startsChain reports whether a tier of hs other than skip has a depth-0
// slot for k. Writer only (hs is locked).
func (hs *holderState) startsChain(k uint64, skip int) bool {
	for ti, ts := range hs.tierList() {
		if ti == skip {
			continue
		}
		if m := ts.tab.Load().get(k); m != 0 && depthOf(m) == 0 {
			return true
		}
	}
	return false
}

// rootAdded records that tier ti of hs now has a depth-0 slot for k (ti
// -1: hs is known not to be listed under k yet).
func (hs *holderState) rootAdded(ti int, k uint64) {
	if ti >= 0 && hs.startsChain(k, ti) {
		return
	}
	ms := hs.ms
	ms.rootMu.Lock()
	defer ms.rootMu.Unlock()
	rs, ok := ms.roots.Load(k)
	if !ok {
		rs = &rootSet{}
		list := []*holderState{hs}
		rs.holders.Store(&list)
		ms.roots.Store(k, rs)
		return
	}
	next := append(*rs.holders.Load(), hs)
	rs.holders.Store(&next)
}

// rootDropped records that tier ti of hs no longer has a slot for k, which
// was at depth 0 (ti -1: no tier of hs is to be counted).
func (hs *holderState) rootDropped(ti int, k uint64) {
	if ti >= 0 && hs.startsChain(k, ti) {
		return
	}
	ms := hs.ms
	ms.rootMu.Lock()
	defer ms.rootMu.Unlock()
	ms.unlistRoot(k, hs)
}

// unlistRoot removes hs from k's list. ms.rootMu is held.
func (ms *modelState) unlistRoot(k uint64, hs *holderState) {
	rs, ok := ms.roots.Load(k)
	if !ok {
		return
	}
	list := *rs.holders.Load()
	for i, x := range list {
		if x != hs {
			continue
		}
		if len(list) == 1 {
			ms.roots.Delete(k)
			return
		}
		next := make([]*holderState, 0, len(list)-1)
		next = append(append(next, list[:i]...), list[i+1:]...)
		rs.holders.Store(&next)
		return
	}
}

// dropRoots removes hs from the list of every depth-0 slot of the tables
// of the tiers marked gone, unless hs still starts a chain there in a
// published table; with forget, regardless (RemoveHolder).
func (hs *holderState) dropRoots(tabs []*table, gone []bool, forget bool) {
	ms := hs.ms
	ms.rootMu.Lock()
	defer ms.rootMu.Unlock()
	for ti, t := range tabs {
		if t == nil || !gone[ti] {
			continue
		}
		for i := range t.slots {
			m := t.slots[i].loadMeta()
			if m == 0 || depthOf(m) != 0 {
				continue
			}
			k := t.slots[i].loadKey()
			if forget || !hs.startsChain(k, -1) {
				ms.unlistRoot(k, hs)
			}
		}
	}
}

// rootHolders returns the holders of ms whose tables start a chain at k.
func (ms *modelState) rootHolders(k uint64) []*holderState {
	if rs, ok := ms.roots.Load(k); ok {
		return *rs.holders.Load()
	}
	return nil
}

// listRoots lists hs under the key of each of its depth-0 slots: a holder
// built whole, by LoadFile.
func (hs *holderState) listRoots() {
	tiers := hs.tierList()
	for ti, ts := range tiers {
		t := ts.tab.Load()
		for i := range t.slots {
			m := t.slots[i].meta
			if m == 0 || depthOf(m) != 0 {
				continue
			}
			k := t.slots[i].key
			// Listed already for an earlier tier?
			if !slices.ContainsFunc(tiers[:ti], func(o *tierState) bool {
				om := o.tab.Load().get(k)
				return om != 0 && depthOf(om) == 0
			}) {
				hs.rootAdded(-1, k)
			}
		}
	}
}
