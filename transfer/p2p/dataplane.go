//go:build cgo

package p2p

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
)

// DataPlane moves block bytes for the protocol. Each Client and Producer
// owns one: it registers the endpoint's memory region, and a producer's data
// plane writes into consumers' regions. The consumer never initiates a
// transfer.
type DataPlane interface {
	// Register makes mem, a region of blocks of blockLen bytes, the local
	// region and returns the agent metadata that connect carries. It is
	// called once, before any other method.
	Register(mem []byte, blockLen int) (metadata []byte, err error)
	// AddRemote loads a peer's agent metadata and the region its connect
	// described: numBlocks blocks of blockLen bytes at baseAddr.
	AddRemote(metadata []byte, baseAddr uint64, numBlocks, blockLen int) (Remote, error)
	// Sync makes writes that peers reported done visible to the calling
	// goroutine; a consumer calls it after transfer_done and before handing
	// the blocks to its caller.
	Sync()
	// Close releases the local registration.
	Close() error
}

// Remote is a peer's registered region as seen by a data plane.
type Remote interface {
	// Write copies local block src[i] into the peer's block dst[i] (the
	// descriptor index is the block index) and returns when every write is
	// done. When ctx ends, Write cancels what it can and returns ctx's error
	// once no write touches the peer's memory any more.
	Write(ctx context.Context, src, dst []int) error
	// Close unloads the peer.
	Close() error
}

// ErrDataPlane is wrapped by data-plane failures.
var ErrDataPlane = errors.New("p2p: data plane")

// inprocPrefix starts the agent metadata of the in-process data plane.
const inprocPrefix = "kvsource-inproc/"

// The in-process registry maps agent names to live agents, so that a
// producer and a consumer in one process can copy memory, as two NIXL
// agents would over UCX.
var (
	inprocMu     sync.Mutex
	inprocAgents = map[string]*inprocAgent{}
	inprocSeq    atomic.Uint64
)

type inprocAgent struct {
	name     string
	blockLen int
	// mu orders writes into mem with the owner's reads: writers hold it
	// while copying, Sync takes it.
	mu  sync.Mutex
	mem []byte
}

// InProcess is a DataPlane for peers in one process: agents find each other
// by name in a process-wide registry, and a write is a memory copy. It lets
// the protocol run end to end over real sockets without NIXL.
type InProcess struct {
	// agent is read by Sync, which a consumer may call as it closes.
	agent atomic.Pointer[inprocAgent]
}

// NewInProcess returns an in-process data plane.
func NewInProcess() *InProcess { return &InProcess{} }

// Register implements DataPlane.
func (p *InProcess) Register(mem []byte, blockLen int) ([]byte, error) {
	if p.agent.Load() != nil {
		return nil, fmt.Errorf("%w: already registered", ErrDataPlane)
	}
	if blockLen <= 0 || len(mem) < blockLen {
		return nil, fmt.Errorf("%w: region of %d bytes cannot hold blocks of %d", ErrDataPlane, len(mem), blockLen)
	}
	a := &inprocAgent{name: fmt.Sprintf("agent-%d-%d", syscall.Getpid(), inprocSeq.Add(1)), blockLen: blockLen, mem: mem}
	inprocMu.Lock()
	inprocAgents[a.name] = a
	inprocMu.Unlock()
	p.agent.Store(a)
	return []byte(inprocPrefix + a.name), nil
}

// AddRemote implements DataPlane.
func (p *InProcess) AddRemote(md []byte, _ uint64, numBlocks, blockLen int) (Remote, error) {
	local := p.agent.Load()
	if local == nil {
		return nil, fmt.Errorf("%w: not registered", ErrDataPlane)
	}
	name, ok := strings.CutPrefix(string(md), inprocPrefix)
	if !ok {
		return nil, fmt.Errorf("%w: agent metadata is not from an in-process data plane", ErrDataPlane)
	}
	if name == local.name {
		return nil, fmt.Errorf("%w: remote agent %s is the local agent", ErrDataPlane, name)
	}
	inprocMu.Lock()
	a := inprocAgents[name]
	inprocMu.Unlock()
	switch {
	case a == nil:
		return nil, fmt.Errorf("%w: no agent %s in this process", ErrDataPlane, name)
	case blockLen != a.blockLen || numBlocks <= 0 || numBlocks*blockLen > len(a.mem):
		return nil, fmt.Errorf("%w: agent %s registered %d bytes in blocks of %d, peer described %d blocks of %d",
			ErrDataPlane, name, len(a.mem), a.blockLen, numBlocks, blockLen)
	}
	return &inprocRemote{local: local, remote: a, numBlocks: numBlocks}, nil
}

// Sync implements DataPlane.
func (p *InProcess) Sync() {
	if a := p.agent.Load(); a != nil {
		// An empty critical section: it orders the writers' copies, made
		// under the lock, before the caller's reads.
		a.mu.Lock()
		//lint:ignore SA2001 the empty critical section is the point
		a.mu.Unlock()
	}
}

// Close implements DataPlane.
func (p *InProcess) Close() error {
	a := p.agent.Swap(nil)
	if a == nil {
		return nil
	}
	inprocMu.Lock()
	delete(inprocAgents, a.name)
	inprocMu.Unlock()
	return nil
}

type inprocRemote struct {
	local, remote *inprocAgent
	numBlocks     int
}

func (r *inprocRemote) Write(ctx context.Context, src, dst []int) error {
	if len(src) != len(dst) {
		return fmt.Errorf("%w: %d sources, %d destinations", ErrDataPlane, len(src), len(dst))
	}
	bl := r.remote.blockLen
	localBlocks := len(r.local.mem) / r.local.blockLen
	for i := range src {
		if src[i] < 0 || src[i] >= localBlocks || dst[i] < 0 || dst[i] >= r.numBlocks {
			return fmt.Errorf("%w: block %d -> %d outside the regions", ErrDataPlane, src[i], dst[i])
		}
	}
	r.remote.mu.Lock()
	defer r.remote.mu.Unlock()
	for i := range src {
		if err := ctx.Err(); err != nil {
			return err
		}
		copy(r.remote.mem[dst[i]*bl:(dst[i]+1)*bl], r.local.mem[src[i]*r.local.blockLen:(src[i]+1)*r.local.blockLen])
	}
	return nil
}

func (r *inprocRemote) Close() error { return nil }

// AllocRegion returns size bytes of anonymous memory outside the Go heap,
// suitable for registration with a data plane that hands the address to C
// (NIXL): the Go runtime never moves or frees it. Release it with
// FreeRegion.
func AllocRegion(size int) ([]byte, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: region of %d bytes", ErrDataPlane, size)
	}
	b, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("%w: mmap %d bytes: %w", ErrDataPlane, size, err)
	}
	return b, nil
}

// FreeRegion releases memory from AllocRegion.
func FreeRegion(b []byte) error {
	if err := syscall.Munmap(b); err != nil {
		return fmt.Errorf("%w: munmap: %w", ErrDataPlane, err)
	}
	return nil
}
