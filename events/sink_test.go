package events

import (
	"maps"
	"slices"
	"sync"

	"github.com/kvsource/kvsource/index"
)

var _ Sink = (*index.Index)(nil)

// recSink is a brute-force model of the index: the set of keys each
// (model, holder, tier) holds, plus a log of clears.
type recSink struct {
	mu     sync.Mutex
	blocks map[recKey]map[uint64]bool
	clears map[index.Holder]int
	stores int
	block  chan struct{} // when set, Store waits on it (to stall a worker)
}

type recKey struct {
	model string
	h     index.Holder
	tier  string
}

func newRecSink() *recSink {
	return &recSink{blocks: map[recKey]map[uint64]bool{}, clears: map[index.Holder]int{}}
}

func (s *recSink) Store(model string, h index.Holder, tier string, group int, parent uint64, hasParent bool, keys []uint64) {
	s.mu.Lock()
	block := s.block
	s.mu.Unlock()
	if block != nil {
		<-block
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	k := recKey{model, h, tier}
	if s.blocks[k] == nil {
		s.blocks[k] = map[uint64]bool{}
	}
	for _, key := range keys {
		s.blocks[k][key] = true
	}
	s.stores++
}

func (s *recSink) Remove(model string, h index.Holder, tier string, group int, keys []uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, key := range keys {
		delete(s.blocks[recKey{model, h, tier}], key)
	}
}

func (s *recSink) ClearHolder(model string, h index.Holder, tier string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clears[h]++
	for k := range s.blocks {
		if k.model == model && k.h == h && (tier == "" || k.tier == tier) {
			delete(s.blocks, k)
		}
	}
}

// stall makes Store wait, and so the worker calling it, until release is
// called.
func (s *recSink) stall() (release func()) {
	b := make(chan struct{})
	s.mu.Lock()
	s.block = b
	s.mu.Unlock()
	return func() { close(b) }
}

// keys returns the sorted keys of (model, holder, tier).
func (s *recSink) keys(model string, h index.Holder, tier string) []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Sorted(maps.Keys(s.blocks[recKey{model, h, tier}]))
}

func (s *recSink) clearCount(h index.Holder) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clears[h]
}

// teeSink applies events to the brute-force model and to a real index, so
// tests can wait on the model and then check the index against it.
type teeSink struct {
	rec *recSink
	ix  *index.Index
}

func newTeeSink() *teeSink { return &teeSink{rec: newRecSink(), ix: index.New(index.Config{})} }

func (t *teeSink) Store(model string, h index.Holder, tier string, group int, parent uint64, hasParent bool, keys []uint64) {
	t.ix.Store(model, h, tier, group, parent, hasParent, keys)
	t.rec.Store(model, h, tier, group, parent, hasParent, keys)
}

func (t *teeSink) Remove(model string, h index.Holder, tier string, group int, keys []uint64) {
	t.ix.Remove(model, h, tier, group, keys)
	t.rec.Remove(model, h, tier, group, keys)
}

func (t *teeSink) ClearHolder(model string, h index.Holder, tier string) {
	t.ix.ClearHolder(model, h, tier)
	t.rec.ClearHolder(model, h, tier)
}
