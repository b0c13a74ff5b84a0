package fake

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"sync"

	"github.com/kvsource/kvsource/transfer"
)

// Faults are injected failures of one peer. The zero value injects none.
type Faults struct {
	// Unreachable: connects fail with transfer.ErrUnreachable and live
	// sessions fail with transfer.ErrPeerLost (the peer dropped off).
	Unreachable bool
	// Reject: connects fail with transfer.ErrHandshake after the handshake
	// timeout, as when a vLLM peer rejects a mismatched block length, hash
	// seed or config fingerprint.
	Reject bool
	// Stall: the peer drops every message. Connects time out with
	// transfer.ErrHandshake; lookups wait until their context ends; a fetch
	// waits until its context ends or it is aborted, and since the abort is
	// never acknowledged the session is lost (transfer.ErrPeerLost).
	Stall bool
	// Miss reports which held keys lookups answer as misses: partial hits.
	Miss func(transfer.Key) bool
	// EvictAfterLookup evicts every hit right after the lookup answers, so
	// the fetch fails with transfer.ErrMissingKeys: a peer whose pin
	// expired, or one that does not pin.
	EvictAfterLookup bool
	// FailFetch fails every non-empty fetch with transfer.ErrFetchFailed, as
	// a failed data-plane write does.
	FailFetch bool
}

// Peer is one simulated pod's offload tier. It is safe for concurrent use.
type Peer struct {
	name     string
	blockLen int

	mu      sync.Mutex
	blocks  map[string][]byte // nil value: synthetic content (Content)
	faults  Faults
	removed bool
}

// Name returns the peer's name.
func (p *Peer) Name() string { return p.name }

// Put stores a copy of data as the content of k. data must be one block.
func (p *Peer) Put(k transfer.Key, data []byte) error {
	if !k.Valid() {
		return fmt.Errorf("%w: key %v", transfer.ErrInvalid, k)
	}
	if len(data) != p.blockLen {
		return fmt.Errorf("%w: block of %d bytes, want %d", transfer.ErrInvalid, len(data), p.blockLen)
	}
	p.mu.Lock()
	p.blocks[string(k)] = append([]byte(nil), data...)
	p.mu.Unlock()
	return nil
}

// Hold stores keys with synthetic content, Content(k, BlockLen), without
// allocating it until a fetch copies it.
func (p *Peer) Hold(keys ...transfer.Key) {
	p.mu.Lock()
	for _, k := range keys {
		p.blocks[string(k)] = nil
	}
	p.mu.Unlock()
}

// Evict removes keys from the peer.
func (p *Peer) Evict(keys ...transfer.Key) {
	p.mu.Lock()
	for _, k := range keys {
		delete(p.blocks, string(k))
	}
	p.mu.Unlock()
}

// Holds reports whether the peer holds k.
func (p *Peer) Holds(k transfer.Key) bool {
	p.mu.Lock()
	_, ok := p.blocks[string(k)]
	p.mu.Unlock()
	return ok
}

// Len returns the number of blocks the peer holds.
func (p *Peer) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.blocks)
}

// SetFaults replaces the peer's injected faults.
func (p *Peer) SetFaults(f Faults) {
	p.mu.Lock()
	p.faults = f
	p.mu.Unlock()
}

// Faults returns the peer's injected faults.
func (p *Peer) Faults() Faults {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.faults
}

func (p *Peer) isRemoved() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.removed
}

// Content returns the synthetic content of k: blockLen bytes of a
// pseudo-random stream seeded by k, so tests can verify a fetched block
// without storing it.
func Content(k transfer.Key, blockLen int) []byte {
	b := make([]byte, blockLen)
	fillContent(b, k)
	return b
}

func fillContent(b []byte, k transfer.Key) {
	h := fnv.New64a()
	h.Write(k)
	x := h.Sum64()
	var w [8]byte
	for i := 0; i < len(b); i += 8 {
		// splitmix64: a cheap, well-mixed stream from one seed.
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		z ^= z >> 31
		binary.LittleEndian.PutUint64(w[:], z)
		copy(b[i:], w[:])
	}
}
