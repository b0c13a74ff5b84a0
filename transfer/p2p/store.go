//go:build cgo

package p2p

import (
	"errors"
	"fmt"
	"sync"

	"github.com/kvsource/kvsource/transfer"
)

// BlockStore is the producer's offload tier: blocks in one memory region,
// which the producer registers with its data plane.
type BlockStore interface {
	// BlockLen returns the size of one block; a consumer's block_len must
	// equal it.
	BlockLen() int
	// Memory returns the region: slot i is Memory()[i*BlockLen():(i+1)*BlockLen()].
	Memory() []byte
	// Pin reports whether key is held and, if it is, pins it in its slot
	// until the matching Unpin: the block is neither evicted nor moved.
	// Pins nest.
	Pin(key transfer.Key) (slot int, ok bool)
	// Unpin releases one Pin of slot.
	Unpin(slot int)
}

// Store errors.
var (
	ErrStoreFull = errors.New("p2p: store full")
	ErrPinned    = errors.New("p2p: block pinned")
)

// MemStore is a BlockStore over a caller-provided region, for tests and for
// Go producers. It is safe for concurrent use.
type MemStore struct {
	blockLen int
	mu       sync.Mutex
	mem      []byte
	slots    map[string]int // key -> slot
	pins     []int          // slot -> pin count
	free     []int
}

// NewMemStore returns an empty store of len(mem)/blockLen slots in mem.
func NewMemStore(mem []byte, blockLen int) (*MemStore, error) {
	if blockLen <= 0 || len(mem) < blockLen {
		return nil, fmt.Errorf("%w: region of %d bytes cannot hold blocks of %d", transfer.ErrInvalid, len(mem), blockLen)
	}
	n := len(mem) / blockLen
	s := &MemStore{blockLen: blockLen, mem: mem, slots: make(map[string]int), pins: make([]int, n)}
	for i := n - 1; i >= 0; i-- {
		s.free = append(s.free, i)
	}
	return s, nil
}

// BlockLen implements BlockStore.
func (s *MemStore) BlockLen() int { return s.blockLen }

// Memory implements BlockStore.
func (s *MemStore) Memory() []byte { return s.mem }

// Put stores data, one block, as the content of key, in key's slot if it is
// held and unpinned, else in a free slot.
func (s *MemStore) Put(key transfer.Key, data []byte) error {
	if !key.Valid() || len(data) != s.blockLen {
		return fmt.Errorf("%w: key of %d bytes, block of %d bytes (want %d)", transfer.ErrInvalid, len(key), len(data), s.blockLen)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	slot, ok := s.slots[string(key)]
	switch {
	case ok && s.pins[slot] > 0:
		return fmt.Errorf("%w: %v", ErrPinned, key)
	case !ok && len(s.free) == 0:
		return fmt.Errorf("%w: %d blocks", ErrStoreFull, len(s.pins))
	case !ok:
		slot = s.free[len(s.free)-1]
		s.free = s.free[:len(s.free)-1]
		s.slots[string(key)] = slot
	}
	copy(s.mem[slot*s.blockLen:], data)
	return nil
}

// Evict removes key. A pinned key is not evicted: ErrPinned.
func (s *MemStore) Evict(key transfer.Key) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	slot, ok := s.slots[string(key)]
	if !ok {
		return nil
	}
	if s.pins[slot] > 0 {
		return fmt.Errorf("%w: %v", ErrPinned, key)
	}
	delete(s.slots, string(key))
	s.free = append(s.free, slot)
	return nil
}

// Has reports whether key is held.
func (s *MemStore) Has(key transfer.Key) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.slots[string(key)]
	return ok
}

// Pinned returns the number of outstanding pins.
func (s *MemStore) Pinned() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, p := range s.pins {
		n += p
	}
	return n
}

// Pin implements BlockStore.
func (s *MemStore) Pin(key transfer.Key) (int, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	slot, ok := s.slots[string(key)]
	if !ok {
		return 0, false
	}
	s.pins[slot]++
	return slot, true
}

// Unpin implements BlockStore.
func (s *MemStore) Unpin(slot int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if slot >= 0 && slot < len(s.pins) && s.pins[slot] > 0 {
		s.pins[slot]--
	}
}
