//go:build cgo

package p2p

import (
	"context"
	"testing"
	"time"

	"github.com/kvsource/kvsource/transfer"
)

// BenchmarkPullLoopback measures one pull (lookup, then fetch of every key)
// between a Go client and a Go producer over ZMQ on loopback with the
// in-process data plane: the protocol's own latency floor.
func BenchmarkPullLoopback(b *testing.B) {
	for _, blocks := range []int{1, 16, 128} {
		b.Run(map[int]string{1: "blocks=1", 16: "blocks=16", 128: "blocks=128"}[blocks], func(b *testing.B) {
			const blockLen = 16 << 10
			store, err := NewMemStore(make([]byte, blocks*blockLen), blockLen)
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
			prod, err := NewProducer(ProducerConfig{Endpoint: ep, Store: store})
			if err != nil {
				b.Fatal(err)
			}
			defer prod.Close()
			client, err := NewClient(ClientConfig{Endpoint: ep, Memory: make([]byte, blocks*blockLen), BlockLen: blockLen})
			if err != nil {
				b.Fatal(err)
			}
			defer client.Close()
			ctx := context.Background()
			s, err := client.Connect(ctx, prod.ID())
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(blocks * blockLen))
			for b.Loop() {
				if _, err := s.Lookup(ctx, keys); err != nil {
					b.Fatal(err)
				}
				if _, err := s.Fetch(ctx, keys, idx); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/1000, "ms/pull")
		})
	}
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
