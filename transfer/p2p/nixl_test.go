//go:build cgo && nixl

package p2p

import (
	"context"
	"crypto/rand"
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

func newNIXLPlane(t *testing.T) *NIXL {
	t.Helper()
	n, err := NewNIXL(NIXLConfig{})
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
