//go:build cgo

package p2p

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvsource/kvsource/transfer"
)

// benchPlane is a data plane BenchmarkPullLoopback pulls over.
type benchPlane struct {
	name string
	new  func(b *testing.B) DataPlane
}

// benchPlanes lists them: the in-process one, and NIXL's in the nixl build
// (nixl_test.go), so that one run compares them.
var benchPlanes = []benchPlane{{"inprocess", func(*testing.B) DataPlane { return NewInProcess() }}}

// BenchmarkPullLoopback measures one pull (lookup, then fetch of every key)
// of 1, 16 and 128 blocks of 16 KiB between a Go client and a Go producer
// over ZMQ on loopback, over each data plane: with the in-process one, the
// protocol's own latency floor.
func BenchmarkPullLoopback(b *testing.B) {
	for _, plane := range benchPlanes {
		for _, blocks := range []int{1, 16, 128} {
			b.Run(fmt.Sprintf("%s/blocks=%d", plane.name, blocks), func(b *testing.B) {
				benchmarkPull(b, plane, blocks)
			})
		}
	}
}

func benchmarkPull(b *testing.B, plane benchPlane, blocks int) {
	const blockLen = 16 << 10
	region := func() []byte {
		// Off the Go heap, as NIXL needs; the same for every plane.
		mem, err := AllocRegion(blocks * blockLen)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = FreeRegion(mem) })
		return mem
	}
	store, err := NewMemStore(region(), blockLen)
	if err != nil {
		b.Fatal(err)
	}
	keys := make([]transfer.Key, blocks)
	idx := make([]int, blocks)
	for i := range keys {
		keys[i], idx[i] = testKey(i), i
		if err := store.Put(keys[i], make([]byte, blockLen)); err != nil {
			b.Fatal(err)
		}
	}
	ep := Endpoint{Host: "127.0.0.1", HandshakeTimeout: 5 * time.Second, Logger: quiet}
	ep.DataPlane = plane.new(b)
	prod, err := NewProducer(ProducerConfig{Endpoint: ep, Store: store})
	if err != nil {
		b.Fatal(err)
	}
	defer prod.Close()
	ep.DataPlane = plane.new(b)
	client, err := NewClient(ClientConfig{Endpoint: ep, Memory: region(), BlockLen: blockLen})
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	ctx := context.Background()
	s, err := client.Connect(ctx, prod.ID())
	if err != nil {
		b.Fatal(err)
	}
	cpu0 := processCPU()
	for b.Loop() {
		if _, err := s.Lookup(ctx, keys); err != nil {
			b.Fatal(err)
		}
		if _, err := s.Fetch(ctx, keys, idx); err != nil {
			b.Fatal(err)
		}
	}
	perPull := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(perPull*1000, "ms/pull")
	b.ReportMetric(float64(blocks*blockLen)/perPull, "bytes/s")
	// On a shared machine wall time mostly measures the other processes;
	// the CPU both sides spent per pull (NIXL's threads included) does not.
	b.ReportMetric((processCPU()-cpu0).Seconds()*1000/float64(b.N), "cpu-ms/pull")
}

// BenchmarkCodec measures encoding a 128-key fetch and decoding a 128-key
// lookup_resp, the largest messages of a pull.
func BenchmarkCodec(b *testing.B) {
	keys := make([][]byte, 128)
	idx := make([]uint64, 128)
	hits := make([]bool, 128)
	for i := range keys {
		keys[i], idx[i], hits[i] = testKey(i), uint64(i), true
	}
	fetch := message{Type: TypeFetch, KVRequestID: "kvsource-0123456789abcdef", Keys: keys, BlockIndexes: idx, RoundSeq: 3}
	resp := message{Type: TypeLookupResp, KVRequestID: "kvsource-0123456789abcdef", Keys: keys, Hits: hits}
	wire, err := resp.encode()
	if err != nil {
		b.Fatal(err)
	}
	b.Run("encode-fetch", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := fetch.encode(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode-lookup_resp", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(wire)))
		for b.Loop() {
			if _, err := decodeMessage(wire); err != nil {
				b.Fatal(err)
			}
		}
	})
}
