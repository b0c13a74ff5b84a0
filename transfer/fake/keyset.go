package fake

import (
	"bytes"
	"hash/maphash"

	"github.com/kvsource/kvsource/transfer"
)

// keySet is a set of keys that, once warm, adds and tests keys without
// allocating: keys are copied into one reused arena and indexed by hash.
// Two keys with one hash are told apart by comparing bytes; the second of
// such a pair goes to a plain map.
type keySet struct {
	seed  maphash.Seed
	first map[uint64]span
	arena []byte
	more  map[string]struct{}
}

type span struct{ off, n int }

func newKeySet() *keySet {
	return &keySet{seed: maphash.MakeSeed(), first: make(map[uint64]span)}
}

func (s *keySet) add(k transfer.Key) {
	h := maphash.Bytes(s.seed, k)
	if sp, ok := s.first[h]; ok {
		if bytes.Equal(s.arena[sp.off:sp.off+sp.n], k) {
			return
		}
		if s.more == nil {
			s.more = make(map[string]struct{})
		}
		s.more[string(k)] = struct{}{}
		return
	}
	s.first[h] = span{len(s.arena), len(k)}
	s.arena = append(s.arena, k...)
}

func (s *keySet) has(k transfer.Key) bool {
	sp, ok := s.first[maphash.Bytes(s.seed, k)]
	if !ok {
		return false
	}
	if bytes.Equal(s.arena[sp.off:sp.off+sp.n], k) {
		return true
	}
	_, ok = s.more[string(k)]
	return ok
}

func (s *keySet) reset() {
	clear(s.first)
	clear(s.more)
	s.arena = s.arena[:0]
}
