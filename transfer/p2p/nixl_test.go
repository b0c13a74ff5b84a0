//go:build cgo && nixl

package p2p

import (
	"context"
	"crypto/rand"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
)

func init() {
	benchPlanes = append(benchPlanes, benchPlane{"nixl", func(b *testing.B) DataPlane {
		n, err := NewNIXL(NIXLConfig{})
		if err != nil {
			b.Fatal(err)
		}
		return n
	}})
}

// newNIXLPlane returns an agent with one backend thread: UCX sets up a
// worker per thread (about 70 ms each here), and only
// TestNIXLIdleAgentsUseLittleCPU and the benchmark need the default four.
func newNIXLPlane(t *testing.T) *NIXL {
	t.Helper()
	n, err := NewNIXL(NIXLConfig{NumThreads: 1})
	require.NoError(t, err)
	return n
}

func offHeap(t *testing.T, blocks int) []byte {
	t.Helper()
	mem, err := AllocRegion(blocks * testBlockLen)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, FreeRegion(mem)) })
	return mem
}

func TestNIXLWritesBlocksByIndex(t *testing.T) {
	src, dst := newNIXLPlane(t), newNIXLPlane(t)
	defer src.Close()
	defer dst.Close()
	srcMem, dstMem := offHeap(t, 8), offHeap(t, 8)
	_, err := rand.Read(srcMem)
	require.NoError(t, err)
	_, err = src.Register(srcMem, testBlockLen)
	require.NoError(t, err)
	md, err := dst.Register(dstMem, testBlockLen)
	require.NoError(t, err)

	base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(dstMem))))
	remote, err := src.AddRemote(md, base, 8, testBlockLen)
	require.NoError(t, err)
	defer remote.Close()
	require.NoError(t, remote.Write(context.Background(), []int{1, 6, 3}, []int{7, 0, 2}))
	dst.Sync()
	require.Equal(t, srcMem[1*testBlockLen:2*testBlockLen], dstMem[7*testBlockLen:8*testBlockLen])
	require.Equal(t, srcMem[6*testBlockLen:7*testBlockLen], dstMem[0:testBlockLen])
	require.Equal(t, srcMem[3*testBlockLen:4*testBlockLen], dstMem[2*testBlockLen:3*testBlockLen])
	require.Equal(t, make([]byte, testBlockLen), dstMem[1*testBlockLen:2*testBlockLen])

	require.ErrorIs(t, remote.Write(context.Background(), []int{8}, []int{0}), ErrDataPlane)
	_, err = src.AddRemote(md[:len(md)/2], base, 8, testBlockLen)
	require.ErrorIs(t, err, ErrDataPlane)
}

func TestNIXLRejectsItsOwnMetadata(t *testing.T) {
	n := newNIXLPlane(t)
	defer n.Close()
	md, err := n.Register(offHeap(t, 2), testBlockLen)
	require.NoError(t, err)
	_, err = n.AddRemote(md, 0, 2, testBlockLen)
	require.ErrorIs(t, err, ErrDataPlane)
}

func TestProtocolEndToEndOverNIXL(t *testing.T) {
	storeMem := offHeap(t, 16)
	store, err := NewMemStore(storeMem, testBlockLen)
	require.NoError(t, err)
	blocks := map[int][]byte{}
	for i := range 4 {
		b := randomBlock(t)
		require.NoError(t, store.Put(testKey(i), b))
		blocks[i] = b
	}
	prodPlane, clientPlane := newNIXLPlane(t), newNIXLPlane(t)
	prod, err := NewProducer(ProducerConfig{Endpoint: Endpoint{Host: "127.0.0.1", HandshakeTimeout: 5 * time.Second,
		Logger: quiet, DataPlane: prodPlane}, Store: store})
	require.NoError(t, err)
	defer prod.Close()
	dst := offHeap(t, 8)
	client, err := NewClient(ClientConfig{Endpoint: Endpoint{Host: "127.0.0.1", HandshakeTimeout: 5 * time.Second,
		Logger: quiet, DataPlane: clientPlane}, Memory: dst, BlockLen: testBlockLen})
	require.NoError(t, err)
	defer client.Close()

	ctx := context.Background()
	s, err := client.Connect(ctx, prod.ID())
	require.NoError(t, err)
	keys := []transfer.Key{testKey(0), testKey(1), testKey(2), testKey(3)}
	hits, err := s.Lookup(ctx, keys)
	require.NoError(t, err)
	require.Equal(t, []bool{true, true, true, true}, hits)
	_, err = s.Fetch(ctx, keys, []int{4, 5, 6, 7})
	require.NoError(t, err)
	for i := range 4 {
		require.Equal(t, blocks[i], dst[(4+i)*testBlockLen:(5+i)*testBlockLen])
	}
	require.NoError(t, s.Close())
}

// NIXL keeps one metadata entry per agent name: a consumer that reconnects
// while its old session is reaped has two Remotes on the producer, and
// closing the old one must leave the new one working.
func TestNIXLPeerStaysLoadedWhileAnotherRemoteUsesIt(t *testing.T) {
	src, dst := newNIXLPlane(t), newNIXLPlane(t)
	defer src.Close()
	defer dst.Close()
	srcMem, dstMem := offHeap(t, 4), offHeap(t, 4)
	_, err := rand.Read(srcMem)
	require.NoError(t, err)
	_, err = src.Register(srcMem, testBlockLen)
	require.NoError(t, err)
	md, err := dst.Register(dstMem, testBlockLen)
	require.NoError(t, err)
	base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(dstMem))))

	ctx := context.Background()
	first, err := src.AddRemote(md, base, 4, testBlockLen)
	require.NoError(t, err)
	second, err := src.AddRemote(md, base, 4, testBlockLen)
	require.NoError(t, err)
	require.NoError(t, first.Write(ctx, []int{0}, []int{0}))
	require.NoError(t, first.Close())
	require.NoError(t, second.Write(ctx, []int{1}, []int{1}), "the other Remote still has the peer")
	require.Equal(t, srcMem[testBlockLen:2*testBlockLen], dstMem[testBlockLen:2*testBlockLen])
	require.NoError(t, first.Close(), "a second Close of a Remote unloads nothing")
	require.NoError(t, second.Write(ctx, []int{2}, []int{2}))
	require.NoError(t, second.Close())
	require.ErrorIs(t, second.Write(ctx, []int{3}, []int{3}), ErrDataPlane)

	third, err := src.AddRemote(md, base, 4, testBlockLen)
	require.NoError(t, err, "the peer loads again once no Remote has it")
	defer third.Close()
	require.NoError(t, third.Write(ctx, []int{3}, []int{3}))
	require.Equal(t, srcMem[3*testBlockLen:], dstMem[3*testBlockLen:])
}

// slowUnload wraps a producer's data plane: the first Remote's Close waits
// until a second Remote was added, so the old session of a reconnecting
// consumer is reaped after the new one loaded the same peer; unloaded is
// closed once that Close returned.
type slowUnload struct {
	DataPlane
	mu       sync.Mutex
	added    int
	second   chan struct{}
	unloaded chan struct{}
}

func (p *slowUnload) AddRemote(md []byte, base uint64, n, bl int) (Remote, error) {
	r, err := p.DataPlane.AddRemote(md, base, n, bl)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.added++
	switch p.added {
	case 1:
		return slowRemote{r, p}, nil
	case 2:
		close(p.second)
	}
	return r, nil
}

type slowRemote struct {
	Remote
	p *slowUnload
}

func (r slowRemote) Close() error {
	<-r.p.second
	defer close(r.p.unloaded)
	return r.Remote.Close()
}

func TestProtocolOverNIXLServesAConsumerThatReconnectsWhileItsOldSessionIsReaped(t *testing.T) {
	store, err := NewMemStore(offHeap(t, 4), testBlockLen)
	require.NoError(t, err)
	blocks := map[int][]byte{}
	for i := range 2 {
		blocks[i] = randomBlock(t)
		require.NoError(t, store.Put(testKey(i), blocks[i]))
	}
	plane := &slowUnload{DataPlane: newNIXLPlane(t), second: make(chan struct{}), unloaded: make(chan struct{})}
	prod, err := NewProducer(ProducerConfig{Endpoint: Endpoint{Host: "127.0.0.1", HandshakeTimeout: slowTimeout,
		Logger: quiet, DataPlane: plane}, Store: store})
	require.NoError(t, err)
	defer prod.Close()
	dst := offHeap(t, 4)
	client, err := NewClient(ClientConfig{Endpoint: Endpoint{Host: "127.0.0.1", HandshakeTimeout: slowTimeout,
		Logger: quiet, DataPlane: newNIXLPlane(t)}, Memory: dst, BlockLen: testBlockLen})
	require.NoError(t, err)
	defer client.Close()

	ctx := context.Background()
	pull := func(s transfer.Session, key, block int) {
		t.Helper()
		_, err := s.Lookup(ctx, []transfer.Key{testKey(key)})
		require.NoError(t, err)
		_, err = s.Fetch(ctx, []transfer.Key{testKey(key)}, []int{block})
		require.NoError(t, err)
		require.Equal(t, blocks[key], dst[block*testBlockLen:(block+1)*testBlockLen])
	}
	s, err := client.Connect(ctx, prod.ID())
	require.NoError(t, err)
	pull(s, 0, 0)
	require.NoError(t, s.Close())
	s, err = client.Connect(ctx, prod.ID())
	require.NoError(t, err)
	receive(t, plane.unloaded)
	pull(s, 1, 1)
	require.NoError(t, s.Close())
}

// NIXL's default agent runs the UCX progress thread with no delay: it spins
// on a core even when nothing moves. Two idle agents with a live connection
// between them must cost the process almost nothing.
func TestNIXLIdleAgentsUseLittleCPU(t *testing.T) {
	newPlane := func() *NIXL {
		n, err := NewNIXL(NIXLConfig{})
		require.NoError(t, err)
		return n
	}
	src, dst := newPlane(), newPlane()
	defer src.Close()
	defer dst.Close()
	_, err := src.Register(offHeap(t, 2), testBlockLen)
	require.NoError(t, err)
	dstMem := offHeap(t, 2)
	md, err := dst.Register(dstMem, testBlockLen)
	require.NoError(t, err)
	remote, err := src.AddRemote(md, uint64(uintptr(unsafe.Pointer(unsafe.SliceData(dstMem)))), 2, testBlockLen)
	require.NoError(t, err)
	defer remote.Close()
	require.NoError(t, remote.Write(context.Background(), []int{0}, []int{1}))

	const idle = 500 * time.Millisecond
	cpu0, wall0 := processCPU(), time.Now()
	time.Sleep(idle) // the interval measured: nothing is waited for
	cpu, wall := processCPU()-cpu0, time.Since(wall0)
	t.Logf("idle for %v: %v of CPU (%.3f of a core)", wall.Round(time.Millisecond), cpu, cpu.Seconds()/wall.Seconds())
	require.Less(t, cpu.Seconds()/wall.Seconds(), 0.05, "two idle agents use under 5% of a core")
}
