package index

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/puzpuzpuz/xsync/v4"
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
)

// SpeculativeConfig configures a Speculative.
type SpeculativeConfig struct {
	// TTL is how long an entry stays unless the engine's own events
	// replace it first; zero: DefaultSpeculativeTTL.
	TTL time.Duration
	// MaxBytes bounds the entries kept, 8 bytes a block plus 64 an entry;
	// past it the oldest are removed first. Zero: DefaultSpeculativeBytes.
	MaxBytes int64
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

// Speculative keeps an Index's speculative entries: Record adds them in
// TierSpeculative, they expire after the TTL (Expire, or Run), and they give
// way to the engine's own events. Speculative is also the Sink to feed the
// index through (events.Sink, events.HolderRemover): a block the engine
// stores or evicts in a real tier leaves the speculative tier of its holder,
// so that an entry is counted once and an evicted block is not kept alive
// by a guess. Safe for concurrent use; lookups stay the Index's, lock-free.
type Speculative struct {
	ix  *Index
	cfg SpeculativeConfig

	mu    sync.Mutex // guards queue and bytes
	queue []specEntry
	head  int
	bytes int64
	// holding counts the queued entries of each holder and model, so that
	// the engine's events pay for the speculative tier only for holders
	// that have entries in it.
	holding *xsync.Map[HolderModel, int]

	recorded, expired, replaced atomic.Uint64
}

type specEntry struct {
	hm   HolderModel
	keys []uint64
	at   time.Time
}

const specEntryOverhead = 64

// SpeculativeStats are a Speculative's counters.
type SpeculativeStats struct {
	Recorded uint64 // Record calls that added entries
	Expired  uint64 // entries removed for their TTL or the byte bound
	Replaced uint64 // real stores or removals that took blocks out of the speculative tier
	Entries  int    // entries kept now
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
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Speculative{ix: ix, cfg: cfg, holding: xsync.NewMap[HolderModel, int]()}
}

// Record adds keys, a prompt's block keys from its first block, as
// speculative blocks of h for model, until the TTL passes or the engine's
// events replace them. It first drops expired entries.
func (s *Speculative) Record(model string, h Holder, keys []uint64) {
	if len(keys) == 0 {
		return
	}
	now := s.cfg.Now()
	hm := HolderModel{Model: model, Holder: h}
	cost := int64(8*len(keys) + specEntryOverhead)
	s.mu.Lock()
	if cost > s.cfg.MaxBytes {
		// Too large for the bound whole: not kept, and not at the
		// others' expense.
		s.expireLocked(now, 0)
		s.mu.Unlock()
		return
	}
	s.expireLocked(now, cost)
	s.queue = append(s.queue, specEntry{hm: hm, keys: append([]uint64(nil), keys...), at: now})
	s.bytes += cost
	s.holding.Compute(hm, func(n int, _ bool) (int, xsync.ComputeOp) { return n + 1, xsync.UpdateOp })
	s.mu.Unlock()
	s.ix.Store(Blocks{Model: model, Holder: h, Tier: TierSpeculative, Keys: keys})
	s.recorded.Add(1)
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
		s.ix.Remove(e.hm.Model, e.hm.Holder, TierSpeculative, 0, e.keys)
		s.bytes -= int64(8*len(e.keys) + specEntryOverhead)
		s.holding.Compute(e.hm, func(n int, _ bool) (int, xsync.ComputeOp) {
			if n <= 1 {
				return 0, xsync.DeleteOp
			}
			return n - 1, xsync.UpdateOp
		})
		*e = specEntry{}
		s.head++
		s.expired.Add(1)
	}
	if s.head > 0 && s.head*2 >= len(s.queue) {
		s.queue = append(s.queue[:0], s.queue[s.head:]...)
		s.head = 0
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
	return SpeculativeStats{Recorded: s.recorded.Load(), Expired: s.expired.Load(), Replaced: s.replaced.Load(),
		Entries: len(s.queue) - s.head, Bytes: s.bytes}
}

// Store stores b in the index; blocks of a real tier leave the holder's
// speculative tier.
func (s *Speculative) Store(b Blocks) {
	s.ix.Store(b)
	s.dropGuesses(b.Model, b.Holder, b.Tier, b.Keys)
}

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
