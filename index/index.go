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
// Config.MaxHolderBlocks nor Config.MemoryBytes is set: about 2.7 GiB of
// index at HolderBlockBytes a holding.
const DefaultMaxHolderBlocks = 64 << 20

// HolderBlockBytes is what one (block, tier) holding costs the index in
// memory at worst in steady state, a holder that keeps replacing blocks
// no other holder holds: the block's entry, its key's slot at the lowest
// occupancy a shard's table keeps (3/8 after it doubles, 3/16 at worst),
// and an eviction-queue item of its own (a store of consecutive new blocks
// shares one), all as many times again as ghosts may add (a quarter, see
// holderState.maybeCompact). It is computed from the layout, so that it
// follows it; Config.MemoryBytes is turned into a holding budget with it
// (see memoryBudget), and TestMemoryBytesBoundsTheLiveHeapAtTheCap checks
// it against the heap.
const HolderBlockBytes = (int64(unsafe.Sizeof(entry{})) + 4*16/3 + 8) * (ghostDen + ghostNum) / ghostDen

// setBlockHoldings is what Config.MemoryBytes counts a block with two or
// more holders beyond their holdings: its set's slot, the set and its
// array or bitsets, in holdings.
const setBlockHoldings = (8 + int64(unsafe.Sizeof(holderSet{})) + 2*16 + HolderBlockBytes - 1) / HolderBlockBytes

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
	// tables may double it. A block two or more holders hold counts as a
	// few holdings more than its holders' own (its holder set), and each
	// model's state as about 9 KiB of holdings (a model is freed with its
	// last holder).
	MemoryBytes int64
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

	RejectedTier    uint64 // stores dropped for an empty tier or too many tiers
	RejectedHolders uint64 // stores dropped for a holder past a model's 16,777,216

	SharedBlocks int64 // blocks two or more holders hold (each block is kept once)
}

// Index maps, per model, block keys to the holders that hold them and in
// which tier. See the package documentation for the concurrency contract.
type Index struct {
	cfg    Config
	budget int64
	log    *slog.Logger

	models *xsync.Map[string, *modelState]
	caps   *xsync.Map[Holder, int64]
	capMu  sync.Mutex // serialises SetHolderCapacity
	total  atomic.Int64
	shared atomic.Int64 // entries with a holder set, over all models
	// modelBytes is what the model states cost, modelStateBytes and the
	// name each: with MemoryBytes, they count in the budget.
	modelBytes atomic.Int64

	stored, removed, cleared       atomic.Uint64
	evictedCapacity, evictedBudget atomic.Uint64
	rejectedTier, rejectedHolders  atomic.Uint64

	logs [logKinds]ratelog.Gate
}

// modelStateBytes is what one model's state costs with its first
// holder's, their holdings and the model's name aside, measured by
// TestModelStatesCountInTheMemoryBudget. A peer naming a new model per
// message would otherwise grow the index past MemoryBytes with no holding
// to evict. (A model's further holders are bounded by the holders a
// processor follows, events.Config.MaxHolders.)
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
	return ix
}

const (
	logTier = iota
	logHolder
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
		return newModelState(&ix.shared), false
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
// is set; nil when absent, or when the model has no holder id left.
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
				if hs = ms.newHolder(h, ix.capacityOf(h)); hs == nil {
					ms.mu.Unlock()
					return nil
				}
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

// newHolder makes h's state, with an id. ms.mu is held.
func (ms *modelState) newHolder(h Holder, capacity int64) *holderState {
	var id uint32
	if n := len(ms.freeIDs); n > 0 {
		id = ms.freeIDs[n-1]
		ms.freeIDs = ms.freeIDs[:n-1]
	} else {
		if ms.nextID > maxHolderID {
			return nil
		}
		id = ms.nextID
		ms.nextID++
	}
	hs := &holderState{ms: ms, h: h, id: id, born: ms.releases.Load(), guess: -1}
	hs.lanes.Store(&laneList{})
	hs.capacity.Store(capacity)
	ms.reg.set(id, &holderRef{h: h, born: hs.born, lanes: hs.lanes.Load(), hs: hs})
	ms.holders.Store(h, hs)
	list := *ms.list.Load()
	next := make([]*holderState, len(list), len(list)+1)
	copy(next, list)
	next = append(next, hs)
	ms.list.Store(&next)
	return hs
}

// releaseID frees hs's id, once hs has no bit left in any entry. ms.mu is
// held.
func (ms *modelState) releaseID(hs *holderState) {
	ms.reg.set(hs.id, nil)
	ms.releases.Add(1)
	ms.freeIDs = append(ms.freeIDs, hs.id)
}

// Blocks is what one Store records: consecutive blocks of one chain that a
// holder holds in a tier for a KV cache group.
type Blocks struct {
	Model  string
	Holder Holder
	Tier   string
	Group  int
	// Parent is the key of the block before Keys[0] (ParentKey); the zero
	// Parent when Keys[0] starts a chain or its parent is unknown. The
	// index keeps every block by its key, so it needs no parent: Parent
	// is what engines report, kept in the API for callers that pass it on.
	Parent Parent
	// Keys are the blocks' keys in chain order.
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
	if hs == nil {
		ix.rejectedHolders.Add(uint64(len(keys)))
		ix.logf(logHolder, "index: model has no holder id left, store dropped", "pod", h.Pod, "rank", h.Rank, "model", model, "blocks", len(keys))
		return
	}
	defer hs.mu.Unlock()
	lane := hs.lane(tier, true)
	if lane < 0 {
		ix.rejectedTier.Add(uint64(len(keys)))
		ix.logf(logTier, "index: too many tiers, store dropped", "pod", h.Pod, "rank", h.Rank, "model", model, "tier", tier, "blocks", len(keys))
		return
	}
	ms := hs.ms
	ids := ms.resolve(keys, hs.scratch[:0], hs.heldWord(lane))
	hs.scratch = ids
	q, ghosts := hs.queueOf(lane)
	var added int64
	for j, k := range keys {
		id, old := ms.hold(hs, ids[j], k, lane)
		held := old&laneBit(lane) != 0
		if group != 0 || len(hs.groups) > 0 {
			hs.addGroup(id, lane, group, held)
		}
		if held {
			continue
		}
		if old&ghostBit(lane) != 0 {
			// Stored again before its queue dropped it: it keeps its place.
			*ghosts--
		} else {
			q.push(id, lane)
		}
		added++
	}
	ix.stored.Add(uint64(len(keys)))
	hs.held[lane].Add(added)
	if added > 0 && lane != hs.guess {
		hs.live.Add(added)
		ix.total.Add(added)
		ix.enforce(model, hs)
	}
}

// freshBit marks an id resolve made, published with its first holding.
// Entry ids stay below it: 2^31 entries would be 32 GiB of arena.
const freshBit = 1 << 31

// heldWord is the holder word of a block hs alone holds, in lane.
func (hs *holderState) heldWord(lane int) uint64 {
	return kindOne | mkElem(hs.id, laneBit(lane))<<oneShift
}

// hold stores (the block of) key in lane for hs at id, which resolve gave,
// and returns its id and hs's bits there before.
func (ms *modelState) hold(hs *holderState, id uint32, key uint64, lane int) (uint32, uint64) {
	for {
		if id&freshBit != 0 {
			return id &^ freshBit, 0
		}
		if old, ok := ms.update(hs, id, key, lane, opStore); ok {
			return id, old
		}
		// Freed since it was found: its last holder left it.
		id = ms.resolve([]uint64{key}, hs.scratch[len(hs.scratch):], hs.heldWord(lane))[0]
	}
}

// resolve appends to dst the entry ids of keys, making entries for those
// that have none, published with the holder word init and marked with
// freshBit.
func (ms *modelState) resolve(keys []uint64, dst []uint32, init uint64) []uint32 {
	base := len(dst)
	missing := 0
	id := tomb
	for _, k := range keys {
		var en *entry
		if id, en = ms.follow(id, k); en == nil {
			id = tomb
			missing++
		}
		dst = append(dst, id)
	}
	if missing == 0 {
		return dst
	}
	fresh := make([]uint64, 0, missing)
	for j, k := range keys {
		if dst[base+j] == tomb {
			fresh = append(fresh, k)
		}
	}
	made := ms.allocEntries(fresh, make([]uint32, 0, missing))
	i := 0
	for j, k := range keys {
		if dst[base+j] != tomb {
			continue
		}
		id, ok := ms.insert(k, made[i])
		if ok {
			ms.entry(id).unlock(init)
			id |= freshBit
		} else {
			// Another writer made k's entry meanwhile (or k came twice).
			ms.releaseEntry(made[i])
		}
		dst[base+j] = id
		i++
	}
	return dst
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
		over += ix.shared.Load()*setBlockHoldings + ix.modelBytes.Load()/HolderBlockBytes
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
	lane := hs.lane(tier, false)
	if lane < 0 {
		return
	}
	ms := hs.ms
	_, ghosts := hs.queueOf(lane)
	var n int64
	plain := group == 0 && len(hs.groups) == 0
	id := tomb
	for _, k := range keys {
		var en *entry
		if id, en = ms.follow(id, k); en == nil {
			continue
		}
		if plain {
			// Group 0 of holdings of group 0 alone: the write says
			// whether there was one.
			old, ok := ms.update(hs, id, k, lane, opRemove)
			if !ok {
				// The entry left k meanwhile: ask the key table.
				if id, en = ms.findEntry(k); en == nil {
					continue
				}
				old, _ = ms.update(hs, id, k, lane, opRemove)
			}
			if old&laneBit(lane) != 0 {
				*ghosts++
				n++
			}
			continue
		}
		b, ok := ms.ownBits(hs, id, k)
		if !ok {
			if id, en = ms.findEntry(k); en == nil {
				continue
			}
			b, ok = ms.ownBits(hs, id, k)
		}
		if !ok || b&laneBit(lane) == 0 || !hs.removeGroup(id, lane, group) {
			continue
		}
		ms.update(hs, id, k, lane, opRemove)
		*ghosts++
		n++
	}
	if n == 0 {
		return
	}
	hs.held[lane].Add(-n)
	if lane != hs.guess {
		hs.live.Add(-n)
		ix.total.Add(-n)
	}
	ix.removed.Add(uint64(n))
	hs.maybeCompact(lane)
}

// ClearHolder drops everything h holds for model in tier, or in every tier
// when tier is empty (vLLM's AllBlocksCleared).
func (ix *Index) ClearHolder(model string, h Holder, tier string) {
	hs := ix.lockHolder(model, h, false)
	if hs == nil {
		return
	}
	defer hs.mu.Unlock()
	mask := uint8(0xFF)
	if tier != "" {
		lane := hs.lane(tier, false)
		if lane < 0 {
			return
		}
		mask = 1 << lane
	}
	n, guesses := hs.clearLanes(mask)
	ix.total.Add(-n)
	ix.cleared.Add(uint64(n + guesses))
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
		ms.mu.Unlock()
		if ok {
			hs.mu.Lock()
			hs.dead = true
			n, _ := hs.clearLanes(0xFF)
			hs.mu.Unlock()
			ix.total.Add(-n)
			ix.cleared.Add(uint64(n))
			ms.mu.Lock()
			ms.releaseID(hs)
			ix.unlist(name, ms, hs)
			ms.mu.Unlock()
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
	return ok && hs.live.Load() != 0
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
	if hs.live.Load() != 0 {
		hs.mu.Unlock()
		return
	}
	// Dead first, so that a writer waiting for hs makes a new state
	// rather than write to this one once it is unlisted.
	hs.dead = true
	hs.clearLanes(0xFF)
	hs.mu.Unlock()
	ms := hs.ms
	ms.mu.Lock()
	if cur, ok := ms.holders.Load(h); ok && cur == hs {
		ms.holders.Delete(h)
		ms.releaseID(hs)
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
	for l, name := range hs.laneNames() {
		if n := hs.held[l].Load(); n > 0 {
			out[name] = int(n)
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
		RejectedHolders: ix.rejectedHolders.Load(),
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
