//go:build cgo

package zmq

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// ingestPayloads pre-encodes a cycle of batches for one pod: each stores 32
// chains of 16 new blocks (block size 16) and removes the blocks the batch
// half a cycle earlier stored, so the index stays bounded while every
// operation kind is exercised.
func ingestPayloads(pod int, cycle int) [][]byte {
	const nEvents, blocks = 32, 16
	rng := rand.New(rand.NewPCG(uint64(pod), 9))
	keys := make([][]uint64, cycle)
	for i := range keys {
		for range nEvents * blocks {
			keys[i] = append(keys[i], rng.Uint64())
		}
	}
	tokens := make([]uint32, blocks*16)
	for i := range tokens {
		tokens[i] = uint32(rng.IntN(150000))
	}
	out := make([][]byte, cycle)
	for i := range out {
		b := events.Batch{DPRank: events.Some(0), TS: 1}
		for e := range nEvents {
			b.Events = append(b.Events, events.Event{Type: events.EventBlockStored, BlockSize: 16, Medium: "GPU",
				BlockHashes: keys[i][e*blocks : (e+1)*blocks], TokenIDs: tokens})
		}
		b.Events = append(b.Events, events.Event{Type: events.EventBlockRemoved, Medium: "GPU", BlockHashes: keys[(i+cycle/2)%cycle]})
		out[i] = events.AppendBatch(nil, &b, events.LayoutMap, 0)
	}
	return out
}

// sglangIngestPayloads is ingestPayloads as SGLang publishes it at its
// default page size 1: the same 512 blocks a batch, each its own
// BlockStored (one signed hash, its parent, one token) and each removal
// its own BlockRemoved, in SGLang's positional arrays.
func sglangIngestPayloads(pod int, cycle int) [][]byte {
	const chains, pages = 32, 16
	rng := rand.New(rand.NewPCG(uint64(pod), 9))
	keys := make([][]int64, cycle)
	for i := range keys {
		for range chains * pages {
			keys[i] = append(keys[i], int64(rng.Uint64()))
		}
	}
	out := make([][]byte, cycle)
	for i := range out {
		var evs []any
		for c := range chains {
			for pg := range pages {
				k := c*pages + pg
				var parent any
				if pg > 0 {
					parent = keys[i][k-1]
				}
				evs = append(evs, []any{"BlockStored", []int64{keys[i][k]}, parent, []uint32{uint32(rng.IntN(150000))}, 1, nil, "GPU"})
			}
		}
		for _, k := range keys[(i+cycle/2)%cycle] {
			evs = append(evs, []any{"BlockRemoved", []int64{k}, "GPU"})
		}
		b, err := msgpack.Marshal([]any{1.0, evs, 0})
		if err != nil {
			panic(err)
		}
		out[i] = b
	}
	return out
}

// BenchmarkIngest publishes batches over loopback ZMQ with the Go publisher
// into a live index through the subscriber, and reports stored blocks per
// second. Each publisher keeps at most a window of batches in flight, so
// nothing is dropped and the figure is the sustained rate.
func BenchmarkIngest(b *testing.B) {
	sha, err := hashing.New(hashing.Config{Algo: hashing.SHA256, BlockSize: 16})
	if err != nil {
		b.Fatal(err)
	}
	tests := []struct {
		pods   int
		hasher *hashing.Hasher
		sglang bool // SGLang's page-size-1 shape instead of vLLM's
	}{{1, nil, false}, {4, nil, false}, {4, sha, false}, {1, nil, true}, {4, nil, true}}
	for _, tc := range tests {
		pods := tc.pods
		name := fmt.Sprintf("pods=%d", pods)
		if tc.hasher != nil {
			// Every event of these batches starts at block 0, so every one
			// is checked (and disagrees: the keys are random).
			name += "/hashcheck"
		}
		shape := ingestPayloads
		if tc.sglang {
			name += "/sglang-page1"
			shape = sglangIngestPayloads
		}
		b.Run(name, func(b *testing.B) {
			sink := newIngestSink()
			port := testenv.FreePort(b)
			s := startSubscriber(b, SubscriberConfig{Events: events.Config{Sink: sink, Hasher: tc.hasher, Logger: testenv.TextLogger(discard{})}, Bind: []string{localEP(port)}})
			pubs := make([]*Publisher, pods)
			payloads := make([][][]byte, pods)
			for i := range pubs {
				pubs[i] = newPublisher(b, PublisherConfig{Connect: localEP(port), Topic: fmt.Sprintf("kv@pod-%d@m", i)})
				payloads[i] = shape(i, 64)
				warmUp(b, pubs[i], s, 0)
			}
			holders := make([]index.Holder, pods)
			for i := range holders {
				holders[i] = index.Holder{Pod: fmt.Sprintf("pod-%d", i)}
			}
			applied := func(pod int) uint64 {
				seq, _ := s.LastSeq(holders[pod])
				return seq
			}
			start := make([]uint64, pods)
			for i := range pubs {
				start[i] = applied(i)
			}
			const window = 64
			var published atomic.Uint64
			b.ResetTimer()
			var wg sync.WaitGroup
			for i := range pubs {
				n := b.N / pods
				if i < b.N%pods {
					n++
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					var last uint64
					for k := range n {
						for k >= window && last-applied(i) >= window {
							time.Sleep(20 * time.Microsecond)
						}
						seq, err := pubs[i].PublishPayload(payloads[i][k%len(payloads[i])])
						if err != nil {
							b.Error(err)
							return
						}
						last = seq
						published.Add(1)
					}
					for n > 0 && applied(i) < last {
						time.Sleep(50 * time.Microsecond)
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			st := s.Stats()
			if st.Gaps != 0 || st.DecodeErrors != 0 || st.QueueFull != 0 {
				b.Fatalf("lossy run: %+v", st)
			}
			b.ReportMetric(float64(published.Load()*32*16)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

func newIngestSink() events.Sink { return index.New(index.Config{}) }
