package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"

	"github.com/cespare/xxhash/v2"

	"github.com/kvsource/kvsource/transfer"
	"github.com/kvsource/kvsource/transfer/fake"
	"github.com/kvsource/kvsource/transfer/p2p"
)

// mover is the transfer side of the fleet: each pod's CPU tier as a P2P
// source, and each pod's client that pulls into its staging memory.
type mover interface {
	// hold and evict track a pod's CPU tier in its P2P source.
	hold(p *pod, keys []transfer.Key) error
	evict(p *pod, keys []transfer.Key) error
	// client returns the pod's transfer client and the memory its fetches
	// write into (block i at i*blockLen()).
	client(p *pod) (transfer.Client, []byte)
	// addr is the address a client dials to pull from p.
	addr(p *pod) string
	// expect writes into b the content a source holds for k.
	expect(k transfer.Key, b []byte)
	blockLen() int
	stats() string
	close()
}

// fillContent writes k's stand-in for a block's KV bytes into b: a function
// of the key, so that a destination can check that every block it pulled is
// the block it named.
func fillContent(b []byte, k transfer.Key) {
	x := xxhash.Sum64(k)
	var w [8]byte
	for i := 0; i < len(b); i += 8 {
		x += 0x9e3779b97f4a7c15
		z := (x ^ x>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		z ^= z >> 31
		if i+8 <= len(b) {
			binary.LittleEndian.PutUint64(b[i:], z)
			continue
		}
		binary.LittleEndian.PutUint64(w[:], z)
		copy(b[i:], w[:])
	}
}

// fakeMover moves blocks through transfer/fake, in memory.
type fakeMover struct {
	net     *fake.Network
	peers   []*fake.Peer
	clients []*fake.Client
	staging [][]byte
}

func newFakeMover(pods []*pod, blockLen, longest int) *fakeMover {
	m := &fakeMover{net: fake.New(fake.Config{BlockLen: blockLen})}
	for _, p := range pods {
		m.peers = append(m.peers, m.net.AddPeer(p2pAddr(p)))
		buf := make([]byte, longest*blockLen)
		m.staging = append(m.staging, buf)
		m.clients = append(m.clients, m.net.Client(buf))
	}
	return m
}

func (m *fakeMover) hold(p *pod, keys []transfer.Key) error {
	m.peers[p.idx].Hold(keys...)
	return nil
}

func (m *fakeMover) evict(p *pod, keys []transfer.Key) error {
	m.peers[p.idx].Evict(keys...)
	return nil
}

func (m *fakeMover) client(p *pod) (transfer.Client, []byte) {
	return m.clients[p.idx], m.staging[p.idx]
}
func (m *fakeMover) addr(p *pod) string              { return p2pAddr(p) }
func (m *fakeMover) blockLen() int                   { return m.net.BlockLen() }
func (m *fakeMover) expect(k transfer.Key, b []byte) { copy(b, fake.Content(k, len(b))) }
func (m *fakeMover) close()                          {}

func (m *fakeMover) stats() string {
	st := m.net.Stats()
	return fmt.Sprintf("transfer/fake: %d lookups, %d fetches, %d blocks, %d bytes, %d fetch errors", st.Lookups, st.Fetches, st.Blocks, st.Bytes, st.FetchErrors)
}

// p2pMover moves blocks with vLLM's P2P protocol over real ZMQ sockets on
// loopback: each pod runs a p2p.Producer serving its CPU tier from a
// p2p.MemStore, and a p2p.Client that pulls into its own registered memory;
// the bytes move through the in-process data plane.
type p2pMover struct {
	bl        int
	stores    []*p2p.MemStore
	producers []*p2p.Producer
	clients   []*p2p.Client
	staging   [][]byte
	buf       []byte
}

func newP2PMover(pods []*pod, blockLen, longest, cpuBlocks int, hashSeed string) (*p2pMover, error) {
	m := &p2pMover{bl: blockLen}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	// Peers accept each other only with equal hash seeds, as vLLM's do.
	ep := p2p.Endpoint{Host: "127.0.0.1", HashSeed: hashSeed, Logger: quiet}
	for range pods {
		st, err := p2p.NewMemStore(make([]byte, cpuBlocks*blockLen), blockLen)
		if err != nil {
			m.close()
			return nil, err
		}
		prod, err := p2p.NewProducer(p2p.ProducerConfig{Endpoint: ep, Store: st})
		if err != nil {
			m.close()
			return nil, err
		}
		m.stores = append(m.stores, st)
		m.producers = append(m.producers, prod)
		mem := make([]byte, longest*blockLen)
		c, err := p2p.NewClient(p2p.ClientConfig{Endpoint: ep, Memory: mem, BlockLen: blockLen})
		if err != nil {
			m.close()
			return nil, err
		}
		m.clients = append(m.clients, c)
		m.staging = append(m.staging, mem)
	}
	return m, nil
}

func (m *p2pMover) hold(p *pod, keys []transfer.Key) error {
	st := m.stores[p.idx]
	if len(m.buf) != m.bl {
		m.buf = make([]byte, m.bl)
	}
	for _, k := range keys {
		fillContent(m.buf, k)
		if err := st.Put(k, m.buf); err != nil {
			return fmt.Errorf("pod %s offload tier: %w", p.name, err)
		}
	}
	return nil
}

func (m *p2pMover) evict(p *pod, keys []transfer.Key) error {
	st := m.stores[p.idx]
	for _, k := range keys {
		if err := st.Evict(k); err != nil && !errors.Is(err, p2p.ErrPinned) {
			return fmt.Errorf("pod %s offload tier: %w", p.name, err)
		}
	}
	return nil
}

func (m *p2pMover) client(p *pod) (transfer.Client, []byte) {
	return m.clients[p.idx], m.staging[p.idx]
}
func (m *p2pMover) addr(p *pod) string              { return m.producers[p.idx].ID() }
func (m *p2pMover) blockLen() int                   { return m.bl }
func (m *p2pMover) expect(k transfer.Key, b []byte) { fillContent(b, k) }

func (m *p2pMover) stats() string {
	var fetches, blocks, failures uint64
	for _, p := range m.producers {
		st := p.Stats()
		fetches += st.Fetches
		blocks += st.Blocks
		failures += st.FetchFailures
	}
	return fmt.Sprintf("transfer/p2p over ZMQ: %d fetches, %d blocks, %d fetch failures", fetches, blocks, failures)
}

func (m *p2pMover) close() {
	for _, c := range m.clients {
		c.Close()
	}
	for _, p := range m.producers {
		p.Close()
	}
}
