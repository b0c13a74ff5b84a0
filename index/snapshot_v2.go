package index

import "slices"

// Formats 1 and 2 kept a holder's blocks per tier as the slots of its
// table (key, groups, depth, the slot of its parent) and its eviction
// order as entries naming a slot or, from format 2, a block kept once for
// many holders (by key, parent and groups). Both load: the slots and
// entries are checked as that index checked them, and the eviction order
// becomes the holder's holdings in order.
const (
	v2Shared      = 0xFF // opens an eviction-order entry of a shared block
	v2ExtGroup    = 0x80 // a slot's groups bit for groups beyond 0-6, listed after it
	v2DepthMax    = 0xFFFF
	v2GroupsInBit = 7
)

type v2Slot struct {
	key    uint64
	groups []int
	held   bool
}

// savedHolderV2 reads a holder of format 1 or 2.
func (d *decoder) savedHolderV2() savedHolder {
	sh := savedHolder{h: d.holder()}
	nt := d.count(2)
	if nt > maxTiers {
		d.fail("holder %v has %d tiers", sh.h, nt)
		return sh
	}
	slots := make([][]v2Slot, 0, nt)
	for range nt {
		name := d.str()
		if name == "" {
			d.fail("holder %v has an unnamed tier", sh.h)
		}
		for _, t := range sh.tiers {
			if t == name {
				d.fail("holder %v has tier %q twice", sh.h, name)
			}
		}
		if d.err != nil {
			return sh
		}
		sh.tiers = append(sh.tiers, name)
		slots = append(slots, d.v2Slots(sh.h, name))
	}
	seen := make([][]bool, len(slots))
	heldKeys := make([]map[uint64]bool, len(slots))
	live := 0
	for ti := range slots {
		seen[ti] = make([]bool, len(slots[ti]))
		heldKeys[ti] = make(map[uint64]bool)
		for _, s := range slots[ti] {
			if s.held {
				heldKeys[ti][s.key] = true
				live++
			}
		}
	}
	type sharedKey struct {
		tier int
		key  uint64
	}
	seenShared := make(map[sharedKey]bool)
	for range d.count(2) {
		ti := int(d.byte())
		if ti == v2Shared && d.version >= 2 {
			hd := savedHolding{tier: int(d.byte()), key: d.u64()}
			if d.byte() != 0 {
				d.u64() // the parent: the index keeps blocks by key alone
			}
			hd.groups = d.groups(sh.h, false)
			if d.err != nil {
				return sh
			}
			k := sharedKey{hd.tier, hd.key}
			if hd.tier >= len(slots) || seenShared[k] || heldKeys[hd.tier][hd.key] {
				d.fail("holder %v: eviction order names a shared block of a missing tier, twice or also unshared", sh.h)
				return sh
			}
			seenShared[k] = true
			sh.holdings = append(sh.holdings, hd)
			live++
			continue
		}
		idx := d.uvarint()
		if d.err != nil {
			return sh
		}
		if ti >= len(slots) || idx >= uint64(len(slots[ti])) {
			d.fail("holder %v: eviction order names a missing block", sh.h)
			return sh
		}
		s := slots[ti][idx]
		if seen[ti][idx] || !s.held {
			d.fail("holder %v: eviction order names a block twice or an unheld one", sh.h)
			return sh
		}
		seen[ti][idx] = true
		sh.holdings = append(sh.holdings, savedHolding{tier: ti, key: s.key, groups: s.groups})
	}
	if len(sh.holdings) != live {
		d.fail("holder %v: eviction order lists %d of %d blocks", sh.h, len(sh.holdings), live)
	}
	for _, t := range sh.tiers {
		if t == TierSpeculative {
			d.fail("holder %v has tier %q", sh.h, t)
		}
	}
	return sh
}

// v2Slots reads one tier's slots, checking keys, anchors and depths.
func (d *decoder) v2Slots(h Holder, tier string) []v2Slot {
	n := d.count(11)
	type raw struct {
		depth, parent int
	}
	slots := make([]v2Slot, 0, n)
	raws := make([]raw, 0, n)
	keys := make(map[uint64]bool, n)
	for i := range n {
		s := v2Slot{key: d.u64()}
		bitsOf := d.byte()
		r := raw{depth: int(d.uvarint()), parent: int(min(d.uvarint(), uint64(n)+1)) - 1}
		for g := range v2GroupsInBit {
			if bitsOf&(1<<g) != 0 {
				s.groups = append(s.groups, g)
			}
		}
		if bitsOf&v2ExtGroup != 0 {
			ext := d.groups(h, false)
			if len(ext) == 0 {
				d.fail("holder %v tier %q: group list missing", h, tier)
			}
			for _, g := range ext {
				if g >= 0 && g < v2GroupsInBit {
					d.fail("holder %v tier %q: bad group %d", h, tier, g)
				}
			}
			// The old index kept negative groups with the others.
			s.groups = append(s.groups, ext...)
			slices.Sort(s.groups)
		}
		s.held = len(s.groups) > 0
		if len(s.groups) == 1 && s.groups[0] == 0 {
			s.groups = nil
		}
		switch {
		case r.parent < -1 || r.parent >= n || r.parent == i:
			d.fail("holder %v tier %q: bad anchor", h, tier)
		case keys[s.key]:
			d.fail("tier %q: key %#x twice", tier, s.key)
		}
		if d.err != nil {
			return nil
		}
		keys[s.key] = true
		slots = append(slots, s)
		raws = append(raws, r)
	}
	for _, r := range raws {
		want := 0
		if r.parent >= 0 {
			want = min(raws[r.parent].depth+1, v2DepthMax)
		}
		if r.depth != want {
			d.fail("tier %q: depth %d, anchor says %d", tier, r.depth, want)
			return nil
		}
	}
	return slots
}
