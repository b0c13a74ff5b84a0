package index

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/puzpuzpuz/xsync/v4"

	"github.com/kvsource/kvsource/internal/ratelog"
)

// TierSpeculative is the tier of blocks a router expects a holder to have
// soon: a request it just routed there, whose prefill has not yet produced
// the engine's KV events (seconds, for a long prompt). Scores count them, so
// that a burst of requests on a new prefix follows the first instead of
// spreading before any event arrives; they are never a pull source (they
// are in no picker.Config.PullTiers), since the blocks do not exist yet.
const TierSpeculative = "speculative"

// Defaults of SpeculativeConfig.
const (
	// DefaultSpeculativeTTL is llm-d's speculativeTTL default.
	DefaultSpeculativeTTL = 2 * time.Second
	// DefaultSpeculativeBytes bounds the speculative entries kept.
	DefaultSpeculativeBytes = 16 << 20
	// DefaultSpeculativeHolders bounds the holders speculative entries
	// make: destinations the index knew nothing of.
	DefaultSpeculativeHolders = 1024
)

// SpeculativeConfig configures a Speculative.
type SpeculativeConfig struct {
	// TTL is how long an entry stays unless the engine evicts its blocks
	// first; zero: DefaultSpeculativeTTL. A key stays while the newest
	// entry holding it does.
	TTL time.Duration
	// MaxBytes bounds the entries kept, at SpeculativeBlockBytes a block
	// no other entry of its holder has plus 8 a block and 64 an entry;
	// past it the oldest are removed first. Zero: DefaultSpeculativeBytes.
	MaxBytes int64
	// MaxHolders bounds the holders with entries that the index kept no
	// state for when their first entry came: a destination no engine has
	// reported from, which the entries make a holder of until the last
	// expires. A Record that would make one more is refused. Zero:
	// DefaultSpeculativeHolders.
	MaxHolders int
	// Now is the clock; nil: time.Now.
	Now func() time.Time
	// Logger receives refused records at debug level, at most once a
	// second. Nil means slog.Default().
	Logger *slog.Logger
}

// Speculative keeps an Index's speculative entries: Record adds them in
// TierSpeculative, they expire after the TTL (Expire, or Run), and an
// engine's eviction of a block removes its guess. Speculative is also the
// Sink to feed the index through (events.Sink, events.HolderRemover): a
// block the engine removes from a real tier leaves the speculative tier of
// its holder, so that an evicted block is not kept alive by a guess.
// Blocks the engine stores stay guessed beside it until their entries
// expire, as upstream's speculative entries do, so that a prompt whose
// prefill is under way weighs the same as one that is all guesses.
// Guesses are in no holder's capacity nor the index's budget: MaxBytes
// bounds them. Safe for concurrent use; lookups stay the Index's,
// lock-free.
type Speculative struct {
	ix  *Index
	cfg SpeculativeConfig
	log *slog.Logger

	// mu guards queue, bytes, made, gone and the holders' refs; it is
	// held across the index writes of Record and expiry, so that an entry
	// removed is never stored after its removal.
	mu    sync.Mutex
	queue []specEntry
	head  int
	bytes int64
	made  int      // holders of holding the entries made (specHolder.made)
	gone  []uint64 // expiry's scratch: keys no entry holds any more
	// holding has the holders with entries; written under mu, read
	// without it by the engine's events, which pay for the speculative
	// tier only for holders that have entries in it.
	holding *xsync.Map[HolderModel, *specHolder]

	recorded, expired, replaced, refused atomic.Uint64
	refusedLog                           ratelog.Gate
}

// specHolder is one holder's entries under one model.
type specHolder struct {
	entries int
	// made is set when the index kept no state for the holder at an
	// entry: the holder is forgotten with its last. Set under mu, read
	// without it by OnlyGuesses.
	made atomic.Bool
	// refs counts the entries holding each key, so that a key stays while
	// a newer entry holds it.
	refs map[uint64]uint32
}

type specEntry struct {
	hm   HolderModel
	sh   *specHolder
	keys []uint64
	at   time.Time
}

const (
	specEntryOverhead = 64
	// SpeculativeBlockBytes is what a guessed block costs beyond the 8
	// bytes of its key in its entry: its reference count (a map entry)
	// and its holding in the index, as a holding of a block of its own.
	SpeculativeBlockBytes = 32 + HolderBlockBytes
)

// specCost is the cost of an entry of n keys of which fresh were held by
// no other entry of its holder.
func specCost(n, fresh int) int64 {
	return specEntryOverhead + 8*int64(n) + SpeculativeBlockBytes*int64(fresh)
}

// SpeculativeStats are a Speculative's counters.
type SpeculativeStats struct {
	Recorded uint64 // Record calls that added entries
	Refused  uint64 // Record calls refused: past MaxHolders, or larger than MaxBytes
	Expired  uint64 // entries removed for their TTL or the byte bound
	Replaced uint64 // engine stores that confirmed a guess, and removals that took guesses out
	Entries  int    // entries kept now
	Holders  int    // holders the entries made (see MaxHolders)
	Bytes    int64  // their bytes
}

// NewSpeculative returns the speculative entries of ix.
func NewSpeculative(ix *Index, cfg SpeculativeConfig) *Speculative {
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultSpeculativeTTL
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultSpeculativeBytes
	}
	if cfg.MaxHolders <= 0 {
		cfg.MaxHolders = DefaultSpeculativeHolders
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	s := &Speculative{ix: ix, cfg: cfg, log: cfg.Logger, holding: xsync.NewMap[HolderModel, *specHolder]()}
	if s.log == nil {
		s.log = slog.Default()
	}
	return s
}

// Record adds keys, a prompt's block keys from its first block, as
// speculative blocks of h for model, until the TTL passes or the engine
// evicts them. It first drops expired entries. A record that
// would make h a holder past MaxHolders, or is larger than MaxBytes on
// its own, is refused: counted and logged, not kept.
func (s *Speculative) Record(model string, h Holder, keys []uint64) {
	if len(keys) == 0 {
		return
	}
	now := s.cfg.Now()
	hm := HolderModel{Model: model, Holder: h}
	need := specCost(len(keys), len(keys))
	s.mu.Lock()
	defer s.mu.Unlock()
	if need > s.cfg.MaxBytes {
		// Too large for the bound whole: not kept, and not at the
		// others' expense.
		s.expireLocked(now, 0)
		s.refuse(hm, "larger than the speculative memory bound", len(keys))
		return
	}
	s.expireLocked(now, need)
	sh, ok := s.holding.Load(hm)
	if !ok {
		sh = &specHolder{refs: make(map[uint64]uint32, len(keys))}
	}
	// Asked again for a holder that has entries: the engine's pod may be
	// gone (RemoveHolder) since.
	if !sh.made.Load() && !s.ix.knows(model, h) {
		if s.made >= s.cfg.MaxHolders {
			s.refuse(hm, "too many destinations no engine reported from", len(keys))
			return
		}
		sh.made.Store(true)
		s.made++
	}
	if !ok {
		s.holding.Store(hm, sh)
	}
	sh.entries++
	fresh := 0
	for _, k := range keys {
		n := sh.refs[k]
		if n == 0 {
			fresh++
		}
		sh.refs[k] = n + 1
	}
	s.queue = append(s.queue, specEntry{hm: hm, sh: sh, keys: append([]uint64(nil), keys...), at: now})
	s.bytes += specCost(len(keys), fresh)
	s.ix.Store(Blocks{Model: model, Holder: h, Tier: TierSpeculative, Keys: keys})
	s.recorded.Add(1)
}

// refuse counts and logs a refused Record. s.mu is held.
func (s *Speculative) refuse(hm HolderModel, why string, blocks int) {
	s.refused.Add(1)
	if skipped, ok := s.refusedLog.Allow(time.Second); ok {
		s.log.Debug("index: speculative entry refused, "+why, "pod", hm.Holder.Pod, "rank", hm.Holder.Rank, "model", hm.Model,
			"blocks", blocks, "holders", s.made, "max_holders", s.cfg.MaxHolders, "bytes", s.bytes, "max_bytes", s.cfg.MaxBytes,
			"refused_since_last_line", skipped)
	}
}

// Expire removes the entries older than the TTL.
func (s *Speculative) Expire() {
	s.mu.Lock()
	s.expireLocked(s.cfg.Now(), 0)
	s.mu.Unlock()
}

// expireLocked removes the entries past the TTL at now, and the oldest
// until need more bytes fit the bound.
func (s *Speculative) expireLocked(now time.Time, need int64) {
	for s.head < len(s.queue) {
		e := &s.queue[s.head]
		if now.Sub(e.at) < s.cfg.TTL && s.bytes+need <= s.cfg.MaxBytes {
			break
		}
		s.drop(e)
		*e = specEntry{}
		s.head++
		s.expired.Add(1)
	}
	if s.head > 0 && s.head*2 >= len(s.queue) {
		s.queue = append(s.queue[:0], s.queue[s.head:]...)
		s.head = 0
	}
}

// drop removes e's keys that no newer entry of its holder holds from the
// index, and the holder with its last entry when the entries made it.
// s.mu is held.
func (s *Speculative) drop(e *specEntry) {
	sh := e.sh
	gone := s.gone[:0]
	for _, k := range e.keys {
		if n := sh.refs[k]; n > 1 {
			sh.refs[k] = n - 1
			continue
		}
		delete(sh.refs, k)
		gone = append(gone, k)
	}
	s.ix.Remove(e.hm.Model, e.hm.Holder, TierSpeculative, 0, gone)
	s.bytes -= specCost(len(e.keys), len(gone))
	s.gone = gone[:0]
	if sh.entries--; sh.entries > 0 {
		return
	}
	s.holding.Delete(e.hm)
	if sh.made.Load() {
		s.made--
		s.ix.forgetGuesser(e.hm.Model, e.hm.Holder)
	}
}

// Run expires entries every quarter TTL until ctx is done.
func (s *Speculative) Run(ctx context.Context) error {
	t := time.NewTicker(max(s.cfg.TTL/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			s.Expire()
		}
	}
}

// Stats returns the counters.
func (s *Speculative) Stats() SpeculativeStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return SpeculativeStats{Recorded: s.recorded.Load(), Refused: s.refused.Load(), Expired: s.expired.Load(),
		Replaced: s.replaced.Load(), Entries: len(s.queue) - s.head, Holders: s.made, Bytes: s.bytes}
}

// OnlyGuesses reports whether h's state under model is there only for
// speculative entries: the entries made it (see MaxHolders), and no engine
// has stored a block in it since. A snapshot saves nothing of such a
// holder.
func (s *Speculative) OnlyGuesses(model string, h Holder) bool {
	sh, ok := s.holding.Load(HolderModel{Model: model, Holder: h})
	return ok && sh.made.Load() && !s.ix.holdsReal(model, h)
}

// Store stores b in the index. A block stored in a real tier keeps its
// guess beside it until its entries expire, as upstream's does; a store
// whose first block was guessed counts as Replaced.
func (s *Speculative) Store(b Blocks) {
	s.ix.Store(b)
	if b.Tier == TierSpeculative || len(b.Keys) == 0 {
		return
	}
	if _, ok := s.holding.Load(HolderModel{Model: b.Model, Holder: b.Holder}); ok &&
		s.ix.Run(b.Model, b.Holder, b.Keys[:1], 0, specTiers) > 0 {
		s.replaced.Add(1)
	}
}

// specTiers is Run's tiers for the speculative tier alone.
var specTiers = []string{TierSpeculative}

// Remove removes keys from the index, and, for a real tier, from the
// holder's speculative tier: an engine that evicts a block it was guessed
// to have soon does not have it.
func (s *Speculative) Remove(model string, h Holder, tier string, group int, keys []uint64) {
	s.ix.Remove(model, h, tier, group, keys)
	s.dropGuesses(model, h, tier, keys)
}

func (s *Speculative) dropGuesses(model string, h Holder, tier string, keys []uint64) {
	if tier == TierSpeculative || len(keys) == 0 {
		return
	}
	if _, ok := s.holding.Load(HolderModel{Model: model, Holder: h}); !ok {
		return
	}
	s.ix.Remove(model, h, TierSpeculative, 0, keys)
	s.replaced.Add(1)
}

// ClearHolder clears h's entries in tier ("" for every tier, the
// speculative one included).
func (s *Speculative) ClearHolder(model string, h Holder, tier string) {
	s.ix.ClearHolder(model, h, tier)
}

// RemoveHolder removes h from the index, speculative entries included.
func (s *Speculative) RemoveHolder(h Holder) { s.ix.RemoveHolder(h) }

// RemoveHolderExcept is Index.RemoveHolderExcept (events.HolderPruner).
func (s *Speculative) RemoveHolderExcept(h Holder, keep string) { s.ix.RemoveHolderExcept(h, keep) }
