package fake

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsource/kvsource/transfer"
)

// Config configures a Network. The zero value is a network of 4 KiB blocks
// with no latency, unlimited bandwidth and a 30 s handshake timeout.
type Config struct {
	// BlockLen is the size of one block in bytes. Default 4096.
	BlockLen int
	// Latency is the round trip every call that waits for the peer pays:
	// Connect, Lookup, Fetch, Abort. Default 0.
	Latency time.Duration
	// Bandwidth is the fetch throughput in bytes per second. 0 means
	// unlimited.
	Bandwidth float64
	// HandshakeTimeout is how long Connect waits for a peer that is
	// unreachable or rejects the handshake. Default 30 s, vLLM's.
	HandshakeTimeout time.Duration
	// Sleep charges d of simulated time; it returns ctx's error when ctx
	// ends first. Default: a real timer.
	Sleep func(ctx context.Context, d time.Duration) error
}

func (c Config) withDefaults() Config {
	if c.BlockLen <= 0 {
		c.BlockLen = 4096
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = 30 * time.Second
	}
	if c.Sleep == nil {
		c.Sleep = realSleep
	}
	return c
}

func realSleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Stats counts what happened on a Network since it was created.
type Stats struct {
	Connects       uint64 // handshakes completed
	ConnectErrors  uint64 // handshakes failed
	Lookups        uint64 // lookups answered
	LookupKeys     uint64 // keys looked up
	LookupHits     uint64 // keys reported held
	Fetches        uint64 // non-empty fetches completed
	Blocks         uint64 // blocks written into destinations
	Bytes          uint64 // bytes written into destinations
	FetchErrors    uint64 // fetches failed (missing keys, failed transfer, peer lost)
	Aborts         uint64 // rounds aborted
	EmptyFetches   uint64 // requests ended with an empty fetch
	InvalidRequest uint64 // calls rejected for invalid arguments
}

type counters struct {
	connects, connectErrors, lookups, lookupKeys, lookupHits  atomic.Uint64
	fetches, blocks, bytes, fetchErrors, aborts, emptyFetches atomic.Uint64
	invalid                                                   atomic.Uint64
}

// Network is a set of peers that clients connect to by name. It is safe for
// concurrent use.
type Network struct {
	cfg   Config
	mu    sync.RWMutex
	peers map[string]*Peer
	c     counters
}

// New returns an empty network.
func New(cfg Config) *Network {
	return &Network{cfg: cfg.withDefaults(), peers: make(map[string]*Peer)}
}

// BlockLen returns the network's block size in bytes.
func (n *Network) BlockLen() int { return n.cfg.BlockLen }

// FetchCost returns the modelled duration of a fetch of blocks blocks: the
// latency floor plus the bytes over the bandwidth. A pull (lookup then
// fetch) costs FetchCost plus one more Latency.
func (n *Network) FetchCost(blocks int) time.Duration {
	d := n.cfg.Latency
	if n.cfg.Bandwidth > 0 && blocks > 0 {
		d += time.Duration(float64(blocks) * float64(n.cfg.BlockLen) / n.cfg.Bandwidth * float64(time.Second))
	}
	return d
}

// AddPeer returns the peer named name, creating it with an empty store.
func (n *Network) AddPeer(name string) *Peer {
	n.mu.Lock()
	defer n.mu.Unlock()
	if p, ok := n.peers[name]; ok {
		return p
	}
	p := &Peer{name: name, blockLen: n.cfg.BlockLen, blocks: make(map[string][]byte)}
	n.peers[name] = p
	return p
}

// Peer returns the peer named name, or nil.
func (n *Network) Peer(name string) *Peer {
	n.mu.RLock()
	defer n.mu.RUnlock()
	return n.peers[name]
}

// RemovePeer removes the peer named name: new connects find it unreachable
// and its live sessions are lost.
func (n *Network) RemovePeer(name string) {
	n.mu.Lock()
	p := n.peers[name]
	delete(n.peers, name)
	n.mu.Unlock()
	if p != nil {
		p.mu.Lock()
		p.removed = true
		p.mu.Unlock()
	}
}

// Stats returns the network's counters.
func (n *Network) Stats() Stats {
	c := &n.c
	return Stats{
		Connects: c.connects.Load(), ConnectErrors: c.connectErrors.Load(),
		Lookups: c.lookups.Load(), LookupKeys: c.lookupKeys.Load(), LookupHits: c.lookupHits.Load(),
		Fetches: c.fetches.Load(), Blocks: c.blocks.Load(), Bytes: c.bytes.Load(),
		FetchErrors: c.fetchErrors.Load(), Aborts: c.aborts.Load(), EmptyFetches: c.emptyFetches.Load(),
		InvalidRequest: c.invalid.Load(),
	}
}

// Client returns a client whose fetches write into dst: block i is
// dst[i*BlockLen:(i+1)*BlockLen]. With a nil dst the bytes are counted but
// not copied and any non-negative block index is accepted, which is what a
// simulation of many pods wants.
func (n *Network) Client(dst []byte) *Client {
	return &Client{n: n, dst: dst}
}

// Client is a transfer.Client on a Network.
type Client struct {
	n   *Network
	dst []byte
}

var _ transfer.Client = (*Client)(nil)

// Connect opens a session to the peer named peer. An unknown, removed or
// unreachable peer fails with transfer.ErrUnreachable and a rejecting one
// with transfer.ErrHandshake, both after the handshake timeout, as a real
// vLLM peer would.
func (c *Client) Connect(ctx context.Context, peer string) (transfer.Session, error) {
	n := c.n
	p := n.Peer(peer)
	var f Faults
	if p != nil {
		f = p.Faults()
	}
	fail := func(sentinel error) (transfer.Session, error) {
		n.c.connectErrors.Add(1)
		if err := n.cfg.Sleep(ctx, n.cfg.HandshakeTimeout); err != nil {
			return nil, fmt.Errorf("connect %s: %w: %w", peer, sentinel, err)
		}
		return nil, fmt.Errorf("connect %s: %w after %v", peer, sentinel, n.cfg.HandshakeTimeout)
	}
	switch {
	case p == nil || p.isRemoved() || f.Unreachable:
		return fail(transfer.ErrUnreachable)
	case f.Reject || f.Stall:
		return fail(transfer.ErrHandshake)
	}
	if err := n.cfg.Sleep(ctx, n.cfg.Latency); err != nil {
		n.c.connectErrors.Add(1)
		return nil, fmt.Errorf("connect %s: %w: %w", peer, transfer.ErrHandshake, err)
	}
	n.c.connects.Add(1)
	return &session{c: c, p: p, pins: newKeySet(), done: make(chan struct{})}, nil
}
