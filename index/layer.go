package index

import (
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"
)

// The layer is the block-major part of a model's store: blocks that many
// holders hold (a system prompt, a prefix pulled to peers) are kept once,
// as an entry with the key, its chain (parent entry and depth) and, per
// tier, the set of its holders, instead of a table slot per holder. A
// holding costs a bit (or, in a small set, 4 bytes) and a share of one
// eviction-queue run instead of about 30 bytes.
//
// A block enters the layer when a store finds that at least the model's
// share threshold of holders would hold it: holders already holding it in
// their own tables move their holding into the layer (their queue entry
// keeps its place; see holderState.evict), and later holders store it
// there directly. A holding is either in its holder's table or in the
// layer, never both. Blocks stay in the layer while anyone holds them;
// an entry nobody holds, references or chains through is freed.
//
// Lookups search a holder's layer holdings as they search its tables: a
// held entry at depth d proves the d blocks before it on the prompt held
// unless a gap (an entry not held by a holder that holds one of its
// children) sits among them. Gaps are listed per tier, conservatively: an
// entry whose holder set lost a member while it had children is listed
// whether or not that member held one; an exact recount prunes the list
// when it overflows.
//
// Readers load every word atomically and take no lock; writers (stores,
// removals and evictions of any holder of the model) serialise on the
// layer's mutex, taken after a holder's and before none, while they write
// blocks that are or may become shared (see storeShared). A writer finds
// its holder's own layer holdings without it: only writers holding the
// holder's mutex change them.

const (
	// DefaultShareThreshold is Config.ShareThreshold's default.
	DefaultShareThreshold = 64

	layerLanes     = 2 // tiers per model the layer keeps
	layerSmall     = 4 // holders kept in an entry's small set
	layerChunkBits = 10
	layerChunk     = 1 << layerChunkBits
	layerTomb      = ^uint32(0) // table slot of a freed entry's key

	// sharedBlockHoldings is what Config.MemoryBytes counts a shared
	// block as, in holdings of HolderBlockBytes: its entry, its key's
	// slot in the layer's table at the occupancy a rebuild leaves, and a
	// bitset of 128 holders with its header, rounded up.
	sharedBlockHoldings = (int64(unsafe.Sizeof(layerEntry{})+(8+4)*loadDen/rebuildNum+24+16) + HolderBlockBytes - 1) / HolderBlockBytes

	entryLive       = 1
	entryDepthShift = 16
	entryParentSh   = 32
)

// Eviction-queue items for layer holdings use tier bytes from fifoLayer
// on. A holding alone is fifoLayer+lane with its entry as slot; a run of
// holdings of consecutive entries is two items, fifoRun with its first
// entry, then fifoRunLen with lane<<runLaneShift | length.
const (
	fifoLayer    = 248
	fifoRunLen   = 254
	fifoRun      = 255
	runLaneShift = 28
	runMax       = 1<<runLaneShift - 1
)

// allLanes marks every lane, for a holder that leaves all of them.
var allLanes = func() (all [layerLanes]bool) {
	for l := range all {
		all[l] = true
	}
	return all
}()

// layerEntry is one block in the layer.
type layerEntry struct {
	key atomic.Uint64
	// meta is entryLive | depth<<entryDepthShift | (parent entry+1)<<entryParentSh.
	meta  atomic.Uint64
	lanes [layerLanes]laneSet
	// nchild counts live entries whose parent this is; refs the queue
	// items that name it. Writer only.
	nchild uint32
	refs   uint32
}

// laneSet is an entry's holders in one tier: up to layerSmall ids in
// place, the rest in a bitset.
type laneSet struct {
	small [layerSmall]atomic.Uint32 // holder id + 1, 0 for none
	big   atomic.Pointer[bitset]
	n     int32 // members; writer only
}

type bitset struct{ words []atomic.Uint64 }

func (s *laneSet) has(id uint32) bool {
	for i := range s.small {
		if s.small[i].Load() == id+1 {
			return true
		}
	}
	if b := s.big.Load(); b != nil && int(id/64) < len(b.words) {
		return b.words[id/64].Load()&(1<<(id%64)) != 0
	}
	return false
}

// add puts id, known absent, in the set. Writer only.
func (s *laneSet) add(id uint32) {
	s.n++
	if s.big.Load() == nil {
		for i := range s.small {
			if s.small[i].Load() == 0 {
				s.small[i].Store(id + 1)
				return
			}
		}
	}
	b := s.big.Load()
	if b == nil || int(id/64) >= len(b.words) {
		nb := &bitset{words: make([]atomic.Uint64, max(int(id/64)+1, 2*len(wordsOf(b))))}
		for i := range wordsOf(b) {
			nb.words[i].Store(b.words[i].Load())
		}
		s.big.Store(nb)
		b = nb
	}
	b.words[id/64].Or(1 << (id % 64))
}

func wordsOf(b *bitset) []atomic.Uint64 {
	if b == nil {
		return nil
	}
	return b.words
}

// remove takes id, known present, out of the set. Writer only.
func (s *laneSet) remove(id uint32) {
	s.n--
	for i := range s.small {
		if s.small[i].Load() == id+1 {
			s.small[i].Store(0)
			return
		}
	}
	s.big.Load().words[id/64].And(^uint64(1 << (id % 64)))
}

// appendIDs appends the set's members to dst.
func (s *laneSet) appendIDs(dst []uint32) []uint32 {
	for i := range s.small {
		if v := s.small[i].Load(); v != 0 {
			dst = append(dst, v-1)
		}
	}
	if b := s.big.Load(); b != nil {
		for w := range b.words {
			for x := b.words[w].Load(); x != 0; x &= x - 1 {
				dst = append(dst, uint32(w*64+bits.TrailingZeros64(x)))
			}
		}
	}
	return dst
}

// layerLane is one tier of the layer: its name, fixed once set, and its gaps.
type layerLane struct {
	name  atomic.Pointer[string]
	gapN  atomic.Int32
	gaps  [maxGaps]gap
	epoch atomic.Uint64
	// gapSet holds the listed gaps' entries; since counts gaps added since
	// the last recount. Writer only.
	gapSet map[uint32]struct{}
	since  int
}

// layerTable maps keys to entries: open addressing with linear probing,
// like table. A slot keeps its key until the table is rebuilt; its entry
// becomes layerTomb when the entry is freed.
type layerTable struct {
	keys []uint64
	idx  []uint32 // entry + 1; 0 for an empty slot
	size uint64
	used int
}

// layer is a model's shared store. See the comment at the top of the file.
type layer struct {
	mu     sync.Mutex
	tab    atomic.Pointer[layerTable]
	chunks atomic.Pointer[[]*[layerChunk]layerEntry]
	lanes  [layerLanes]layerLane
	// holders maps holder ids to holders; nil for a freed id.
	holders atomic.Pointer[[]*holderState]
	live    atomic.Int64 // entries in use
	// releases counts the holder ids freed: a reader that resolved ids
	// read from entries before a release asks those holders again.
	releases atomic.Uint64
	// shared counts the entries with a holder over every model (the
	// Index's), for the memory budget and Stats.SharedBlocks.
	shared *atomic.Int64

	// Writer only.
	next     uint32 // entries ever allocated
	free     []uint32
	freeHead int
	freeIDs  []uint32
	// Scratch of sharers.
	hits []*holderState
	ids  []uint32
}

func newLayer(shared *atomic.Int64) *layer {
	ly := &layer{shared: shared}
	ly.tab.Store(newLayerTable(minTableSize))
	chunks := []*[layerChunk]layerEntry{}
	ly.chunks.Store(&chunks)
	holders := []*holderState{}
	ly.holders.Store(&holders)
	return ly
}

func newLayerTable(size int) *layerTable {
	return &layerTable{keys: make([]uint64, size), idx: make([]uint32, size), size: uint64(size)}
}

func (t *layerTable) home(key uint64) uint64 {
	hi, _ := bits.Mul64(key*0x9E3779B97F4A7C15, t.size)
	return hi
}

// active reports whether the layer holds any entry: while it does not,
// stores take the tables' path alone.
func (ly *layer) active() bool { return ly.live.Load() > 0 }

func (ly *layer) at(e uint32) *layerEntry {
	chunks := *ly.chunks.Load()
	return &chunks[e>>layerChunkBits][e&(layerChunk-1)]
}

// find returns key's live entry, or nil and -1.
func (ly *layer) find(key uint64) (*layerEntry, int) {
	t := ly.tab.Load()
	i := t.home(key)
	for {
		x := atomic.LoadUint32(&t.idx[i])
		if x == 0 {
			return nil, -1
		}
		if atomic.LoadUint64(&t.keys[i]) == key {
			if x == layerTomb {
				return nil, -1
			}
			e := ly.at(x - 1)
			if e.key.Load() != key || e.meta.Load()&entryLive == 0 {
				return nil, -1
			}
			return e, int(x - 1)
		}
		if i++; i == t.size {
			i = 0
		}
	}
}

// look returns whether the holder with id holds keys[i] in lane, and the
// entry's depth, through memo when it is not nil. A concurrent free and
// reuse of the entry is caught by its key, read again after the set.
func (ly *layer) look(keys []uint64, i int, lane int, id uint32, memo *layerMemo) (held bool, depth int) {
	key := keys[i]
	var e *layerEntry
	if memo != nil {
		e, depth = memo.get(ly, keys, i)
	} else if e, _ = ly.find(key); e != nil {
		depth = entryDepth(e.meta.Load())
	}
	if e == nil {
		return false, 0
	}
	held = e.lanes[lane].has(id)
	if e.key.Load() != key {
		return false, 0
	}
	return held, depth
}

// layerMemo remembers, for one lookup, the layer entry of each prompt
// position it asked for: a lookup asks about the same positions for every
// holder it searches. The zero value is ready; gen tells this lookup's
// entries from older ones.
type layerMemo struct {
	gen   uint32
	stamp []uint32
	ent   []*layerEntry
	depth []int32
}

// reset prepares m for a lookup of n keys.
func (m *layerMemo) reset(n int) {
	if len(m.stamp) < n {
		m.stamp = make([]uint32, n)
		m.ent = make([]*layerEntry, n)
		m.depth = make([]int32, n)
		m.gen = 0
	}
	m.gen++
	if m.gen == 0 {
		clear(m.stamp)
		m.gen = 1
	}
}

func (m *layerMemo) get(ly *layer, keys []uint64, i int) (*layerEntry, int) {
	if m.stamp[i] == m.gen {
		return m.ent[i], int(m.depth[i])
	}
	e, _ := ly.find(keys[i])
	if e == nil {
		// Not remembered: the block may move to the layer meanwhile, and
		// a reader that then misses it in the holder's table must find it
		// here.
		return nil, 0
	}
	d := entryDepth(e.meta.Load())
	m.stamp[i] = m.gen
	if m.ent[i] != e {
		m.ent[i] = e
	}
	m.depth[i] = int32(d)
	return e, d
}

// holds reports whether the holder with id holds key in any lane.
func (ly *layer) holds(key uint64, id uint32) bool {
	e, _ := ly.find(key)
	if e == nil {
		return false
	}
	for l := range e.lanes {
		if e.lanes[l].has(id) {
			return true
		}
	}
	return false
}

// laneName returns lane's tier, "" while unused.
func (ly *layer) laneName(lane int) string {
	if p := ly.lanes[lane].name.Load(); p != nil {
		return *p
	}
	return ""
}

// laneOf returns the lane of tier, -1 when it has none.
func (ly *layer) laneOf(tier string) int {
	for l := range ly.lanes {
		if ly.laneName(l) == tier {
			return l
		}
	}
	return -1
}

// laneFor returns the lane of tier, giving it a free one when it has none;
// -1 when none is free or the tier is one the layer does not keep.
// ly.mu is held.
func (ly *layer) laneFor(tier string) int {
	if tier == TierSpeculative {
		return -1
	}
	if l := ly.laneOf(tier); l >= 0 {
		return l
	}
	for l := range ly.lanes {
		if ly.lanes[l].name.Load() == nil {
			ly.lanes[l].name.Store(&tier)
			return l
		}
	}
	return -1
}

// holderAt returns the holder with id, nil when there is none.
func (ly *layer) holderAt(id uint32) *holderState {
	if hs := *ly.holders.Load(); int(id) < len(hs) {
		return hs[id]
	}
	return nil
}

// idOf returns hs's holder id, giving it one. ly.mu is held.
func (ly *layer) idOf(hs *holderState) uint32 {
	if v := hs.lid.Load(); v != 0 {
		return v - 1
	}
	list := *ly.holders.Load()
	var id uint32
	if n := len(ly.freeIDs); n > 0 {
		id = ly.freeIDs[n-1]
		ly.freeIDs = ly.freeIDs[:n-1]
	} else {
		id = uint32(len(list))
	}
	next := make([]*holderState, max(len(list), int(id)+1))
	copy(next, list)
	next[id] = hs
	ly.holders.Store(&next)
	hs.lid.Store(id + 1)
	return id
}

// releaseID frees hs's holder id, once no entry has it. ly.mu is held.
func (ly *layer) releaseID(hs *holderState) {
	v := hs.lid.Load()
	if v == 0 {
		return
	}
	list := *ly.holders.Load()
	next := make([]*holderState, len(list))
	copy(next, list)
	next[v-1] = nil
	ly.holders.Store(&next)
	ly.freeIDs = append(ly.freeIDs, v-1)
	hs.lid.Store(0)
	ly.releases.Add(1)
}

// create adds an entry for key, a child of entry parent (-1: none), and
// returns it. ly.mu is held.
func (ly *layer) create(key uint64, parent int) int {
	var e uint32
	if ly.freeHead < len(ly.free) {
		e = ly.free[ly.freeHead]
		ly.freeHead++
		if ly.freeHead >= 1024 && ly.freeHead*2 >= len(ly.free) {
			n := copy(ly.free, ly.free[ly.freeHead:])
			ly.free, ly.freeHead = ly.free[:n], 0
		}
	} else {
		e = ly.next
		ly.next++
		chunks := *ly.chunks.Load()
		if int(e>>layerChunkBits) >= len(chunks) {
			next := append(chunks[:len(chunks):len(chunks)], new([layerChunk]layerEntry))
			ly.chunks.Store(&next)
		}
	}
	en := ly.at(e)
	en.key.Store(key)
	m := uint64(entryLive)
	if parent >= 0 {
		p := ly.at(uint32(parent))
		p.nchild++
		d := min(int(p.meta.Load()>>entryDepthShift)&metaDepthMax+1, metaDepthMax)
		m |= uint64(d)<<entryDepthShift | uint64(parent+1)<<entryParentSh
	}
	en.meta.Store(m)
	ly.insertKey(key, e)
	ly.live.Add(1)
	return int(e)
}

func entryParent(m uint64) int { return int(m>>entryParentSh) - 1 }

func entryDepth(m uint64) int { return int(m>>entryDepthShift) & metaDepthMax }

// insertKey maps key to entry e, rebuilding the table when it is full.
func (ly *layer) insertKey(key uint64, e uint32) {
	t := ly.tab.Load()
	if (t.used+1)*loadDen > len(t.keys)*maxLoadNum {
		t = ly.rebuild(t)
	}
	i := t.home(key)
	for {
		x := t.idx[i]
		if x == 0 {
			atomic.StoreUint64(&t.keys[i], key)
			atomic.StoreUint32(&t.idx[i], e+1)
			t.used++
			return
		}
		if t.keys[i] == key {
			atomic.StoreUint32(&t.idx[i], e+1)
			return
		}
		if i++; i == t.size {
			i = 0
		}
	}
}

// rebuild publishes a table with the live keys of t and room to grow.
func (ly *layer) rebuild(t *layerTable) *layerTable {
	n := int(ly.live.Load()) + 1
	nt := newLayerTable(max(tableSizeFor(n), minTableSize))
	for i := range t.keys {
		x := t.idx[i]
		if x == 0 || x == layerTomb {
			continue
		}
		k := t.keys[i]
		j := nt.home(k)
		for nt.idx[j] != 0 {
			if j++; j == nt.size {
				j = 0
			}
		}
		nt.keys[j], nt.idx[j] = k, x
		nt.used++
	}
	ly.tab.Store(nt)
	return nt
}

// addHolder puts the holder with id in entry e's lane. ly.mu is held.
func (ly *layer) addHolder(e int, lane int, id uint32) {
	en := ly.at(uint32(e))
	if p := entryParent(en.meta.Load()); p >= 0 && !ly.at(uint32(p)).lanes[lane].has(id) {
		ly.addGap(lane, uint32(p))
	}
	if en.members() == 0 {
		ly.shared.Add(1)
	}
	en.lanes[lane].add(id)
}

// members counts the entry's holdings. Writer only.
func (en *layerEntry) members() int32 {
	var n int32
	for l := range en.lanes {
		n += en.lanes[l].n
	}
	return n
}

// dropHolder takes the holder with id out of entry e's lane, and frees the
// entry when nothing is left of it. ly.mu is held.
func (ly *layer) dropHolder(e int, lane int, id uint32) {
	en := ly.at(uint32(e))
	if en.nchild > 0 {
		ly.addGap(lane, uint32(e))
	}
	en.lanes[lane].remove(id)
	if en.members() == 0 {
		ly.shared.Add(-1)
	}
	ly.maybeFree(uint32(e))
}

// release drops a queue item's reference to entry e. ly.mu is held.
func (ly *layer) release(e uint32) {
	ly.at(e).refs--
	ly.maybeFree(e)
}

// maybeFree frees entry e, and then its parent, while nothing holds,
// references or chains through them. ly.mu is held.
func (ly *layer) maybeFree(e uint32) {
	for {
		en := ly.at(e)
		if en.refs != 0 || en.nchild != 0 {
			return
		}
		for l := range en.lanes {
			if en.lanes[l].n != 0 {
				return
			}
		}
		m := en.meta.Load()
		key := en.key.Load()
		for l := range en.lanes {
			en.lanes[l].big.Store(nil)
			if _, ok := ly.lanes[l].gapSet[e]; ok {
				ly.removeGap(l, e, key)
			}
		}
		en.meta.Store(0)
		ly.tombKey(key)
		ly.free = append(ly.free, e)
		ly.live.Add(-1)
		p := entryParent(m)
		if p < 0 {
			return
		}
		e = uint32(p)
		ly.at(e).nchild--
	}
}

func (ly *layer) tombKey(key uint64) {
	t := ly.tab.Load()
	i := t.home(key)
	for t.idx[i] != 0 {
		if t.keys[i] == key {
			atomic.StoreUint32(&t.idx[i], layerTomb)
			return
		}
		if i++; i == t.size {
			i = 0
		}
	}
}

// addGap lists entry e as a gap of lane, before the caller opens it.
// Past maxGaps, a recount of the gaps open before e first prunes the
// list, at most once per live/8 additions.
func (ly *layer) addGap(lane int, e uint32) {
	ln := &ly.lanes[lane]
	if _, ok := ln.gapSet[e]; ok {
		return
	}
	if len(ln.gapSet) >= maxGaps && ln.since > max(64, int(ly.live.Load()/8)) {
		ly.recount(lane)
	}
	if ln.gapSet == nil {
		ln.gapSet = make(map[uint32]struct{})
	}
	ln.gapSet[e] = struct{}{}
	en := ly.at(e)
	if n := int(ln.gapN.Load()); n >= 0 && n < maxGaps {
		ln.gaps[n].key.Store(en.key.Load())
		ln.gaps[n].depth.Store(uint64(entryDepth(en.meta.Load())))
		ln.gapN.Store(int32(n + 1))
	} else {
		ln.gapN.Store(-1)
	}
	ln.epoch.Add(1)
	ln.since++
}

// removeGap withdraws gap e (key key) of lane.
func (ly *layer) removeGap(lane int, e uint32, key uint64) {
	ln := &ly.lanes[lane]
	delete(ln.gapSet, e)
	n := int(ln.gapN.Load())
	if n < 0 {
		if len(ln.gapSet) <= maxGaps {
			ly.publishGaps(lane)
		}
		return
	}
	for j := range n {
		if ln.gaps[j].key.Load() == key {
			ln.gaps[j].key.Store(ln.gaps[n-1].key.Load())
			ln.gaps[j].depth.Store(ln.gaps[n-1].depth.Load())
			ln.gapN.Store(int32(n - 1))
			return
		}
	}
}

func (ly *layer) publishGaps(lane int) {
	ln := &ly.lanes[lane]
	if len(ln.gapSet) > maxGaps {
		ln.gapN.Store(-1)
		return
	}
	n := 0
	for e := range ln.gapSet {
		en := ly.at(e)
		ln.gaps[n].key.Store(en.key.Load())
		ln.gaps[n].depth.Store(uint64(entryDepth(en.meta.Load())))
		n++
	}
	ln.gapN.Store(int32(n))
}

// recount replaces lane's gaps by the exact ones: entries missing a holder
// of one of their children. The exact set is within the listed one, so
// readers never miss a gap meanwhile.
func (ly *layer) recount(lane int) {
	ln := &ly.lanes[lane]
	exact := make(map[uint32]struct{})
	var ids []uint32
	for e := range ly.next {
		en := ly.at(e)
		m := en.meta.Load()
		p := entryParent(m)
		if m&entryLive == 0 || p < 0 {
			continue
		}
		if _, ok := exact[uint32(p)]; ok {
			continue
		}
		pe := ly.at(uint32(p))
		ids = en.lanes[lane].appendIDs(ids[:0])
		for _, id := range ids {
			if !pe.lanes[lane].has(id) {
				exact[uint32(p)] = struct{}{}
				break
			}
		}
	}
	ln.gapSet = exact
	ln.since = 0
	ly.publishGaps(lane)
}

// run returns how many consecutive blocks from keys[b] the holder with id
// holds in lane, searching by depth as runFrom does in a table.
func (ly *layer) run(keys []uint64, b int, lane int, id uint32, memo *layerMemo) int {
	if b >= len(keys) {
		return 0
	}
	ln := &ly.lanes[lane]
	for range searchTries {
		e := ln.epoch.Load()
		g := int(ln.gapN.Load())
		if g < 0 {
			break
		}
		n := ly.search(keys, b, lane, id, g, memo)
		if ln.epoch.Load() == e {
			return n
		}
	}
	return ly.linear(keys, b, lane, id, memo)
}

// linear is run block by block.
func (ly *layer) linear(keys []uint64, b int, lane int, id uint32, memo *layerMemo) int {
	i := b
	for i < len(keys) {
		if held, _ := ly.look(keys, i, lane, id, memo); !held {
			break
		}
		i++
	}
	return i - b
}

// search is table.search over the layer.
func (ly *layer) search(keys []uint64, b int, lane int, id uint32, g int, memo *layerMemo) int {
	n := len(keys)
	pos := b
	held, _ := ly.look(keys, pos, lane, id, memo)
	for held {
		lo, hi := pos, n
		himHeld := false
		for j := n - 1; hi-lo > 1; j = int(uint(lo+hi) >> 1) {
			h, d := ly.look(keys, j, lane, id, memo)
			if h && ly.certified(keys, pos, j, d, lane, g) {
				lo = j
			} else {
				hi, himHeld = j, h
			}
		}
		pos = lo + 1
		if pos >= n {
			break
		}
		held = himHeld
	}
	return pos - b
}

func (ly *layer) certified(keys []uint64, pos, j, d int, lane int, g int) bool {
	if d < j-pos {
		return false
	}
	if g == 0 {
		return true
	}
	if d == metaDepthMax {
		return false
	}
	ln := &ly.lanes[lane]
	for i := range g {
		gd := int(ln.gaps[i].depth.Load())
		if jg := j - d + gd; jg > pos && jg < j && keys[jg] == ln.gaps[i].key.Load() {
			return false
		}
	}
	return true
}

// groupRun sets pre[id], for each holder id in ids (sorted; pre holds
// their largest), to how many consecutive blocks from keys[0] it holds in
// lane. It searches for them
// together: along the prompt, a binary search finds how far all the
// holders still in the run hold every block, the ones that do not hold
// the block after leave the run there, and the others go on from it; the
// cost follows the positions where holders leave, not the holders. alive
// and gone are scratch bitsets, returned grown.
func (ly *layer) groupRun(keys []uint64, lane int, ids []uint32, pre []int32, alive, gone []uint64, memo *layerMemo) ([]uint64, []uint64) {
	words := 0
	if len(ids) > 0 {
		words = int(ids[len(ids)-1]/64) + 1
	}
	alive = slices.Grow(alive[:0], words)[:words]
	gone = slices.Grow(gone[:0], words)[:words]
	ln := &ly.lanes[lane]
	for try := 0; ; try++ {
		clear(pre)
		e := ln.epoch.Load()
		g := int(ln.gapN.Load())
		if try == searchTries {
			g = -1
		}
		ly.groupSearch(keys, lane, ids, pre, alive, gone, g, memo)
		if g < 0 || ln.epoch.Load() == e {
			return alive, gone
		}
	}
}

// groupSearch is groupRun with g listed gaps, or block by block for -1.
func (ly *layer) groupSearch(keys []uint64, lane int, ids []uint32, pre []int32, alive, gone []uint64, g int, memo *layerMemo) {
	n := len(keys)
	clear(alive)
	en, _ := memo.get(ly, keys, 0)
	if en == nil {
		return
	}
	left := 0
	for _, id := range ids {
		if en.lanes[lane].has(id) {
			alive[id/64] |= 1 << (id % 64)
			left++
		}
	}
	if en.key.Load() != keys[0] {
		return
	}
	pos := 0
	for left > 0 {
		lo := pos
		if g >= 0 {
			hi := n
			for j := n - 1; hi-lo > 1; j = int(uint(lo+hi) >> 1) {
				ej, d := memo.get(ly, keys, j)
				if ej != nil && ly.certified(keys, pos, j, d, lane, g) && ej.lanes[lane].holdsAll(alive) && ej.key.Load() == keys[j] {
					lo = j
				} else {
					hi = j
				}
			}
		}
		next := lo + 1
		if next >= n {
			for _, id := range ids {
				if alive[id/64]&(1<<(id%64)) != 0 {
					pre[id] = int32(n)
				}
			}
			return
		}
		// The holders still in the run that hold keys[next] hold all of
		// keys[:next+1]; the others' run ends at next.
		copy(gone, alive)
		if ej, _ := memo.get(ly, keys, next); ej != nil {
			ej.lanes[lane].clearMembers(gone)
			if ej.key.Load() != keys[next] {
				copy(gone, alive)
			}
		}
		for w, x := range gone {
			for ; x != 0; x &= x - 1 {
				pre[w*64+bits.TrailingZeros64(x)] = int32(next)
				left--
			}
			alive[w] &^= gone[w]
		}
		pos = next
	}
}

// addMembers sets the set's members in the bitset words, grown to hold them.
func (s *laneSet) addMembers(words []uint64) []uint64 {
	for i := range s.small {
		if v := s.small[i].Load(); v != 0 {
			words = growWords(words, int((v-1)/64))
			words[(v-1)/64] |= 1 << ((v - 1) % 64)
		}
	}
	big := wordsOf(s.big.Load())
	for w := range big {
		if x := big[w].Load(); x != 0 {
			words = growWords(words, w)
			words[w] |= x
		}
	}
	return words
}

// growWords extends words with zeros to hold word w.
func growWords(words []uint64, w int) []uint64 {
	for w >= len(words) {
		words = append(words, 0)
	}
	return words
}

// holdsAll reports whether every id in the bitset ids is in s.
func (s *laneSet) holdsAll(ids []uint64) bool {
	var small [layerSmall]uint32
	for i := range s.small {
		small[i] = s.small[i].Load()
	}
	big := wordsOf(s.big.Load())
	for w, x := range ids {
		if w < len(big) {
			x &^= big[w].Load()
		}
		for x != 0 {
			id := uint32(w*64 + bits.TrailingZeros64(x))
			if !slices.Contains(small[:], id+1) {
				return false
			}
			x &= x - 1
		}
	}
	return true
}

// clearMembers clears the set's members in the bitset ids.
func (s *laneSet) clearMembers(ids []uint64) {
	for i := range s.small {
		if v := s.small[i].Load(); v != 0 && int((v-1)/64) < len(ids) {
			ids[(v-1)/64] &^= 1 << ((v - 1) % 64)
		}
	}
	big := wordsOf(s.big.Load())
	for w := range min(len(ids), len(big)) {
		ids[w] &^= big[w].Load()
	}
}
