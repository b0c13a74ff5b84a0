package index

import (
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/puzpuzpuz/xsync/v4"

	"github.com/kvsource/kvsource/internal/ratelog"
)

// DefaultMaxHolderBlocks is the total budget when neither
// Config.MaxHolderBlocks nor Config.MemoryBytes is set: about 2.5 GiB of
// index at HolderBlockBytes a holding.
const DefaultMaxHolderBlocks = 64 << 20

// HolderBlockBytes is what one (block, tier) holding costs the index in
// memory at worst in steady state, a holder that keeps replacing its
// blocks (BenchmarkMemory/steady: 39-42 bytes): its table slot at the
// occupancy a rebuild after removals leaves (churnNum/loadDen), and its
// eviction-queue entry 2.5 times over, as the queue keeps entries of
// removed blocks until they outnumber the live ones, in slices grown by
// append. It is computed from the layout, so that it follows it;
// Config.MemoryBytes is turned into a holding budget with it (see
// memoryBudget), and TestMemoryBytesBoundsTheLiveHeapAtTheCap checks it
// against the heap.
const HolderBlockBytes = int64(unsafe.Sizeof(slot{}))*loadDen/churnNum +
	5*int64(unsafe.Sizeof(holderState{}.fifoSlot[0])+unsafe.Sizeof(holderState{}.fifoTier[0]))/2

// memoryBudget is the holding budget of a memory budget in bytes: the one
// place a byte budget maps onto holdings.
func memoryBudget(bytes int64) int64 { return max(bytes/HolderBlockBytes, 1) }

// Config configures an Index. The zero value is ready to use.
type Config struct {
	// HolderCapacity is the most (block, tier) holdings one holder may have
	// per model, normally the pod's cache size in blocks; past it the
	// holder's oldest holdings are evicted. Zero means no per-holder limit
	// (the total budget still applies). SetHolderCapacity overrides it per
	// holder.
	HolderCapacity int
	// MaxHolderBlocks is the total of holdings over all holders and models;
	// past it the oldest holdings of the largest holder are evicted. Zero
	// means DefaultMaxHolderBlocks, unless MemoryBytes is set; negative
	// means no budget.
	MaxHolderBlocks int64
	// MemoryBytes, when positive, bounds the index's memory in bytes: the
	// holdings are capped at MemoryBytes / HolderBlockBytes (or at
	// MaxHolderBlocks when that is positive and lower) and evicted past it
	// as past MaxHolderBlocks. It bounds the index's live data; a process
	// bounds its resident set by also giving the Go runtime a memory limit
	// above it (runtime/debug.SetMemoryLimit), or garbage of replaced
	// tables may double it. A shared block (see ShareThreshold) counts as
	// a few holdings more than its holders' own, and each model's state
	// as about 8 KiB of holdings (a model is freed with its last holder).
	MemoryBytes int64
	// ShareThreshold is how many holders must hold a block before the
	// index keeps it once for all of them (see Stats.SharedBlocks): a
	// table slot costs each holder about 30 bytes a block, a shared block
	// a few bytes a holder. Zero means DefaultShareThreshold; 1 keeps
	// every block of group 0 shared; negative keeps none.
	ShareThreshold int
	// Logger receives evictions and rejected input at debug level, at most
	// once a second per kind. Nil means slog.Default().
	Logger *slog.Logger
}

// Stats are the index's counters since New (or LoadFile).
type Stats struct {
	Models       int   // models with at least one holder
	Holders      int   // (model, holder) pairs
	HolderBlocks int64 // current (block, tier) holdings

	Stored  uint64 // blocks passed to Store
	Removed uint64 // holdings dropped by Remove
	Cleared uint64 // holdings dropped by ClearHolder and RemoveHolder

	EvictedCapacity uint64 // holdings evicted past a holder's capacity
	EvictedBudget   uint64 // holdings evicted past MaxHolderBlocks or MemoryBytes

	RejectedTier uint64 // stores dropped for an empty tier or too many tiers

	SharedBlocks int64 // blocks kept once for all their holders
}

// Index maps, per model, block keys to the holders that hold them and in
// which tier. See the package documentation for the concurrency contract.
type Index struct {
	cfg    Config
	budget int64
	share  int // Config.ShareThreshold, 0 for none
	log    *slog.Logger

	models *xsync.Map[string, *modelState]
	caps   *xsync.Map[Holder, int64]
	capMu  sync.Mutex // serialises SetHolderCapacity
	total  atomic.Int64
	shared atomic.Int64 // shared blocks held, over all models
	// modelBytes is what the model states cost, modelStateBytes and the
	// name each: with MemoryBytes, they count in the budget.
	modelBytes atomic.Int64

	stored, removed, cleared       atomic.Uint64
	evictedCapacity, evictedBudget atomic.Uint64
	rejectedTier                   atomic.Uint64

	logs [logKinds]ratelog.Gate
}

// modelState holds one model's holders. The list is copied on change so a
// lookup ranges over it without a lock. roots lists the holders that start
// a chain at each key (see roots.go); rootMu serialises its writers. layer
// keeps the blocks many holders hold (see layer.go).
type modelState struct {
	holders *xsync.Map[Holder, *holderState]
	mu      sync.Mutex
	list    atomic.Pointer[[]*holderState]
	roots   *xsync.Map[uint64, *rootSet]
	rootMu  sync.Mutex
	layer   *layer
	// dead: RemoveHolder removed its last holder and took it out of
	// Index.models, under mu; a holder made in it would be lost.
	dead bool
}

// modelStateBytes is what one model's state costs with its first
// holder's, their holdings and the model's name aside: about 7.7 KiB for
// the model's maps' and layer's first tables and 1.3 KiB for the holder's,
// measured by TestModelStatesCountInTheMemoryBudget. A peer naming a new
// model per message would otherwise grow the index past MemoryBytes with
// no holding to evict. (A model's further holders are bounded by the
// holders a processor follows, events.Config.MaxHolders.)
const modelStateBytes = 9 << 10

// New returns an empty index.
func New(cfg Config) *Index {
	ix := &Index{
		cfg:    cfg,
		budget: cfg.MaxHolderBlocks,
		log:    cfg.Logger,
		models: xsync.NewMap[string, *modelState](),
		caps:   xsync.NewMap[Holder, int64](),
	}
	switch {
	case cfg.MemoryBytes > 0 && ix.budget > 0:
		ix.budget = min(ix.budget, memoryBudget(cfg.MemoryBytes))
	case cfg.MemoryBytes > 0:
		ix.budget = memoryBudget(cfg.MemoryBytes)
	case ix.budget == 0:
		ix.budget = DefaultMaxHolderBlocks
	}
	if ix.log == nil {
		ix.log = slog.Default()
	}
	switch {
	case cfg.ShareThreshold == 0:
		ix.share = DefaultShareThreshold
	case cfg.ShareThreshold > 0:
		ix.share = cfg.ShareThreshold
	}
	return ix
}

const (
	logTier = iota
	logCapacity
	logBudget
	logKinds
)

// logf logs at debug level, at most once a second per kind.
func (ix *Index) logf(kind int, msg string, args ...any) {
	if _, ok := ix.logs[kind].Allow(time.Second); ok {
		ix.log.Debug(msg, args...)
	}
}

func (ix *Index) model(name string, create bool) *modelState {
	if !create {
		ms, _ := ix.models.Load(name)
		return ms
	}
	ms, _ := ix.models.LoadOrCompute(name, func() (*modelState, bool) {
		ix.modelBytes.Add(modelStateBytes + int64(len(name)))
		ms := &modelState{holders: xsync.NewMap[Holder, *holderState](), roots: xsync.NewMap[uint64, *rootSet](), layer: newLayer(&ix.shared)}
		empty := []*holderState{}
		ms.list.Store(&empty)
		return ms, false
	})
	return ms
}

func (ix *Index) capacityOf(h Holder) int64 {
	if c, ok := ix.caps.Load(h); ok {
		return c
	}
	return int64(ix.cfg.HolderCapacity)
}

// lockHolder returns h's state for model, locked, creating it when create
// is set; nil when absent.
func (ix *Index) lockHolder(model string, h Holder, create bool) *holderState {
	for {
		ms := ix.model(model, create)
		if ms == nil {
			return nil
		}
		hs, ok := ms.holders.Load(h)
		if !ok {
			if !create {
				return nil
			}
			ms.mu.Lock()
			if ms.dead {
				// Freed since it was loaded: a new state takes its place.
				ms.mu.Unlock()
				continue
			}
			hs, ok = ms.holders.Load(h)
			if !ok {
				// SetHolderCapacity updates holders under ms.mu too: it
				// either finds hs or stored the capacity read here.
				hs = newHolderState(ms, h, ix.capacityOf(h))
				ms.holders.Store(h, hs)
				list := *ms.list.Load()
				next := make([]*holderState, len(list), len(list)+1)
				copy(next, list)
				next = append(next, hs)
				ms.list.Store(&next)
			}
			ms.mu.Unlock()
		}
		hs.mu.Lock()
		if !hs.dead {
			return hs
		}
		hs.mu.Unlock()
	}
}

// Blocks is what one Store records: consecutive blocks of one chain that a
// holder holds in a tier for a KV cache group.
type Blocks struct {
	Model  string
	Holder Holder
	Tier   string
	Group  int
	// Parent is the key of the block before Keys[0] (ParentKey); the zero
	// Parent when Keys[0] starts a chain or its parent is unknown.
	Parent Parent
	// Keys are the blocks' keys in chain order. Blocks that are not
	// consecutive (a hybrid model's group that skips blocks) must be stored
	// one at a time without a parent, or lookups may count blocks in
	// between as held.
	Keys []uint64
}

// Parent is an optional parent key; the zero Parent is none. A value, not
// a pointer, so that passing one allocates nothing.
type Parent struct {
	key uint64
	ok  bool
}

// ParentKey is the Parent of a chain that continues from block key k.
func ParentKey(k uint64) Parent { return Parent{key: k, ok: true} }

// Key returns the parent's key, and false for none.
func (p Parent) Key() (uint64, bool) { return p.key, p.ok }

// Store records that b.Holder holds b.Keys. Store does not keep b.Keys.
// Storing a holding twice is harmless.
func (ix *Index) Store(b Blocks) {
	model, h, tier, group, keys := b.Model, b.Holder, b.Tier, b.Group, b.Keys
	if len(keys) == 0 {
		return
	}
	if tier == "" {
		ix.rejectedTier.Add(uint64(len(keys)))
		ix.logf(logTier, "index: store without tier dropped", "pod", h.Pod, "rank", h.Rank, "model", model, "blocks", len(keys))
		return
	}
	hs := ix.lockHolder(model, h, true)
	defer hs.mu.Unlock()
	ti, ts := hs.tier(tier, true)
	if ts == nil {
		ix.rejectedTier.Add(uint64(len(keys)))
		ix.logf(logTier, "index: too many tiers, store dropped", "pod", h.Pod, "rank", h.Rank, "model", model, "tier", tier, "blocks", len(keys))
		return
	}
	var added int64
	if ts.guess {
		ix.storeGuesses(b, hs, ti, ts)
		ix.stored.Add(uint64(len(keys)))
		hs.publish()
		return
	}
	if hs.ms.layer.active() || ix.share > 0 && !b.Parent.ok && len(hs.ms.rootHolders(keys[0])) >= ix.share-1 {
		added = ix.storeShared(b, hs, ti, ts)
	} else {
		t := ts.tab.Load()
		if !t.fits(len(keys) + 1) {
			t = hs.rehash(ti, len(keys)+1, false)
		}
		prev := -1
		if parent, ok := b.Parent.Key(); ok {
			if prev = t.find(parent); prev < 0 {
				prev = t.insert(parent, 0)
				hs.rootAdded(ti, parent)
			}
		}
		bit := groupBit(group)
		hs.sink += t.prefetch(keys)
		for _, k := range keys {
			i, found := t.probe(k)
			if !found && prev >= 0 && bit != metaExtGroup {
				// The common case, inline: a new block continuing its
				// chain, published held at once.
				pm := t.slots[prev].loadMeta()
				if !held(pm) {
					ts.addGap(t, t.slots[prev].loadKey(), pm)
				}
				t.put(i, k, anchoredMeta(prev, pm)|bit)
				ts.addChild(t, prev)
				ts.live++
				hs.push(ti, i)
				added++
				prev = i
				continue
			}
			var ok bool
			if prev, ok = hs.storeSlot(t, ts, ti, prev, i, k, group); ok {
				added++
			}
		}
	}
	ix.stored.Add(uint64(len(keys)))
	if added > 0 {
		hs.live.Add(added)
		ix.total.Add(added)
		ix.enforce(model, hs)
	}
	hs.publish()
}

// storeGuesses stores b in TierSpeculative's table ts. Guesses are
// bounded by their Speculative, which removes every one it stored: they
// stay out of the holder's eviction queue, capacity and the total budget,
// so that a guess never evicts a block an engine reported, and never move
// to the layer.
func (ix *Index) storeGuesses(b Blocks, hs *holderState, ti int, ts *tierState) {
	t := ts.tab.Load()
	if !t.fits(len(b.Keys) + 1) {
		t = hs.rehash(ti, len(b.Keys)+1, false)
	}
	prev := -1
	if parent, ok := b.Parent.Key(); ok {
		if prev = t.find(parent); prev < 0 {
			prev = t.insert(parent, 0)
			hs.rootAdded(ti, parent)
		}
	}
	for _, k := range b.Keys {
		i, _ := t.probe(k)
		prev, _ = hs.storeSlot(t, ts, ti, prev, i, k, b.Group)
	}
}

// storeSlot stores key k, for group, in slot i of t (tier ti, ts): the
// slot probe found for it, free or k's. prev is the slot of k's parent
// (-1: none). It returns k's slot and whether the holding is new.
func (hs *holderState) storeSlot(t *table, ts *tierState, ti, prev, i int, k uint64, group int) (int, bool) {
	bit := groupBit(group)
	if t.slots[i].loadMeta() == 0 {
		var m uint64
		if prev >= 0 {
			pm := t.slots[prev].loadMeta()
			if !held(pm) && bit != metaExtGroup {
				ts.addGap(t, t.slots[prev].loadKey(), pm)
			}
			m = anchoredMeta(prev, pm)
		} else {
			hs.rootAdded(ti, k)
		}
		if bit != metaExtGroup {
			// The common case: a new block, published held at once.
			t.put(i, k, m|bit)
			if prev >= 0 {
				ts.addChild(t, prev)
			}
			ts.live++
			if !ts.guess {
				hs.push(ti, i)
			}
			return i, true
		}
		t.put(i, k, m)
	}
	if ts.addGroup(t, i, k, group) {
		if !ts.guess {
			hs.push(ti, i)
		}
		return i, true
	}
	return i, false
}

// enforce evicts past hs's capacity and the total budget. hs is locked.
func (ix *Index) enforce(model string, hs *holderState) {
	if c := hs.capacity.Load(); c > 0 {
		if over := hs.live.Load() - c; over > 0 {
			n := hs.evict(over)
			ix.total.Add(-n)
			ix.evictedCapacity.Add(uint64(n))
			ix.logf(logCapacity, "index: holder over capacity, oldest blocks evicted", "pod", hs.h.Pod, "rank", hs.h.Rank, "model", model, "capacity", c, "evicted", n)
		}
	}
	if ix.budget < 0 {
		return
	}
	over := ix.total.Load() - ix.budget
	if ix.cfg.MemoryBytes > 0 {
		over += ix.shared.Load()*sharedBlockHoldings + ix.modelBytes.Load()/HolderBlockBytes
	}
	if over <= 0 {
		return
	}
	// Evict a little more than needed so that a full index does not scan
	// for a victim on every store.
	over += min(1024, ix.budget/256)
	victim := ix.largest()
	if victim != hs {
		if victim == nil || !victim.mu.TryLock() {
			victim = hs
		} else {
			defer victim.mu.Unlock()
			if victim.dead {
				return
			}
		}
	}
	n := victim.evict(over)
	victim.publish()
	ix.total.Add(-n)
	ix.evictedBudget.Add(uint64(n))
	ix.logf(logBudget, "index: over budget, oldest blocks of largest holder evicted", "pod", victim.h.Pod, "rank", victim.h.Rank, "budget", ix.budget, "evicted", n)
}

func (ix *Index) largest() *holderState {
	var best *holderState
	var most int64 = -1
	ix.models.Range(func(_ string, ms *modelState) bool {
		for _, hs := range *ms.list.Load() {
			if n := hs.live.Load(); n > most {
				best, most = hs, n
			}
		}
		return true
	})
	return best
}

// Remove records that h no longer holds keys in tier for group. Blocks it
// does not hold are ignored.
func (ix *Index) Remove(model string, h Holder, tier string, group int, keys []uint64) {
	if len(keys) == 0 {
		return
	}
	hs := ix.lockHolder(model, h, false)
	if hs == nil {
		return
	}
	defer hs.mu.Unlock()
	_, ts := hs.tier(tier, false)
	if ts == nil {
		return
	}
	t := ts.tab.Load()
	hs.sink += t.prefetch(keys)
	slots := hs.scratch[:0]
	var n int64
	ly, lane := hs.ms.layer, -1
	var id uint32
	if v := hs.lid.Load(); v != 0 && ly.active() {
		lane, id = ly.laneOf(tier), v-1
	}
	// The layer's mutex is taken at the first block hs holds there, and
	// only then: hs's layer holdings change only under hs's mutex, so
	// finding them needs no other.
	locked := false
	// A chain listed parent first is removed child first, so that no
	// block is briefly a gap: gaps make concurrent lookups search again.
	chained := true
	for j, k := range keys {
		if lane >= 0 {
			if en, e := ly.find(k); en != nil && en.lanes[lane].has(id) {
				if !locked {
					ly.mu.Lock()
					locked = true
				}
				if hs.removeLaneGroup(ly, e, lane, group) {
					n++
				}
				slots = append(slots, -1)
				chained = false
				continue
			}
		}
		i := t.find(k)
		slots = append(slots, int32(i))
		if j > 0 && (i < 0 || parentOf(t.slots[i].loadMeta()) != int(slots[j-1])) {
			chained = false
		}
	}
	if locked {
		ly.mu.Unlock()
	}
	hs.scratch = slots
	for j := range slots {
		if chained {
			j = len(slots) - 1 - j
		}
		if i := int(slots[j]); i >= 0 && ts.removeGroup(t, i, keys[j], group) {
			n++
		}
	}
	if n > 0 {
		if !ts.guess {
			hs.live.Add(-n)
			ix.total.Add(-n)
		}
		ix.removed.Add(uint64(n))
		hs.maybeCompact()
		hs.publish()
	}
}

// ClearHolder drops everything h holds for model in tier, or in every tier
// when tier is empty (vLLM's AllBlocksCleared).
func (ix *Index) ClearHolder(model string, h Holder, tier string) {
	hs := ix.lockHolder(model, h, false)
	if hs == nil {
		return
	}
	defer hs.mu.Unlock()
	var n, guesses int64
	tiers := hs.tierList()
	gone := make([]bool, len(tiers))
	for ti, ts := range tiers {
		if tier != "" && ts.name != tier {
			continue
		}
		gone[ti] = true
		if ts.guess {
			guesses += ts.live
		} else {
			n += ts.live
		}
	}
	var goneLane [layerLanes]bool
	if hs.lid.Load() != 0 {
		ly := hs.ms.layer
		ly.mu.Lock()
		for l := range goneLane {
			name := ly.laneName(l)
			goneLane[l] = name != "" && (tier == "" || name == tier)
		}
		n += hs.dropTiers(gone, &goneLane)
		ly.mu.Unlock()
	} else {
		hs.dropTiers(gone, &goneLane)
	}
	tabs := make([]*table, len(tiers))
	for ti, ts := range tiers {
		if gone[ti] {
			tabs[ti] = ts.tab.Load()
			ts.tab.Store(newTable(minTableSize))
			ts.ext, ts.childOver, ts.gaps = nil, nil, nil
			ts.live, ts.migrated, ts.migratedKept = 0, 0, 0
		}
	}
	hs.dropRoots(tabs, gone, false)
	hs.live.Add(-n)
	ix.total.Add(-n)
	ix.cleared.Add(uint64(n + guesses))
	hs.publish()
}

// RemoveHolder forgets h in every model, e.g. when its pod is gone. A
// model left with no holder is freed.
func (ix *Index) RemoveHolder(h Holder) { ix.removeHolder(h, "", false) }

// RemoveHolderExcept forgets h in every model but keep: what a snapshot
// brought in for a holder whose engine now publishes keep.
func (ix *Index) RemoveHolderExcept(h Holder, keep string) { ix.removeHolder(h, keep, true) }

func (ix *Index) removeHolder(h Holder, keep string, except bool) {
	ix.models.Range(func(name string, ms *modelState) bool {
		if except && name == keep {
			return true
		}
		ms.mu.Lock()
		hs, ok := ms.holders.LoadAndDelete(h)
		if ok {
			ix.unlist(name, ms, hs)
		}
		ms.mu.Unlock()
		if ok {
			hs.mu.Lock()
			hs.dead = true
			tabs, gone := hs.everyTable()
			if hs.lid.Load() != 0 {
				// Its layer holdings go, and then its id there.
				ly := ms.layer
				ly.mu.Lock()
				hs.dropTiers(gone, &allLanes)
				ly.releaseID(hs)
				ly.mu.Unlock()
			}
			hs.dropRoots(tabs, gone, true)
			n := hs.live.Load()
			hs.live.Store(0)
			ix.total.Add(-n)
			ix.cleared.Add(uint64(n))
			hs.mu.Unlock()
		}
		return true
	})
}

// unlist takes hs out of ms's list, once hs has left ms.holders, and
// frees ms when no holder is left. ms.mu is held.
func (ix *Index) unlist(name string, ms *modelState, hs *holderState) {
	list := *ms.list.Load()
	next := make([]*holderState, 0, len(list))
	for _, x := range list {
		if x != hs {
			next = append(next, x)
		}
	}
	ms.list.Store(&next)
	if len(next) == 0 {
		// A model nobody holds is freed (a made-up model name costs
		// nothing once its holders are gone); under mu, so that no
		// holder is made in it meanwhile.
		ms.dead = true
		ix.models.Compute(name, func(cur *modelState, loaded bool) (*modelState, xsync.ComputeOp) {
			if !loaded || cur != ms {
				return cur, xsync.CancelOp
			}
			ix.modelBytes.Add(-(modelStateBytes + int64(len(name))))
			return cur, xsync.DeleteOp
		})
	}
}

// knows reports whether the index keeps state for h under model.
func (ix *Index) knows(model string, h Holder) bool {
	ms := ix.model(model, false)
	if ms == nil {
		return false
	}
	_, ok := ms.holders.Load(h)
	return ok
}

// holdsReal reports whether h holds a block for model outside
// TierSpeculative.
func (ix *Index) holdsReal(model string, h Holder) bool {
	ms := ix.model(model, false)
	if ms == nil {
		return false
	}
	hs, ok := ms.holders.Load(h)
	return ok && (hs.live.Load() != 0 || hs.lid.Load() != 0)
}

// everyTable returns hs's tables, each marked gone, for a holder that goes
// whole. hs.mu is held.
func (hs *holderState) everyTable() (tabs []*table, gone []bool) {
	tiers := hs.tierList()
	tabs = make([]*table, len(tiers))
	gone = make([]bool, len(tiers))
	for ti, ts := range tiers {
		tabs[ti], gone[ti] = ts.tab.Load(), true
	}
	return tabs, gone
}

// forgetGuesser forgets h under model when it holds nothing outside
// TierSpeculative: a holder Speculative made for a destination no engine
// has reported from, once its last entry is gone. Left, it would be listed
// by HolderList and searched by every lookup of its guessed prompts.
func (ix *Index) forgetGuesser(model string, h Holder) {
	hs := ix.lockHolder(model, h, false)
	if hs == nil {
		return
	}
	if hs.live.Load() != 0 || hs.lid.Load() != 0 {
		hs.mu.Unlock()
		return
	}
	// Dead first, so that a writer waiting for hs makes a new state
	// rather than write to this one once it is unlisted.
	hs.dead = true
	tabs, gone := hs.everyTable()
	hs.dropRoots(tabs, gone, true)
	hs.mu.Unlock()
	ms := hs.ms
	ms.mu.Lock()
	if cur, ok := ms.holders.Load(h); ok && cur == hs {
		ms.holders.Delete(h)
		ix.unlist(model, ms, hs)
	}
	ms.mu.Unlock()
}

// SetHolderCapacity sets h's capacity in blocks per model, overriding
// Config.HolderCapacity (0 removes the limit). It applies at h's next store.
func (ix *Index) SetHolderCapacity(h Holder, blocks int) {
	// Serialised, so that concurrent calls leave every model's holder with
	// the capacity the last one stored.
	ix.capMu.Lock()
	defer ix.capMu.Unlock()
	ix.caps.Store(h, int64(blocks))
	ix.models.Range(func(_ string, ms *modelState) bool {
		ms.mu.Lock()
		if hs, ok := ms.holders.Load(h); ok {
			hs.capacity.Store(int64(blocks))
		}
		ms.mu.Unlock()
		return true
	})
}

// HolderBlocks returns how many blocks h holds for model in each tier.
func (ix *Index) HolderBlocks(model string, h Holder) map[string]int {
	out := make(map[string]int)
	ms := ix.model(model, false)
	if ms == nil {
		return out
	}
	hs, ok := ms.holders.Load(h)
	if !ok {
		return out
	}
	for _, ts := range hs.tierList() {
		if n := ts.held.Load(); n > 0 {
			out[ts.name] = int(n)
		}
	}
	if hs.lid.Load() != 0 {
		for l := range hs.laneHeld {
			if n := hs.laneHeld[l].Load(); n > 0 {
				out[ms.layer.laneName(l)] += int(n)
			}
		}
	}
	return out
}

// Budget returns the most holdings the index keeps over all holders and
// models, from Config.MaxHolderBlocks and Config.MemoryBytes; negative when
// there is no budget.
func (ix *Index) Budget() int64 { return ix.budget }

// Stats returns the index's counters.
func (ix *Index) Stats() Stats {
	s := Stats{
		HolderBlocks:    ix.total.Load(),
		Stored:          ix.stored.Load(),
		Removed:         ix.removed.Load(),
		Cleared:         ix.cleared.Load(),
		EvictedCapacity: ix.evictedCapacity.Load(),
		EvictedBudget:   ix.evictedBudget.Load(),
		RejectedTier:    ix.rejectedTier.Load(),
		SharedBlocks:    ix.shared.Load(),
	}
	ix.models.Range(func(_ string, ms *modelState) bool {
		if n := len(*ms.list.Load()); n > 0 {
			s.Models++
			s.Holders += n
		}
		return true
	})
	return s
}
