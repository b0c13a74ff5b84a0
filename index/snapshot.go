package index

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"github.com/puzpuzpuz/xsync/v4"
)

// Snapshot errors. Every error LoadFile returns for a file's content wraps
// ErrBadSnapshot; one from a newer or older format also wraps
// ErrSnapshotVersion.
var (
	ErrBadSnapshot     = errors.New("index: bad snapshot")
	ErrSnapshotVersion = errors.New("index: unsupported snapshot version")
)

// The file is a header, a body and a trailer:
//
//	header   magic "KVSIDX\r\n", version uint32
//	body     capacity overrides, last sequence numbers, then per model, per
//	         holder, per tier: its slots (key, groups, depth, anchor) and
//	         the holder's eviction order, whose entries name a slot, or
//	         (from version 2) a shared block by key, tier, parent key and
//	         groups
//	trailer  body length uint64, CRC-32C of header and body uint32, "KEND"
//
// Integers are little-endian or varints. Children counts and gaps are not
// stored: they follow from the slots and are rebuilt on load.
const (
	snapMagic   = "KVSIDX\r\n"
	snapEnd     = "KEND"
	snapVersion = 2
	// snapShared opens an eviction-order entry of a shared block.
	snapShared      = 0xFF
	snapHeaderSize  = len(snapMagic) + 4
	snapTrailerSize = 8 + 4 + len(snapEnd)
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// SaveFile writes the index and seqs, the last event sequence number applied
// per holder, to path atomically: a temporary file in the same directory,
// synced, then renamed over path. Each holder is saved consistently; read
// seqs before calling SaveFile, so that a replay from them re-applies
// anything the snapshot may already hold (stores and removals are
// idempotent). Readers and other holders' writers proceed meanwhile.
func (ix *Index) SaveFile(path string, seqs map[Holder]uint64) error {
	return ix.save(path, seqs, false)
}

// SaveHolders is SaveFile for the holders that have a sequence number in
// seqs: the others are left out of the file, and kept in the index. A
// service that saves periodically leaves out holders whose entries it no
// longer trusts without dropping them from the index it answers from.
func (ix *Index) SaveHolders(path string, seqs map[Holder]uint64) error {
	return ix.save(path, seqs, true)
}

func (ix *Index) save(path string, seqs map[Holder]uint64, only bool) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("index: save snapshot: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	crc := crc32.New(crcTable)
	bw := bufio.NewWriterSize(f, 1<<20)
	e := &encoder{w: io.MultiWriter(bw, crc)}
	e.raw([]byte(snapMagic))
	e.u32(snapVersion)
	body := e.n
	ix.encode(e, seqs, only)
	if e.err != nil {
		return fmt.Errorf("index: save snapshot: %w", e.err)
	}
	bodyLen := e.n - body
	sum := crc.Sum32()
	e.w = bw
	e.u64(uint64(bodyLen))
	e.u32(sum)
	e.raw([]byte(snapEnd))
	if e.err == nil {
		e.err = bw.Flush()
	}
	if e.err == nil {
		e.err = f.Sync()
	}
	if e.err != nil {
		return fmt.Errorf("index: save snapshot: %w", e.err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("index: save snapshot: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("index: save snapshot: %w", err)
	}
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// encode writes the index; with only, just the holders in seqs.
func (ix *Index) encode(e *encoder, seqs map[Holder]uint64, only bool) {
	caps := xsync.ToPlainMap(ix.caps)
	e.uvarint(uint64(len(caps)))
	for _, h := range sortedHolders(caps) {
		e.holder(h)
		e.varint(caps[h])
	}
	e.uvarint(uint64(len(seqs)))
	for _, h := range sortedHolders(seqs) {
		e.holder(h)
		e.uvarint(seqs[h])
	}
	models := make(map[string]*modelState)
	ix.models.Range(func(name string, ms *modelState) bool {
		models[name] = ms
		return true
	})
	names := make([]string, 0, len(models))
	for name := range models {
		names = append(names, name)
	}
	slices.Sort(names)
	e.uvarint(uint64(len(names)))
	for _, name := range names {
		e.str(name)
		list := *models[name].list.Load()
		if only {
			list = slices.DeleteFunc(slices.Clone(list), func(hs *holderState) bool {
				_, ok := seqs[hs.h]
				return !ok
			})
		}
		e.uvarint(uint64(len(list)))
		for _, hs := range list {
			hs.mu.Lock()
			hs.encode(e)
			hs.mu.Unlock()
		}
	}
}

// encode writes the holder; a holder removed meanwhile is written empty.
func (hs *holderState) encode(e *encoder) {
	e.holder(hs.h)
	all := hs.tierList()
	if hs.dead {
		all = nil
	}
	// A speculative entry is a guess about the next seconds: it is not
	// saved. newTier maps a tier's index to its index in the file, -1 for
	// one left out.
	newTier := make([]int, len(all))
	var tiers []*tierState
	for ti, ts := range all {
		newTier[ti] = -1
		if ts.name != TierSpeculative {
			newTier[ti] = len(tiers)
			tiers = append(tiers, ts)
		}
	}
	e.uvarint(uint64(len(tiers)))
	saved := make([][]uint32, len(all))
	for ti, ts := range all {
		if newTier[ti] < 0 {
			continue
		}
		t := ts.tab.Load()
		marks, _ := ts.ancestors(t, nil)
		// marks become saved indices + 1, for held slots too.
		next := uint32(0)
		for i := range marks {
			if marks[i] != 0 || held(t.slots[i].loadMeta()) {
				next++
				marks[i] = next
			}
		}
		saved[ti] = marks
		e.str(ts.name)
		e.uvarint(uint64(next))
		for i := range t.slots {
			if marks[i] == 0 {
				continue
			}
			s := &t.slots[i]
			m := s.loadMeta()
			e.u64(s.loadKey())
			e.raw([]byte{byte(m & metaGroups)})
			e.uvarint(uint64(depthOf(m)))
			p := parentOf(m)
			if p < 0 {
				e.uvarint(0)
			} else {
				e.uvarint(uint64(marks[p]))
			}
			if m&metaExtGroup != 0 {
				gs := ts.ext[s.loadKey()]
				e.uvarint(uint64(len(gs)))
				for _, g := range gs {
					e.varint(int64(g))
				}
			}
		}
	}
	if hs.dead {
		e.uvarint(0)
		return
	}
	var ly *layer
	if hs.lid.Load() != 0 {
		ly = hs.ms.layer
		ly.mu.Lock()
		defer ly.mu.Unlock()
	}
	// tierOfLane maps a lane to the holder's tier of its name.
	var tierOfLane [layerLanes]int
	for l := range tierOfLane {
		tierOfLane[l] = -1
		for ti, ts := range all {
			if ly != nil && ts.name == ly.laneName(l) {
				tierOfLane[l] = newTier[ti]
			}
		}
	}
	n := 0
	hs.evictionOrder(all, newTier, ly, func(int, uint32, int, int) { n++ })
	e.uvarint(uint64(n))
	hs.evictionOrder(all, newTier, ly, func(ti int, slot uint32, x int, lane int) {
		if x < 0 {
			e.raw([]byte{byte(newTier[ti])})
			e.uvarint(uint64(saved[ti][slot] - 1))
			return
		}
		en := ly.at(uint32(x))
		e.raw([]byte{snapShared, byte(tierOfLane[lane])})
		e.u64(en.key.Load())
		if p := entryParent(en.meta.Load()); p >= 0 {
			e.raw([]byte{1})
			e.u64(ly.at(uint32(p)).key.Load())
		} else {
			e.raw([]byte{0})
		}
		gs := hs.laneGroups[layerGroupKey(uint32(x), lane)]
		e.uvarint(uint64(len(gs)))
		for _, g := range gs {
			e.varint(int64(g))
		}
	})
}

// evictionOrder calls f with each holding of hs in the tiers newTier
// keeps (>= 0), in the order evictions would take them: at the first
// queue entry that names it, from head on. A table holding is f(ti, slot,
// -1, -1), a layer holding f(-1, 0, entry, lane). ly is hs's layer,
// locked, or nil when hs has no layer holdings.
//
// The queue is read, not compacted: compacting keeps a holding's newest
// entry, so a holding removed and stored again, which evictions take at
// its first entry, would move back in the saving index's order.
func (hs *holderState) evictionOrder(all []*tierState, newTier []int, ly *layer, f func(ti int, slot uint32, x int, lane int)) {
	seen := make([][]uint64, len(all))
	for ti, ts := range all {
		if newTier[ti] >= 0 {
			seen[ti] = make([]uint64, (len(ts.tab.Load().slots)+63)/64)
		}
	}
	var id uint32
	var seenLayer map[uint64]bool
	if ly != nil {
		id = hs.lid.Load() - 1
		seenLayer = make(map[uint64]bool)
	}
	layerHolding := func(x uint32, lane int) {
		if k := layerGroupKey(x, lane); !seenLayer[k] && ly.at(x).lanes[lane].has(id) {
			seenLayer[k] = true
			f(-1, 0, int(x), lane)
		}
	}
	for r := hs.head; r < len(hs.fifoSlot); r++ {
		t, i := hs.fifoTier[r], hs.fifoSlot[r]
		switch {
		case t < fifoLayer:
			if newTier[t] < 0 || seen[t][i/64]&(1<<(i%64)) != 0 {
				continue
			}
			tab := all[t].tab.Load()
			switch m := tab.slots[i].loadMeta(); {
			case held(m):
				seen[t][i/64] |= 1 << (i % 64)
				f(int(t), i, -1, -1)
			case m&metaMigrated != 0 && ly != nil:
				// The slot's holding moved to the layer; the entry names
				// the layer holding.
				if lane := ly.laneOf(all[t].name); lane >= 0 {
					if en, x := ly.find(tab.slots[i].loadKey()); en != nil {
						layerHolding(uint32(x), lane)
					}
				}
			}
		case t == fifoRun:
			first, lane, cnt := hs.runAt(r)
			for x := range cnt {
				layerHolding(first+x, lane)
			}
			r++
		default:
			layerHolding(i, int(t-fifoLayer))
		}
	}
}

func sortedHolders[V any](m map[Holder]V) []Holder {
	return slices.SortedFunc(maps.Keys(m), Holder.Compare)
}

type encoder struct {
	w   io.Writer
	n   int
	err error
	buf [binary.MaxVarintLen64]byte
}

func (e *encoder) raw(b []byte) {
	if e.err != nil {
		return
	}
	n, err := e.w.Write(b)
	e.n += n
	e.err = err
}

func (e *encoder) u32(v uint32) { e.raw(binary.LittleEndian.AppendUint32(e.buf[:0], v)) }
func (e *encoder) u64(v uint64) { e.raw(binary.LittleEndian.AppendUint64(e.buf[:0], v)) }
func (e *encoder) uvarint(v uint64) {
	e.raw(binary.AppendUvarint(e.buf[:0], v))
}
func (e *encoder) varint(v int64) { e.raw(binary.AppendVarint(e.buf[:0], v)) }
func (e *encoder) str(s string) {
	e.uvarint(uint64(len(s)))
	e.raw([]byte(s))
}
func (e *encoder) holder(h Holder) {
	e.str(h.Pod)
	e.varint(int64(h.Rank))
}

// LoadFile reads a snapshot written by SaveFile into a new index configured
// by cfg, and returns it with the saved sequence numbers. A file that is
// truncated, corrupt, foreign or of another version yields an error
// wrapping ErrBadSnapshot and no index.
func LoadFile(path string, cfg Config) (*Index, map[Holder]uint64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("index: load snapshot: %w", err)
	}
	ix, seqs, err := load(data, cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("index: load snapshot %s: %w", path, err)
	}
	return ix, seqs, nil
}

func load(data []byte, cfg Config) (*Index, map[Holder]uint64, error) {
	if len(data) < len(snapMagic) || string(data[:len(snapMagic)]) != snapMagic {
		return nil, nil, fmt.Errorf("%w: not an index snapshot", ErrBadSnapshot)
	}
	if len(data) < snapHeaderSize {
		return nil, nil, fmt.Errorf("%w: truncated header", ErrBadSnapshot)
	}
	// Version 1 is version 2 without shared blocks.
	if v := binary.LittleEndian.Uint32(data[len(snapMagic):]); v != 1 && v != snapVersion {
		return nil, nil, fmt.Errorf("%w: %w %d (this build reads 1 and %d)", ErrBadSnapshot, ErrSnapshotVersion, v, snapVersion)
	}
	if len(data) < snapHeaderSize+snapTrailerSize {
		return nil, nil, fmt.Errorf("%w: truncated", ErrBadSnapshot)
	}
	trailer := data[len(data)-snapTrailerSize:]
	if string(trailer[12:]) != snapEnd {
		return nil, nil, fmt.Errorf("%w: truncated (no end marker)", ErrBadSnapshot)
	}
	body := data[snapHeaderSize : len(data)-snapTrailerSize]
	if n := binary.LittleEndian.Uint64(trailer); n != uint64(len(body)) {
		return nil, nil, fmt.Errorf("%w: body is %d bytes, trailer says %d", ErrBadSnapshot, len(body), n)
	}
	if sum := crc32.Checksum(data[:len(data)-snapTrailerSize], crcTable); sum != binary.LittleEndian.Uint32(trailer[8:]) {
		return nil, nil, fmt.Errorf("%w: checksum mismatch", ErrBadSnapshot)
	}
	d := &decoder{b: body}
	ix, seqs := decodeIndex(d, cfg)
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d trailing bytes", len(d.b))
	}
	if d.err != nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrBadSnapshot, d.err)
	}
	return ix, seqs, nil
}

func decodeIndex(d *decoder, cfg Config) (*Index, map[Holder]uint64) {
	ix := New(cfg)
	for range d.count(2) {
		h := d.holder()
		ix.caps.Store(h, d.varint())
	}
	seqs := make(map[Holder]uint64)
	for range d.count(2) {
		h := d.holder()
		seqs[h] = d.uvarint()
	}
	for range d.count(2) {
		name := d.str()
		if d.err != nil {
			break
		}
		if _, ok := ix.models.Load(name); ok {
			d.fail("model %q twice", name)
			break
		}
		ms := ix.model(name, true)
		var shared []sharedRec
		for range d.count(3) {
			hs := decodeHolder(d, ix, ms, &shared)
			if d.err != nil {
				break
			}
			if _, ok := ms.holders.Load(hs.h); ok {
				d.fail("holder %v of model %q twice", hs.h, name)
				break
			}
			hs.listRoots()
			ms.holders.Store(hs.h, hs)
			next := append(*ms.list.Load(), hs)
			ms.list.Store(&next)
			ix.total.Add(hs.live.Load())
		}
		if d.err == nil {
			buildShared(d, ms, shared)
		}
	}
	if d.err != nil {
		return nil, nil
	}
	// Limits may be lower than when the snapshot was taken.
	ix.models.Range(func(name string, ms *modelState) bool {
		for _, hs := range *ms.list.Load() {
			hs.mu.Lock()
			ix.enforce(name, hs)
			hs.publish()
			hs.mu.Unlock()
		}
		return true
	})
	return ix, seqs
}

type savedSlot struct {
	key    uint64
	groups uint64
	depth  int
	parent int
	ext    []int
}

// sharedRec is a saved holding of a shared block.
type sharedRec struct {
	hs        *holderState
	tier      string
	key       uint64
	parent    uint64
	hasParent bool
	groups    []int
}

// decodeHolder reads a holder, queueing its eviction order; the entries of
// shared blocks are queued as fifoRunLen items naming their record in
// shared, for buildShared to replace.
func decodeHolder(d *decoder, ix *Index, ms *modelState, shared *[]sharedRec) *holderState {
	h := d.holder()
	hs := newHolderState(ms, h, ix.capacityOf(h))
	nt := d.count(2)
	if nt > maxTiers {
		d.fail("holder %v has %d tiers", h, nt)
		return hs
	}
	var live int64
	slotOf := make([][]uint32, 0, nt)
	for range nt {
		name := d.str()
		if name == "" {
			d.fail("holder %v has an unnamed tier", h)
		}
		if d.err != nil {
			return hs
		}
		if _, ts := hs.tier(name, false); ts != nil {
			d.fail("holder %v has tier %q twice", h, name)
			return hs
		}
		_, ts := hs.tier(name, true)
		n := d.count(11)
		slots := make([]savedSlot, 0, n)
		for i := range n {
			s := savedSlot{key: d.u64(), groups: uint64(d.byte()), depth: int(d.uvarint()), parent: int(min(d.uvarint(), uint64(n)+1)) - 1}
			if s.groups&metaExtGroup != 0 {
				s.ext = d.groups(h, name, false)
			}
			if s.parent < -1 || s.parent >= int(n) || s.parent == i {
				d.fail("holder %v tier %q: bad anchor", h, name)
			}
			if d.err != nil {
				return hs
			}
			slots = append(slots, s)
		}
		slotIdx, n2 := buildTier(d, ts, slots)
		if d.err != nil {
			return hs
		}
		live += n2
		slotOf = append(slotOf, slotIdx)
	}
	tiers := hs.tierList()
	seen := make([][]bool, len(tiers))
	for ti := range tiers {
		seen[ti] = make([]bool, len(slotOf[ti]))
	}
	seenShared := make(map[sharedKey]bool)
	for range d.count(2) {
		ti := int(d.byte())
		if ti == snapShared {
			r := sharedRec{hs: hs}
			ti = int(d.byte())
			r.key = d.u64()
			r.hasParent = d.byte() != 0
			if r.hasParent {
				r.parent = d.u64()
			}
			if ti < len(tiers) {
				r.tier = tiers[ti].name
			}
			r.groups = d.groups(h, r.tier, true)
			if d.err != nil {
				return hs
			}
			k := sharedKey{ti, r.key}
			if ti >= len(tiers) || seenShared[k] || held(tiers[ti].tab.Load().get(r.key)) {
				d.fail("holder %v: eviction order names a shared block of a missing tier, twice or also unshared", h)
				return hs
			}
			seenShared[k] = true
			hs.push(fifoRunLen, len(*shared))
			*shared = append(*shared, r)
			live++
			continue
		}
		idx := d.uvarint()
		if d.err != nil {
			return hs
		}
		if ti >= len(tiers) || idx >= uint64(len(slotOf[ti])) {
			d.fail("holder %v: eviction order names a missing block", h)
			return hs
		}
		i := slotOf[ti][idx]
		if seen[ti][idx] || !held(tiers[ti].tab.Load().slots[i].meta) {
			d.fail("holder %v: eviction order names a block twice or an unheld one", h)
			return hs
		}
		seen[ti][idx] = true
		hs.push(ti, int(i))
	}
	if int64(len(hs.fifoSlot)) != live {
		d.fail("holder %v: eviction order lists %d of %d blocks", h, len(hs.fifoSlot), live)
	}
	hs.live.Store(live)
	return hs
}

type sharedKey struct {
	tier int
	key  uint64
}

// groups reads a list of KV cache groups: ext ones (7 on) for a slot, any
// for a shared block, where an empty list is group 0 alone.
func (d *decoder) groups(h Holder, tier string, shared bool) []int {
	var gs []int
	for range d.count(1) {
		g := int(d.varint())
		if !shared && groupBit(g) != metaExtGroup || slices.Contains(gs, g) {
			d.fail("holder %v tier %q: bad group %d", h, tier, g)
		}
		gs = append(gs, g)
	}
	if !shared && len(gs) == 0 {
		d.fail("holder %v tier %q: group list missing", h, tier)
	}
	if shared && len(gs) == 1 && gs[0] == 0 {
		gs = nil
	}
	return gs
}

// buildShared builds ms's layer from the shared records of its holders and
// puts their entries in the holders' eviction orders.
func buildShared(d *decoder, ms *modelState, recs []sharedRec) {
	if len(recs) == 0 {
		return
	}
	ly := ms.layer
	ly.mu.Lock()
	defer ly.mu.Unlock()
	parentOf := make(map[uint64]sharedRec, len(recs))
	for _, r := range recs {
		if _, ok := parentOf[r.key]; !ok {
			parentOf[r.key] = r
		}
	}
	entry := make(map[uint64]int, len(parentOf))
	var up []uint64
	// ensure creates key's entry after those of its saved ancestors.
	ensure := func(key uint64) int {
		up = up[:0]
		for k := key; ; {
			if _, ok := entry[k]; ok {
				break
			}
			up = append(up, k)
			if len(up) > len(parentOf) {
				d.fail("shared blocks: parents form a cycle")
				return -1
			}
			r := parentOf[k]
			if _, ok := parentOf[r.parent]; !r.hasParent || !ok {
				break
			}
			k = r.parent
		}
		for i := len(up) - 1; i >= 0; i-- {
			p := -1
			if r := parentOf[up[i]]; r.hasParent {
				if e, ok := entry[r.parent]; ok {
					p = e
				}
			}
			entry[up[i]] = ly.create(up[i], p)
		}
		return entry[key]
	}
	at := make([]int, len(recs))
	for i, r := range recs {
		if at[i] = ensure(r.key); d.err != nil {
			return
		}
		lane := ly.laneFor(r.tier)
		if lane < 0 {
			d.fail("shared blocks in more than %d tiers, or in tier %q", layerLanes, r.tier)
			return
		}
		ly.addHolder(at[i], lane, ly.idOf(r.hs))
		if len(r.groups) > 0 {
			if r.hs.laneGroups == nil {
				r.hs.laneGroups = make(map[uint64][]int)
			}
			r.hs.laneGroups[layerGroupKey(uint32(at[i]), lane)] = r.groups
		}
		r.hs.laneLive[lane]++
	}
	for _, hs := range *ms.list.Load() {
		if hs.lid.Load() == 0 {
			continue
		}
		f := fifoWriter{tier: hs.fifoTier, slot: hs.fifoSlot}
		for r, t := range hs.fifoTier {
			if t != fifoRunLen {
				f.put(t, hs.fifoSlot[r])
				continue
			}
			rec := hs.fifoSlot[r]
			e := at[rec]
			ly.at(uint32(e)).refs++
			f.putLayer(uint32(e), ly.laneOf(recs[rec].tier))
		}
		hs.fifoTier, hs.fifoSlot = f.tier[:f.w], f.slot[:f.w]
	}
}

// buildTier fills ts's table with slots, checks that anchors and depths are
// consistent, and rebuilds children counts and gaps. It returns each saved
// slot's index in the table and how many are held.
func buildTier(d *decoder, ts *tierState, slots []savedSlot) ([]uint32, int64) {
	t := newTable(tableSizeFor(len(slots)))
	at := make([]uint32, len(slots))
	children := make([]int, len(slots))
	var live int64
	for i, s := range slots {
		want := 0
		if s.parent >= 0 {
			want = min(slots[s.parent].depth+1, metaDepthMax)
		}
		if s.depth != want {
			d.fail("tier %q: depth %d, anchor says %d", ts.name, s.depth, want)
			return nil, 0
		}
		if j, found := t.probe(s.key); found {
			d.fail("tier %q: key %#x twice", ts.name, s.key)
			return nil, 0
		} else {
			t.slots[j].key = s.key
			t.slots[j].meta = metaExists
			t.used++
			at[i] = uint32(j)
		}
		if s.groups != 0 {
			live++
			if s.parent >= 0 {
				children[s.parent]++
			}
		}
		if len(s.ext) > 0 {
			if ts.ext == nil {
				ts.ext = make(map[uint64][]int)
			}
			ts.ext[s.key] = s.ext
		}
	}
	for i, s := range slots {
		m := metaExists | s.groups | uint64(s.depth)<<metaDepthShift
		if s.parent >= 0 {
			m |= uint64(at[s.parent]+1) << metaParentShift
		}
		c := children[i]
		if c > metaChildMask {
			if ts.childOver == nil {
				ts.childOver = make(map[uint64]int)
			}
			ts.childOver[s.key] = c - metaChildMask
			c = metaChildMask
		}
		m |= uint64(c) << metaChildShift
		t.slots[at[i]].meta = m
		if s.groups == 0 && children[i] > 0 {
			if ts.gaps == nil {
				ts.gaps = make(map[uint64]uint64)
			}
			ts.gaps[s.key] = uint64(s.depth)
		}
	}
	ts.publishGaps(t)
	ts.live = live
	ts.tab.Store(t)
	return at, live
}

// decoder reads the body; after the first error every read returns zero.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf(format, args...)
	}
}

func (d *decoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n > len(d.b) {
		d.fail("truncated body")
		return nil
	}
	b := d.b[:n]
	d.b = d.b[n:]
	return b
}

func (d *decoder) byte() byte {
	if b := d.take(1); b != nil {
		return b[0]
	}
	return 0
}

func (d *decoder) u64() uint64 {
	if b := d.take(8); b != nil {
		return binary.LittleEndian.Uint64(b)
	}
	return 0
}

func (d *decoder) uvarint() uint64 { return readVarint(d, binary.Uvarint) }

func (d *decoder) varint() int64 { return readVarint(d, binary.Varint) }

func readVarint[T uint64 | int64](d *decoder, read func([]byte) (T, int)) T {
	if d.err != nil {
		return 0
	}
	v, n := read(d.b)
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

// count reads a element count, each element at least minSize bytes, so
// that a corrupt count cannot make the loader allocate beyond the file.
func (d *decoder) count(minSize int) int {
	n := d.uvarint()
	if n > uint64(len(d.b)/minSize) {
		d.fail("count %d exceeds the file", n)
		return 0
	}
	return int(n)
}

func (d *decoder) str() string {
	return string(d.take(d.count(1)))
}

func (d *decoder) holder() Holder {
	return Holder{Pod: d.str(), Rank: int(d.varint())}
}
