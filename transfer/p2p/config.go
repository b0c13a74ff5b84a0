//go:build cgo

package p2p

import (
	"fmt"
	"log/slog"
	"math/bits"
	"time"
	"unsafe"
)

// DefaultHashSeed is vLLM's hash seed for the sha256 algorithms when
// PYTHONHASHSEED is unset (since vLLM's PR #51875).
const DefaultHashSeed = "vllm-none-hash"

// Endpoint configures what a Client and a Producer have in common: the bound
// side channel and the fields of the connect message they send and check.
type Endpoint struct {
	// Host is bound and sent verbatim as the host of our identity
	// "host:port", which peers dial back: it must be reachable from them.
	// Default "localhost", as VLLM_P2P_SIDE_CHANNEL_HOST.
	Host string
	// Port to bind; 0 binds an ephemeral port. vLLM binds
	// VLLM_P2P_SIDE_CHANNEL_PORT (default 5710) plus the data-parallel rank.
	Port int
	// HashSeed must equal every peer's effective hash seed (PYTHONHASHSEED,
	// else "vllm-none-hash" for sha256). Default DefaultHashSeed.
	HashSeed string
	// ConfigFingerprint is vLLM's offload config fingerprint. Peers compare
	// fingerprints only when both are non-empty, so "" (the default) is
	// accepted by every peer.
	ConfigFingerprint string
	// HandshakeTimeout bounds the handshake. vLLM rejects a bad connect with
	// silence, so this is how a rejection surfaces. Default 30 s.
	HandshakeTimeout time.Duration
	// Heartbeat sets the ZMTP heartbeats; the zero value is vLLM's.
	Heartbeat Heartbeat
	// DataPlane moves the bytes. Default: NewInProcess().
	DataPlane DataPlane
	// Logger receives warnings about peers. Default slog.Default().
	Logger *slog.Logger
}

func (c Endpoint) withDefaults() Endpoint {
	if c.Host == "" {
		c.Host = "localhost"
	}
	if c.HashSeed == "" {
		c.HashSeed = DefaultHashSeed
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = 30 * time.Second
	}
	c.Heartbeat = c.Heartbeat.withDefaults()
	if c.DataPlane == nil {
		c.DataPlane = NewInProcess()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// region describes registered memory as a connect message does.
type region struct {
	metadata  []byte
	baseAddr  uint64
	numBlocks int
	blockLen  int
}

func register(dp DataPlane, mem []byte, blockLen int) (region, error) {
	if blockLen <= 0 || len(mem) < blockLen {
		return region{}, fmt.Errorf("p2p: region of %d bytes cannot hold blocks of %d", len(mem), blockLen)
	}
	md, err := dp.Register(mem, blockLen)
	if err != nil {
		return region{}, err
	}
	return region{
		metadata:  md,
		baseAddr:  uint64(uintptr(unsafe.Pointer(unsafe.SliceData(mem)))),
		numBlocks: len(mem) / blockLen,
		blockLen:  blockLen,
	}, nil
}

func (r region) connect(id string, c Endpoint) message {
	return message{
		Type: TypeConnect, PeerID: id, AgentMetadata: r.metadata, BaseAddr: r.baseAddr,
		NumBlocks: uint64(r.numBlocks), BlockLen: uint64(r.blockLen),
		ConfigFingerprint: c.ConfigFingerprint, HashSeed: c.HashSeed,
	}
}

// checkConnect applies vLLM's acceptance rules to a peer's connect: equal
// block length, equal hash seed, equal fingerprints when both are set, and a
// non-empty region.
func checkConnect(m message, local region, c Endpoint) error {
	switch {
	case m.BlockLen != uint64(local.blockLen):
		return fmt.Errorf("block_len %d, local %d", m.BlockLen, local.blockLen)
	case m.HashSeed != c.HashSeed:
		return fmt.Errorf("hash_seed %q, local %q", m.HashSeed, c.HashSeed)
	case c.ConfigFingerprint != "" && m.ConfigFingerprint != "" && m.ConfigFingerprint != c.ConfigFingerprint:
		return fmt.Errorf("config_fingerprint %q, local %q", m.ConfigFingerprint, c.ConfigFingerprint)
	case m.NumBlocks == 0:
		return fmt.Errorf("num_blocks 0")
	}
	// A region that cannot exist would make a data plane index past it
	// (the in-process plane's bounds check multiplies the same numbers).
	hi, size := bits.Mul64(m.NumBlocks, m.BlockLen)
	if _, ok := toInt(size); hi != 0 || !ok || m.BaseAddr+size < m.BaseAddr {
		return fmt.Errorf("region of %d blocks of %d bytes at %#x overflows", m.NumBlocks, m.BlockLen, m.BaseAddr)
	}
	return nil
}
