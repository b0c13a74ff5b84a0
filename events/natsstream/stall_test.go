package natsstream

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/index"
)

// countingHandler counts the records logged at Warn or above, by message.
type countingHandler struct {
	n     atomic.Int64
	bytes atomic.Int64
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		h.n.Add(1)
		size := len(r.Message)
		r.Attrs(func(a slog.Attr) bool { size += len(a.Key) + len(a.Value.String()); return true })
		h.bytes.Add(int64(size))
	}
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

// storeBatch is a batch storing n blocks from first on.
func storeBatch(first uint64, n int) []byte {
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = first + uint64(i)
	}
	return events.AppendBatch(nil, &events.Batch{DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockStored, Medium: "GPU", BlockSize: 16, BlockHashes: keys}}}, events.LayoutMap, 0)
}

// tapWithin taps b on its own goroutine and reports whether Tap returned
// within d: a Tap that does not holds the subscriber's worker.
func tapWithin(r *Relay, b events.TapBatch, d time.Duration) bool {
	done := make(chan struct{})
	go func() { defer close(done); r.Tap(b) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// A batch over the server's max_payload (1 MiB by default) and a subject
// over its control-line limit (a 5,000-byte model name) stall neither
// ingest nor the other pods: the big batch reaches the replicas whole, in
// parts, and the unpublishable one is dropped.
func TestRelayIsNotStalledByABatchTooBigOrASubjectTooLong(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	logs := &countingHandler{}
	relay, err := NewRelay(context.Background(), RelayConfig{JetStream: js, Name: "relay", LeaseTTL: 2 * time.Second, Retain: 10 * time.Second,
		Logger: slog.New(logs)})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = relay.Run(ctx) })
	waitLeader(t, relay)
	r := openReplica(t, js, ReplicaConfig{Name: "replica"})

	const bigBlocks = 300_000 // about 2.7 MiB of msgpack
	big := storeBatch(1<<50, bigBlocks)
	require.Greater(t, len(big), 2<<20)
	start := time.Now()
	require.True(t, tapWithin(relay, events.TapBatch{Model: "m", Pod: "10.0.0.1:8000", Seq: 0, Payload: big}, 2*time.Second),
		"Tap of a batch over max_payload holds the worker")
	require.True(t, tapWithin(relay, events.TapBatch{Model: strings.Repeat("x", 5000), Pod: "10.0.0.2:8000", Seq: 0, Payload: storeBatch(1<<30, 1)}, 2*time.Second),
		"Tap of a batch with a subject over the control-line limit holds the worker")
	require.True(t, tapWithin(relay, events.TapBatch{Model: "m", Pod: "10.0.0.3:8000", Seq: 0, Payload: storeBatch(1<<40, 4)}, 2*time.Second),
		"Tap of a good batch after the bad ones holds the worker")

	ix := r.Index()
	blocks := func(pod string) int { return ix.HolderBlocks("m", index.Holder{Pod: pod})["GPU"] }
	require.Eventually(t, func() bool { return blocks("10.0.0.3:8000") == 4 }, waitLong, 10*time.Millisecond,
		"the good pod never reached the replica")
	require.Eventually(t, func() bool { return blocks("10.0.0.1:8000") == bigBlocks }, waitLong, 10*time.Millisecond,
		"the big batch never reached the replica whole")
	elapsed := time.Since(start).Seconds()
	t.Logf("warn lines: %d (%d bytes) in %.1fs", logs.n.Load(), logs.bytes.Load(), elapsed)
	require.LessOrEqual(t, logs.n.Load(), int64(3), "one line per kind of trouble")

	st := relay.Stats()
	require.Equal(t, uint64(1), st.TooLong)
	require.Equal(t, uint64(1), st.Dropped)
	require.Equal(t, uint64(1), st.Split)
	require.Equal(t, uint64(3), st.Parts, "2.7 MiB in 1 MiB messages")
	require.Equal(t, uint64(2), st.Published)
	require.Zero(t, st.Backlog)
	require.Equal(t, int64(1<<20), st.MaxPayload)
	require.NoError(t, relay.Healthy())
	require.Equal(t, uint64(1), r.Status().Joined)
	require.Zero(t, r.Status().DroppedParts)
	require.Zero(t, r.Status().BadMessages)
}

// While NATS is down, Tap returns at once, what it took waits (bounded by
// RetainN) and health says the relay is stalled; once NATS is back the
// backlog is published in order and health recovers.
func TestRelayTapDoesNotWaitForAStreamThatIsDown(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	relay, err := NewRelay(context.Background(), RelayConfig{JetStream: js, Name: "relay", LeaseTTL: 2 * time.Second, Retain: 30 * time.Second, RetainN: 50})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = relay.Run(ctx) })
	waitLeader(t, relay)
	r := openReplica(t, js, ReplicaConfig{Name: "replica", MaxLag: time.Minute})
	relay.Tap(events.TapBatch{Model: "m", Pod: "10.0.0.1:8000", Seq: 0, Payload: storeBatch(1, 1)})
	require.NoError(t, relay.Flush(context.Background()))

	env.srv.Shutdown()
	env.srv.WaitForShutdown()
	start := time.Now()
	for seq := range uint64(100) {
		require.True(t, tapWithin(relay, events.TapBatch{Model: "m", Pod: "10.0.0.1:8000", Seq: seq + 1, Payload: storeBatch(100+seq, 1)}, time.Second))
	}
	require.Less(t, time.Since(start), time.Second, "100 Taps with NATS down")
	require.Eventually(t, func() bool { return relay.Healthy() != nil }, waitLong, 10*time.Millisecond)
	st := relay.Stats()
	require.Equal(t, 50, st.Backlog, "RetainN bounds the backlog")
	require.Equal(t, uint64(50), st.Expired)
	require.Equal(t, uint64(50), st.Dropped)

	env.start()
	// The lease survives a short outage, or is taken again: either way
	// the backlog is published.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.Eventually(t, func() bool { return relay.Leader() && relay.Stats().Backlog == 0 }, 20*time.Second, 10*time.Millisecond)
	require.NoError(t, relay.Flush(ctx))
	require.NoError(t, relay.Healthy())
	require.Equal(t, uint64(1+50), relay.Stats().Published, "the expired ones are not published")
	waitApplied(t, streamLast(t, js), r)
	// The replica saw the gap the expired batches left, cleared the
	// holder, and applied what came after: the last 50 blocks.
	require.Equal(t, 50, r.Index().HolderBlocks("m", index.Holder{Pod: "10.0.0.1:8000"})["GPU"])
	require.NotZero(t, r.Status().Gaps)
}
