// Package eventstest holds the test sinks (events.Sink implementations)
// the events packages' tests share: a brute-force model of the index and a
// tee of it and a real index.
package eventstest

import (
	"maps"
	"slices"
	"sync"

	"github.com/kvsource/kvsource/index"
)

// RecSink is a brute-force model of the index: the set of keys each
// (model, holder, tier) holds, plus a log of clears.
type RecSink struct {
	mu     sync.Mutex
	blocks map[recKey]map[uint64]bool
	clears map[index.Holder]int
	stores int           // Store calls
	block  chan struct{} // when set, Store waits on it (to stall a worker)
}

type recKey struct {
	model string
	h     index.Holder
	tier  string
}

// NewRecSink returns an empty RecSink.
func NewRecSink() *RecSink {
	return &RecSink{blocks: map[recKey]map[uint64]bool{}, clears: map[index.Holder]int{}}
}

func (s *RecSink) Store(b index.Blocks) {
	model, h, tier, keys := b.Model, b.Holder, b.Tier, b.Keys
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

func (s *RecSink) Remove(model string, h index.Holder, tier string, group int, keys []uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, key := range keys {
		delete(s.blocks[recKey{model, h, tier}], key)
	}
}

func (s *RecSink) ClearHolder(model string, h index.Holder, tier string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clears[h]++
	for k := range s.blocks {
		if k.model == model && k.h == h && (tier == "" || k.tier == tier) {
			delete(s.blocks, k)
		}
	}
}

// Stall makes Store wait, and so the worker calling it, until release is
// called.
func (s *RecSink) Stall() (release func()) {
	b := make(chan struct{})
	s.mu.Lock()
	s.block = b
	s.mu.Unlock()
	return func() { close(b) }
}

// Keys returns the sorted keys of (model, holder, tier).
func (s *RecSink) Keys(model string, h index.Holder, tier string) []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Sorted(maps.Keys(s.blocks[recKey{model, h, tier}]))
}

// Stores returns the number of Store calls.
func (s *RecSink) Stores() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stores
}

// ClearCount returns the number of ClearHolder calls for h.
func (s *RecSink) ClearCount(h index.Holder) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clears[h]
}

// TeeSink applies events to the brute-force model and to a real index, so
// tests can wait on the model and then check the index against it.
type TeeSink struct {
	Rec   *RecSink
	Index *index.Index
}

// NewTeeSink returns a TeeSink on an empty index.Index.
func NewTeeSink() *TeeSink { return &TeeSink{Rec: NewRecSink(), Index: index.New(index.Config{})} }

func (t *TeeSink) Store(b index.Blocks) {
	t.Index.Store(b)
	t.Rec.Store(b)
}

func (t *TeeSink) Remove(model string, h index.Holder, tier string, group int, keys []uint64) {
	t.Index.Remove(model, h, tier, group, keys)
	t.Rec.Remove(model, h, tier, group, keys)
}

func (t *TeeSink) ClearHolder(model string, h index.Holder, tier string) {
	t.Index.ClearHolder(model, h, tier)
	t.Rec.ClearHolder(model, h, tier)
}
