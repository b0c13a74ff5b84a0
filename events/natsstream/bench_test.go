package natsstream

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// BenchmarkReplicaWarmStart measures a new replica's time to ready: load
// the shared snapshot of KVSOURCE_WARMSTART_BLOCKS holder-blocks (default
// 1M; BENCHMARKS.md has 10M) from the object store, then apply the 1,000
// batches stored after it.
func BenchmarkReplicaWarmStart(b *testing.B) {
	n := 1_000_000
	if v, err := strconv.Atoi(os.Getenv("KVSOURCE_WARMSTART_BLOCKS")); err == nil && v > 0 {
		n = v
	}
	env := startNATS(b)
	_, js := env.connect(b)
	ctx := context.Background()
	var cfg Config
	relay, err := NewRelay(ctx, RelayConfig{Config: cfg, JetStream: js, Name: "bench"})
	require.NoError(b, err)
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go relay.Run(rctx)
	require.Eventually(b, func() bool { return relay.Stats().Leader }, 10*time.Second, 10*time.Millisecond)

	// The seeder applies one real batch (a snapshot covers a stream
	// position), then gets the fleet's blocks directly: 100 holders, 16
	// models' worth of chained prompts.
	seeder, err := Open(ctx, ReplicaConfig{Config: cfg, JetStream: js, Name: "seeder", TempDir: b.TempDir()})
	require.NoError(b, err)
	sctx, scancel := context.WithCancel(ctx)
	go seeder.Run(sctx)
	payload := events.AppendBatch(nil, &events.Batch{DPRank: events.Some(0)}, events.LayoutMap, 0)
	relay.Tap(events.TapBatch{Model: "m", Pod: "seed", Seq: 0, Payload: payload})
	require.NoError(b, seeder.WaitApplied(ctx, 1))
	const holders, chain = 100, 64
	keys := make([]uint64, chain)
	for h := range holders {
		hd := index.Holder{Pod: fmt.Sprintf("10.1.%d.%d:8000", h/250, h%250)}
		for c := range n / holders / chain {
			for i := range keys {
				keys[i] = uint64(c)<<20 | uint64(i) + 1
			}
			seeder.Index().Store(index.Blocks{Model: "m", Holder: hd, Tier: index.TierGPU, Keys: keys})
		}
	}
	total := n / holders / chain * holders * chain
	start := time.Now()
	require.NoError(b, seeder.Snapshot(ctx))
	b.Logf("snapshot of %d holder-blocks stored in %v", n, time.Since(start))
	scancel()
	// The tail after the snapshot.
	pub := &events.Batch{DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockStored, Medium: "GPU", BlockSize: 16, BlockHashes: make([]uint64, 32)}}}
	for i := range 1000 {
		for j := range pub.Events[0].BlockHashes {
			pub.Events[0].BlockHashes[j] = uint64(i*32+j) + 1<<40
		}
		payload = events.AppendBatch(payload[:0], pub, events.LayoutMap, 0)
		relay.Tap(events.TapBatch{Model: "m", Pod: "tail", Seq: uint64(i), Payload: payload})
	}
	require.NoError(b, relay.Flush(ctx))
	name, _, _, _, err := seeder.newestSnapshot(ctx)
	require.NoError(b, err)
	info, err := seeder.obj.GetInfo(ctx, name)
	require.NoError(b, err)

	b.ResetTimer()
	for i := range b.N {
		r, err := Open(ctx, ReplicaConfig{Config: cfg, JetStream: js, Name: fmt.Sprintf("new-%d", i), TempDir: b.TempDir()})
		require.NoError(b, err)
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); r.Run(rctx) }()
		require.NoError(b, r.WaitReady(ctx))
		b.StopTimer()
		require.Equal(b, int64(total+32*1000), r.Index().Stats().HolderBlocks, "the new replica holds the snapshot and the tail")
		cancel()
		<-done
		b.StartTimer()
	}
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "holder-blocks/s")
	b.ReportMetric(float64(info.Size)/float64(n), "snapshot-bytes/block")
}

// BenchmarkReplicaPropagation measures engine publish to applied on all
// three replicas: sixteen engines publish 128-block batches, 100K blocks/s
// in all (about 50 scheduler steps a second each, as busy vLLM engines
// do), through ZMQ to a relay, JetStream, and three replicas; p50 and p99
// are over every batch.
func BenchmarkReplicaPropagation(b *testing.B) {
	const blocksPerSec, batchBlocks, pods, replicas = 100_000, 128, 16, 3
	env := startNATS(b)
	_, js := env.connect(b)
	ctx := context.Background()
	relay, err := NewRelay(ctx, RelayConfig{JetStream: js, Name: "bench"})
	require.NoError(b, err)
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go relay.Run(rctx)
	require.Eventually(b, func() bool { return relay.Stats().Leader }, 10*time.Second, 10*time.Millisecond)

	type key struct {
		pod string
		seq uint64
	}
	var sent sync.Map // key -> time.Time
	var mu sync.Mutex
	seen := map[key]int{}
	var lat []time.Duration
	applied := func(bt Batch, _ uint64) {
		k := key{bt.Pod, bt.Seq}
		mu.Lock()
		defer mu.Unlock()
		seen[k]++
		if seen[k] == replicas {
			delete(seen, k)
			if t0, ok := sent.Load(k); ok {
				lat = append(lat, time.Since(t0.(time.Time)))
			}
		}
	}
	var rs []*Replica
	for i := range replicas {
		_, rjs := env.connect(b)
		r, err := Open(ctx, ReplicaConfig{JetStream: rjs, Name: fmt.Sprintf("r%d", i), TempDir: b.TempDir(), Applied: applied})
		require.NoError(b, err)
		go r.Run(rctx)
		rs = append(rs, r)
	}
	var pubs []*zmq.Publisher
	sub, err := zmq.NewSubscriber(zmq.SubscriberConfig{Events: events.Config{Sink: index.New(index.Config{}), Tap: relay.Tap, Workers: 2}})
	require.NoError(b, err)
	for p := range pods {
		port := testenv.FreePort(b)
		pub, err := zmq.NewPublisher(zmq.PublisherConfig{Bind: fmt.Sprintf("tcp://*:%d", port), Topic: fmt.Sprintf("kv@10.2.0.%d:8000@m", p)})
		require.NoError(b, err)
		defer pub.Close()
		pubs = append(pubs, pub)
		require.NoError(b, sub.AddPod(fmt.Sprintf("10.2.0.%d:8000", p), fmt.Sprintf("tcp://127.0.0.1:%d", port), ""))
	}
	go sub.Run(rctx)
	batch := &events.Batch{DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockStored, Medium: "GPU", BlockSize: 16, BlockHashes: make([]uint64, batchBlocks)}}}
	// Warm up until every pod's messages arrive.
	nextSeq := make([]uint64, pods)
	for p, pub := range pubs {
		require.Eventually(b, func() bool {
			seq, err := pub.Publish(&events.Batch{DPRank: events.Some(0)})
			require.NoError(b, err)
			nextSeq[p] = seq + 1
			_, ok := sub.LastSeq(index.Holder{Pod: fmt.Sprintf("10.2.0.%d:8000", p)})
			return ok
		}, 10*time.Second, 10*time.Millisecond)
	}
	mu.Lock()
	lat = lat[:0]
	mu.Unlock()

	interval := time.Duration(float64(time.Second) * batchBlocks / blocksPerSec)
	b.ResetTimer()
	next := time.Now()
	for i := range b.N {
		pub := pubs[i%pods]
		for j := range batch.Events[0].BlockHashes {
			batch.Events[0].BlockHashes[j] = uint64(i*batchBlocks+j) + 1
		}
		if d := time.Until(next); d > 0 {
			time.Sleep(d)
		}
		// Stored before publishing: the replicas may apply the batch before
		// Publish returns.
		seq := nextSeq[i%pods]
		nextSeq[i%pods]++
		sent.Store(key{fmt.Sprintf("10.2.0.%d:8000", i%pods), seq}, time.Now())
		got, err := pub.Publish(batch)
		require.NoError(b, err)
		require.Equal(b, seq, got)
		next = next.Add(interval)
	}
	want := b.N
	require.Eventually(b, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(lat) >= want
	}, 20*time.Second, 10*time.Millisecond, "not every batch reached every replica: relay %+v, subscriber %+v, %d latencies, %d partly seen, replicas %+v %+v %+v",
		relay.Stats(), sub.Stats(), len(lat), len(seen), rs[0].Status(), rs[1].Status(), rs[2].Status())
	b.StopTimer()
	mu.Lock()
	defer mu.Unlock()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(b.N*batchBlocks)/b.Elapsed().Seconds(), "blocks/s")
}
