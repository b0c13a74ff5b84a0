//go:build cgo

package zmq

import (
	"context"
	"fmt"
	"net"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// waitLong bounds every wait for a condition: generous, since a test that
// passes returns as soon as its condition holds, and `make test` runs
// under -race on shared, loaded machines.
const waitLong = 30 * time.Second

func localEP(port int) string { return fmt.Sprintf("tcp://127.0.0.1:%d", port) }
func anyEP(port int) string   { return fmt.Sprintf("tcp://*:%d", port) }

// startSubscriber runs a subscriber until the test ends.
func startSubscriber(t testing.TB, cfg SubscriberConfig) *Subscriber {
	t.Helper()
	s, err := NewSubscriber(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	select {
	case <-s.Ready():
	case err := <-done:
		done <- err // for the cleanup
		t.Fatalf("Run returned before it was ready: %v", err)
	}
	return s
}

func newPublisher(t testing.TB, cfg PublisherConfig) *Publisher {
	t.Helper()
	p, err := NewPublisher(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p
}

// warmUp waits until p's subscription has reached it, then publishes one
// empty batch and waits until the subscriber has applied it, so that the
// test's own batches are neither lost nor mixed with warm-up ones.
func warmUp(t testing.TB, p *Publisher, s *Subscriber, rank int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	defer cancel()
	require.NoError(t, p.WaitSubscribed(ctx), "the subscription never reached the publisher")
	before := s.Stats().Batches
	_, err := p.Publish(&events.Batch{TS: 1, DPRank: events.Some(rank)})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return s.Stats().Batches > before }, waitLong, time.Millisecond,
		"no batch reached the subscriber")
}

func stored(rank int, parent *uint64, keys ...uint64) events.Batch {
	e := events.Event{Type: events.EventBlockStored, BlockHashes: keys, BlockSize: 4, Medium: "GPU"}
	if parent != nil {
		e.Parent = events.Some(*parent)
	}
	return events.Batch{TS: 1, DPRank: events.Some(rank), Events: []events.Event{e}}
}

func publish(t testing.TB, p *Publisher, bs ...events.Batch) {
	t.Helper()
	for i := range bs {
		_, err := p.Publish(&bs[i])
		require.NoError(t, err)
	}
}

func ptr(v uint64) *uint64 { return &v }

func statusOf(s *Subscriber, h index.Holder) events.HolderStatus {
	for _, st := range s.Status() {
		if st.Holder() == h {
			return st
		}
	}
	return events.HolderStatus{}
}

func requireKeys(t testing.TB, sink *eventstest.RecSink, model string, h index.Holder, tier string, want ...uint64) {
	t.Helper()
	require.Eventually(t, func() bool {
		return slices.Equal(sink.Keys(model, h, tier), want)
	}, waitLong, 10*time.Millisecond, "want %v, have %v", want, sink.Keys(model, h, tier))
}

// settled waits until s has handled every message it received. A batch's
// blocks reach the sink before its handling ends (the holder's sequence
// number, its state, the confirmation of a reconnect and a replay's
// counters come after), so a test that reads a status after requireKeys
// waits for this first.
func settled(t testing.TB, s *Subscriber) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	defer cancel()
	require.NoError(t, s.Sync(ctx))
}

// closedEngine closes p, an engine process that dies, and waits until s has
// seen its connection close: a restarted engine's successor connects only
// after its predecessor is gone, and in bind mode a close seen after the
// successor's first message would take the pod down again (the subscriber
// cannot tell which of an address's connections closed; see links).
func closedEngine(t testing.TB, p *Publisher, s *Subscriber, h index.Holder) {
	t.Helper()
	require.NoError(t, p.Close())
	require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateDisconnected }, waitLong, 5*time.Millisecond,
		"the closed engine's connection never closed at the subscriber")
}

const testModel = "org/llama@v2"

func TestParseTopic(t *testing.T) {
	tests := []struct {
		topic, pod, model string
		ok                bool
	}{
		{"kv@10.0.0.1:8000@meta/llama", "10.0.0.1:8000", "meta/llama", true},
		{"kv@pod-a@org/model@v2", "pod-a", "org/model@v2", true},
		{"kv@[::1]:8000@m", "[::1]:8000", "m", true},
		{"kv@pod@", "pod", "", true},
		{"kv@pod", "", "", false},
		{"kv@@model", "", "", false},
		{"xx@pod@model", "", "", false},
		{"", "", "", false},
	}
	for _, tc := range tests {
		pod, model, ok := events.ParseTopic(tc.topic)
		require.Equal(t, tc.ok, ok, tc.topic)
		require.Equal(t, tc.pod, pod, tc.topic)
		require.Equal(t, tc.model, model, tc.topic)
	}
}

func TestNewSubscriberRejectsBadConfig(t *testing.T) {
	_, err := NewSubscriber(SubscriberConfig{})
	require.ErrorIs(t, err, events.ErrConfig)
	_, err = NewSubscriber(SubscriberConfig{Events: events.Config{Sink: eventstest.NewRecSink()}, Bind: []string{"127.0.0.1:5557"}})
	require.ErrorIs(t, err, ErrBadEndpoint)
	sha, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	_, err = NewSubscriber(SubscriberConfig{Events: events.Config{Sink: eventstest.NewRecSink(), ContentKeys: sha}})
	require.ErrorIs(t, err, events.ErrConfig)
	s, err := NewSubscriber(SubscriberConfig{Events: events.Config{Sink: eventstest.NewRecSink()}})
	require.NoError(t, err)
	for _, ep := range []string{"localhost:1", "tcp://127.0.0.1", "tcp://127.0.0.1:", "tcp://:5557", "tcp://127.0.0.1:0",
		"tcp://127.0.0.1:*", "tcp://*:5557", "tcp://127.0.0.1:65536", "tcp://127.0.0.1:http", "ipc://"} {
		require.ErrorIs(t, s.AddPod("p", ep, ""), ErrBadEndpoint, ep)
		require.ErrorIs(t, s.AddPod("p", "tcp://127.0.0.1:1", ep), ErrBadEndpoint, "replay %s", ep)
	}
	for _, ep := range []string{"tcp://10.0.0.7:5557", "tcp://[fd00::1]:5557", "tcp://vllm-0.svc:5557", "tcp://127.0.0.2:0;127.0.0.1:5557", "ipc:///tmp/kv"} {
		require.NoError(t, s.AddPod("p", ep, ""), ep)
	}
	for _, ep := range []string{"tcp://*:5557", "tcp://127.0.0.1:0", "tcp://127.0.0.1:*", "tcp://eth0:5557"} {
		require.NoError(t, checkEndpoint(ep, false), ep)
	}
	require.ErrorIs(t, s.AddPod("", "tcp://127.0.0.1:1", ""), events.ErrConfig)
}

func TestBindModeKeepsRanksApartAndMapsTopics(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}, TopicPrefix: "kv@"})
	topic := "kv@127.0.0.1:8000@" + testModel
	p0 := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: topic})
	p1 := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: topic, Layout: events.LayoutArray})
	other := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "other@x@y"})
	warmUp(t, p0, s, 0)
	warmUp(t, p1, s, 1)
	publish(t, p0, stored(0, nil, 1, 2), stored(0, ptr(2), 3))
	publish(t, p1, stored(1, nil, 11, 12))
	publish(t, other, stored(0, nil, 99))
	r0, r1 := index.Holder{Pod: "127.0.0.1:8000"}, index.Holder{Pod: "127.0.0.1:8000", Rank: 1}
	requireKeys(t, sink, testModel, r0, "GPU", 1, 2, 3)
	requireKeys(t, sink, testModel, r1, "GPU", 11, 12)
	settled(t, s)
	st := statusOf(s, r1)
	require.Equal(t, testModel, st.Model)
	require.Equal(t, "live", st.State)
	require.Zero(t, s.Stats().BadMessages, "the prefix filter keeps other topics out")
}

func TestBindModeCountsTopicsTheMapperRejects(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
	p := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "not-a-kv-topic"})
	require.Eventually(t, func() bool {
		publish(t, p, stored(0, nil, 5))
		return s.Stats().BadMessages > 0
	}, waitLong, 20*time.Millisecond)
	require.Zero(t, s.Stats().Batches)
}

func TestConnectModeAddsAndRemovesPodsAtRunTime(t *testing.T) {
	t.Parallel()
	pa, pb := testenv.FreePort(t), testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	// A caller-supplied mapper: the model is the whole topic.
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Topic: func(topic string) (string, string, bool) { return "", topic, true }})
	a := newPublisher(t, PublisherConfig{Bind: anyEP(pa), Topic: "m1"})
	b := newPublisher(t, PublisherConfig{Bind: anyEP(pb), Topic: "m1", Layout: events.LayoutArray, Trim: 5})
	require.NoError(t, s.AddPod("pod-a", localEP(pa), ""))
	require.NoError(t, s.AddPod("pod-b", localEP(pb), ""))
	warmUp(t, a, s, 0)
	warmUp(t, b, s, 0)
	publish(t, a, stored(0, nil, 1))
	publish(t, b, stored(0, nil, 2))
	ha, hb := index.Holder{Pod: "pod-a"}, index.Holder{Pod: "pod-b"}
	requireKeys(t, sink, "m1", ha, "GPU", 1)
	requireKeys(t, sink, "m1", hb, "GPU", 2)

	s.RemovePod("pod-b")
	require.Eventually(t, func() bool {
		publish(t, a, stored(0, nil, 10))
		publish(t, b, stored(0, nil, 20))
		return len(sink.Keys("m1", ha, "GPU")) > 1
	}, waitLong, 50*time.Millisecond)
	// The receive loop closes pod-b's socket when it takes the change, before
	// it drains again: from then on nothing pod-b sends can land.
	require.Eventually(t, func() bool { return !s.dirty.Load() }, waitLong, 5*time.Millisecond)
	before := s.Stats().Messages
	publish(t, b, stored(0, nil, 21))
	publish(t, a, stored(0, nil, 11))
	requireKeys(t, sink, "m1", ha, "GPU", 1, 10, 11)
	require.NotContains(t, sink.Keys("m1", hb, "GPU"), uint64(21))
	require.Greater(t, s.Stats().Messages, before)
}

func TestEndpointsListConnectModePodsWhetherOrNotTheirEnginesAreUp(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: eventstest.NewRecSink()}})
	require.NoError(t, s.AddPod("pod-a", localEP(port), ""))
	// No engine there yet: listed, not connected, and no holder.
	require.Equal(t, []EndpointStatus{{Pod: "pod-a", Endpoint: localEP(port)}}, s.Endpoints())
	require.Empty(t, s.Status())

	p := newPublisher(t, PublisherConfig{Bind: anyEP(port), Topic: "kv@pod-a@m"})
	require.Eventually(t, func() bool { return s.Endpoints()[0].Connected }, waitLong, 5*time.Millisecond)
	require.NoError(t, p.Close())
	require.Eventually(t, func() bool { return !s.Endpoints()[0].Connected }, waitLong, 5*time.Millisecond)
}

func TestGapIsRecoveredByReplayInBothFormats(t *testing.T) {
	for _, format := range []ReplayFormat{ReplayV26, ReplayV25} {
		t.Run(fmt.Sprint(format), func(t *testing.T) {
			t.Parallel()
			port, rport := testenv.FreePort(t), testenv.FreePort(t)
			sink := eventstest.NewRecSink()
			s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}})
			var drop atomic.Int64
			drop.Store(-1)
			p := newPublisher(t, PublisherConfig{Bind: anyEP(port), ReplayEndpoint: anyEP(rport), Topic: "kv@pod@m",
				ReplayFormat: format, Drop: func(seq uint64) bool { return int64(seq) == drop.Load() }})
			require.NoError(t, s.AddPod("pod", localEP(port), localEP(rport)))
			warmUp(t, p, s, 0)
			h := index.Holder{Pod: "pod"}
			// Joining after seq 0 may already have fetched the earlier batches.
			replaysBefore := statusOf(s, h).Replays
			seq, err := p.Publish(&events.Batch{DPRank: events.Some(0), TS: 1})
			require.NoError(t, err)
			drop.Store(int64(seq + 2))
			publish(t, p, stored(0, nil, 1), stored(0, ptr(1), 2), stored(0, ptr(2), 3))
			requireKeys(t, sink, "m", h, "GPU", 1, 2, 3)
			settled(t, s)
			st := statusOf(s, h)
			require.Equal(t, uint64(1), st.Gaps)
			require.Equal(t, replaysBefore+1, st.Replays)
			require.Zero(t, st.Unrecovered)
			require.Zero(t, sink.ClearCount(h))
			require.Equal(t, "live", st.State)
			require.Equal(t, seq+3, st.LastSeq)
		})
	}
}

func TestUnrecoverableGapFollowsThePolicy(t *testing.T) {
	tests := []struct {
		policy    events.GapPolicy
		keys      []uint64
		state     string
		cleared   int
		afterClrd string
	}{
		{events.GapClear, []uint64{3}, "live", 1, "live"},
		{events.GapKeep, []uint64{1, 3}, "stale", 0, "live"},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprint(tc.policy), func(t *testing.T) {
			t.Parallel()
			port := testenv.FreePort(t)
			sink := eventstest.NewRecSink()
			s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, Gap: tc.policy}})
			var drop atomic.Int64
			drop.Store(-1)
			p := newPublisher(t, PublisherConfig{Bind: anyEP(port), Topic: "kv@pod@m",
				Drop: func(seq uint64) bool { return int64(seq) == drop.Load() }})
			require.NoError(t, s.AddPod("pod", localEP(port), ""))
			warmUp(t, p, s, 0)
			seq, err := p.Publish(&events.Batch{DPRank: events.Some(0), TS: 1})
			require.NoError(t, err)
			drop.Store(int64(seq + 2))
			// Block 1 stored, the batch removing it lost, block 3 stored.
			publish(t, p, stored(0, nil, 1))
			publish(t, p, events.Batch{TS: 1, DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockRemoved, BlockHashes: []uint64{1}, Medium: "GPU"}}})
			publish(t, p, stored(0, nil, 3))
			h := index.Holder{Pod: "pod"}
			requireKeys(t, sink, "m", h, "GPU", tc.keys...)
			settled(t, s)
			st := statusOf(s, h)
			require.Equal(t, uint64(1), st.Gaps)
			require.Equal(t, uint64(1), st.Unrecovered)
			require.Equal(t, tc.state, st.State)
			require.Equal(t, tc.cleared, sink.ClearCount(h))

			publish(t, p, events.Batch{TS: 1, DPRank: events.Some(0), Events: []events.Event{{Type: events.EventAllBlocksCleared}}})
			require.Eventually(t, func() bool { return statusOf(s, h).State == tc.afterClrd && len(sink.Keys("m", h, "GPU")) == 0 },
				waitLong, 10*time.Millisecond)
		})
	}
}

func TestEngineRestartClearsTheHolderThenApplies(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
	h := index.Holder{Pod: "pod"}
	first := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@pod@m"})
	warmUp(t, first, s, 0)
	for range 50 {
		publish(t, first, events.Batch{DPRank: events.Some(0), TS: 1})
	}
	publish(t, first, stored(0, nil, 1, 2))
	requireKeys(t, sink, "m", h, "GPU", 1, 2)
	closedEngine(t, first, s, h)

	second := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@pod@m"})
	warmUp(t, second, s, 0)
	publish(t, second, stored(0, nil, 7))
	requireKeys(t, sink, "m", h, "GPU", 7)
	settled(t, s)
	st := statusOf(s, h)
	require.Equal(t, uint64(1), st.Restarts)
	require.Equal(t, 1, sink.ClearCount(h))
	require.Equal(t, "live", st.State)
}

func TestInitialSeqsFetchWhatARestoredRouterMissed(t *testing.T) {
	t.Parallel()
	port, rport := testenv.FreePort(t), testenv.FreePort(t)
	p := newPublisher(t, PublisherConfig{Bind: anyEP(port), ReplayEndpoint: anyEP(rport), Topic: "kv@pod@m"})
	// Published before the router runs: seq 0-1 are in its snapshot, 2-3
	// are not.
	publish(t, p, stored(0, nil, 100), stored(0, nil, 101), stored(0, nil, 102), stored(0, nil, 103))
	h := index.Holder{Pod: "pod"}
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, InitialSeqs: map[index.Holder]uint64{h: 1}}})
	require.NoError(t, s.AddPod("pod", localEP(port), localEP(rport)))
	warmUp(t, p, s, 0)
	requireKeys(t, sink, "m", h, "GPU", 102, 103)
	// The replay is counted once it returns, after its batches applied.
	require.NoError(t, s.Sync(t.Context()))
	st := statusOf(s, h)
	require.Equal(t, uint64(1), st.Gaps)
	require.Equal(t, uint64(1), st.Replays)
	require.Zero(t, st.Unrecovered)
}

func TestMalformedPayloadIsCountedAndOtherPodsKeepTheirState(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	var logs testenv.SyncBuffer
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, Logger: testenv.TextLogger(&logs)}, Bind: []string{localEP(port)}})
	good := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@good@m"})
	bad := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@bad@m"})
	warmUp(t, good, s, 0)
	publish(t, good, stored(0, nil, 1))
	require.Eventually(t, func() bool {
		_, err := bad.PublishPayload([]byte{0x93, 0xc0})
		require.NoError(t, err)
		return s.Stats().DecodeErrors > 0
	}, waitLong, 20*time.Millisecond)
	publish(t, good, stored(0, nil, 2))
	requireKeys(t, sink, "m", index.Holder{Pod: "good"}, "GPU", 1, 2)
	st := statusOf(s, index.Holder{Pod: "bad"})
	require.NotZero(t, st.DecodeErrors)
	require.Equal(t, "stale", st.State, "a pod known only by malformed payloads is not trusted")
	require.Zero(t, statusOf(s, index.Holder{Pod: "good"}).DecodeErrors)
	malformedLine := regexp.MustCompile(`ERROR msg="events: dropped malformed payload" pod=bad seq=\d+`)
	require.Eventually(t, func() bool { return malformedLine.MatchString(logs.String()) }, waitLong, 5*time.Millisecond,
		"the counter moves before the line is written")
}

// A queue full by message count, or one with room for thousands of
// messages but a byte bound of a few, drops what does not fit, counts it,
// and replay resyncs the pod; bytes and slots come back as messages apply,
// so the pod's next batch is taken.
func TestQueueDropsAreCountedAndResyncedByReplay(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  events.Config
	}{
		{"full by messages", events.Config{Workers: 1, QueueLen: 1, EnqueueTimeout: time.Millisecond}},
		{"over its byte bound", events.Config{Workers: 1, QueueLen: 4096, QueueBytes: 256}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			port, rport := testenv.FreePort(t), testenv.FreePort(t)
			sink := eventstest.NewRecSink()
			tc.cfg.Sink = sink
			s := startSubscriber(t, SubscriberConfig{Events: tc.cfg})
			p := newPublisher(t, PublisherConfig{Bind: anyEP(port), ReplayEndpoint: anyEP(rport), Topic: "kv@pod@m"})
			require.NoError(t, s.AddPod("pod", localEP(port), localEP(rport)))
			warmUp(t, p, s, 0)
			release := sink.Stall()
			var want []uint64
			for i := range uint64(40) {
				publish(t, p, stored(0, nil, 1000+i))
				want = append(want, 1000+i)
			}
			require.Eventually(t, func() bool { return s.Stats().QueueFull > 0 }, waitLong, 5*time.Millisecond)
			release()
			requireKeys(t, sink, "m", index.Holder{Pod: "pod"}, "GPU", want...)
			// A replay counts once its end marker came, after its last batch
			// applied.
			require.Eventually(t, func() bool { return s.Stats().Replays > 0 }, waitLong, 5*time.Millisecond)
			st := s.Stats()
			require.Zero(t, st.Unrecovered)
			full := st.QueueFull
			publish(t, p, stored(0, nil, 2000))
			requireKeys(t, sink, "m", index.Holder{Pod: "pod"}, "GPU", append(want, 2000)...)
			require.Equal(t, full, s.Stats().QueueFull)
		})
	}
}

func TestBindAndConnectModesRunTogether(t *testing.T) {
	t.Parallel()
	bport, cport := testenv.FreePort(t), testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(bport)}})
	viaBind := newPublisher(t, PublisherConfig{Connect: localEP(bport), Topic: "kv@engine-a@m"})
	viaConnect := newPublisher(t, PublisherConfig{Bind: anyEP(cport), Topic: "kv@ignored@m"})
	require.NoError(t, s.AddPod("engine-b", localEP(cport), ""))
	warmUp(t, viaBind, s, 0)
	warmUp(t, viaConnect, s, 0)
	publish(t, viaBind, stored(0, nil, 1))
	publish(t, viaConnect, stored(0, nil, 2))
	requireKeys(t, sink, "m", index.Holder{Pod: "engine-a"}, "GPU", 1)
	requireKeys(t, sink, "m", index.Holder{Pod: "engine-b"}, "GPU", 2)
	require.Empty(t, sink.Keys("m", index.Holder{Pod: "ignored"}, "GPU"), "in connect mode the pod is AddPod's")
}

func TestGapBeyondTheReplayBufferClearsThenAppliesWhatIsLeft(t *testing.T) {
	t.Parallel()
	port, rport := testenv.FreePort(t), testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}})
	var dropFrom atomic.Int64
	dropFrom.Store(-1)
	p := newPublisher(t, PublisherConfig{Bind: anyEP(port), ReplayEndpoint: anyEP(rport), Topic: "kv@pod@m", BufferSteps: 3,
		Drop: func(seq uint64) bool { f := dropFrom.Load(); return f >= 0 && int64(seq) >= f && int64(seq) < f+5 }})
	require.NoError(t, s.AddPod("pod", localEP(port), localEP(rport)))
	warmUp(t, p, s, 0)
	h := index.Holder{Pod: "pod"}
	seq, err := p.Publish(&events.Batch{DPRank: events.Some(0), TS: 1})
	require.NoError(t, err)
	publish(t, p, stored(0, nil, 1))
	requireKeys(t, sink, "m", h, "GPU", 1)
	dropFrom.Store(int64(seq + 2))
	// seq+2..seq+6 are lost; the buffer keeps only seq+5..seq+7.
	for k := range uint64(6) {
		publish(t, p, stored(0, nil, 10+k))
	}
	requireKeys(t, sink, "m", h, "GPU", 13, 14, 15)
	settled(t, s)
	st := statusOf(s, h)
	require.Equal(t, uint64(1), st.Gaps)
	require.Equal(t, uint64(1), st.Unrecovered)
	require.Equal(t, 1, sink.ClearCount(h))
	require.Equal(t, "live", st.State)
	require.Equal(t, seq+7, st.LastSeq)
}

// freePortPair returns a port p with p+1 also free.
func freePortPair(t testing.TB) int {
	t.Helper()
	for range 50 {
		p := testenv.FreePort(t)
		if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p+1)); err == nil {
			l.Close()
			return p
		}
	}
	t.Fatal("no two consecutive free ports")
	return 0
}

func TestBindModeReplaysEachRankFromItsOwnPort(t *testing.T) {
	t.Parallel()
	port, rport := testenv.FreePort(t), freePortPair(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
	require.NoError(t, s.AddPod("pod", "", localEP(rport)))
	var drop atomic.Int64
	drop.Store(-1)
	r0 := newPublisher(t, PublisherConfig{Connect: localEP(port), ReplayEndpoint: localEP(rport), Topic: "kv@pod@m"})
	r1 := newPublisher(t, PublisherConfig{Connect: localEP(port), ReplayEndpoint: localEP(rport + 1), Topic: "kv@pod@m",
		Drop: func(seq uint64) bool { return int64(seq) == drop.Load() }})
	warmUp(t, r0, s, 0)
	warmUp(t, r1, s, 1)
	seq, err := r1.Publish(&events.Batch{TS: 1, DPRank: events.Some(1)})
	require.NoError(t, err)
	drop.Store(int64(seq + 1))
	publish(t, r1, stored(1, nil, 5), stored(1, nil, 6))
	publish(t, r0, stored(0, nil, 1))
	h1 := index.Holder{Pod: "pod", Rank: 1}
	requireKeys(t, sink, "m", h1, "GPU", 5, 6)
	requireKeys(t, sink, "m", index.Holder{Pod: "pod"}, "GPU", 1)
	settled(t, s)
	require.Zero(t, statusOf(s, h1).Unrecovered)
}

func TestDeadReplayEndpointFailsOnceThenBacksOff(t *testing.T) {
	t.Parallel()
	port, dead := testenv.FreePort(t), testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, ReplayTimeout: 100 * time.Millisecond})
	var drop1, drop2 atomic.Int64
	drop1.Store(-1)
	drop2.Store(-1)
	p := newPublisher(t, PublisherConfig{Bind: anyEP(port), Topic: "kv@pod@m",
		Drop: func(seq uint64) bool { return int64(seq) == drop1.Load() || int64(seq) == drop2.Load() }})
	require.NoError(t, s.AddPod("pod", localEP(port), localEP(dead)))
	warmUp(t, p, s, 0)
	seq, err := p.Publish(&events.Batch{DPRank: events.Some(0), TS: 1})
	require.NoError(t, err)
	drop1.Store(int64(seq + 1))
	drop2.Store(int64(seq + 3))
	publish(t, p, stored(0, nil, 1), stored(0, nil, 2), stored(0, nil, 3), stored(0, nil, 4))
	h := index.Holder{Pod: "pod"}
	requireKeys(t, sink, "m", h, "GPU", 4)
	settled(t, s)
	st := statusOf(s, h)
	require.Equal(t, uint64(2), st.Gaps)
	require.Equal(t, uint64(2), st.Unrecovered)
	require.Equal(t, uint64(1), s.Stats().ReplayErrors, "the second gap skips the endpoint that just failed")
}

func TestRestartedEngineFetchesTheFirstBatchesItsSubscriberMissed(t *testing.T) {
	t.Parallel()
	port, rport := testenv.FreePort(t), testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
	require.NoError(t, s.AddPod("pod", "", localEP(rport)))
	h := index.Holder{Pod: "pod"}
	first := newPublisher(t, PublisherConfig{Connect: localEP(port), ReplayEndpoint: localEP(rport), Topic: "kv@pod@m"})
	warmUp(t, first, s, 0)
	for range 50 {
		publish(t, first, events.Batch{DPRank: events.Some(0), TS: 1})
	}
	publish(t, first, stored(0, nil, 1, 2))
	requireKeys(t, sink, "m", h, "GPU", 1, 2)
	closedEngine(t, first, s, h)

	// The new process's first three batches never reach the subscriber;
	// its replay buffer has them.
	// libzmq releases the first process's replay port asynchronously.
	var second *Publisher
	require.Eventually(t, func() bool {
		var err error
		second, err = NewPublisher(PublisherConfig{Connect: localEP(port), ReplayEndpoint: localEP(rport), Topic: "kv@pod@m",
			Drop: func(seq uint64) bool { return seq < 3 }})
		return err == nil
	}, waitLong, 20*time.Millisecond)
	t.Cleanup(func() { require.NoError(t, second.Close()) })
	publish(t, second, stored(0, nil, 7), stored(0, ptr(7), 8), stored(0, nil, 9))
	warmUp(t, second, s, 0)
	requireKeys(t, sink, "m", h, "GPU", 7, 8, 9)
	// The replayed blocks show before the batch that started the replay,
	// whose handling confirms the reconnect, is done.
	settled(t, s)
	st := statusOf(s, h)
	require.Equal(t, uint64(1), st.Restarts)
	require.Zero(t, st.Unrecovered)
	require.Equal(t, "live", st.State)
}

func TestReplayEndingPartWayThroughAJoinAppliesTheGapPolicy(t *testing.T) {
	t.Parallel()
	port, rport := testenv.FreePort(t), testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, ReplayTimeout: 100 * time.Millisecond})
	// Seq 0 stores block 1 and seq 1 removes it; replay sends only seq 0.
	startStingyReplay(t, localEP(rport), stored(0, nil, 1))
	p := newPublisher(t, PublisherConfig{Bind: anyEP(port), Topic: "kv@pod@m",
		Drop: func(seq uint64) bool { return seq < 2 }})
	publish(t, p, stored(0, nil, 1),
		events.Batch{TS: 1, DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockRemoved, BlockHashes: []uint64{1}, Medium: "GPU"}}})
	require.NoError(t, s.AddPod("pod", localEP(port), localEP(rport)))
	h := index.Holder{Pod: "pod"}
	require.Eventually(t, func() bool {
		publish(t, p, stored(0, nil, 3))
		return slices.Contains(sink.Keys("m", h, "GPU"), 3)
	}, waitLong, 50*time.Millisecond)
	require.NotContains(t, sink.Keys("m", h, "GPU"), uint64(1), "block 1 was removed in a batch replay did not send")
	settled(t, s)
	st := statusOf(s, h)
	require.Equal(t, uint64(1), st.Unrecovered)
	require.Equal(t, 1, sink.ClearCount(h))
}

func TestRunLeavesNoGoroutinesBehind(t *testing.T) {
	before := runtime.NumGoroutine()
	bport, cport, rport := testenv.FreePort(t), testenv.FreePort(t), testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s, err := NewSubscriber(SubscriberConfig{Events: events.Config{Sink: sink, Workers: 3}, Bind: []string{localEP(bport)}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	viaBind, err := NewPublisher(PublisherConfig{Connect: localEP(bport), Topic: "kv@a@m"})
	require.NoError(t, err)
	viaConnect, err := NewPublisher(PublisherConfig{Bind: anyEP(cport), ReplayEndpoint: anyEP(rport), Topic: "kv@b@m"})
	require.NoError(t, err)
	require.NoError(t, s.AddPod("b", localEP(cport), localEP(rport)))
	warmUp(t, viaBind, s, 0)
	warmUp(t, viaConnect, s, 0)
	publish(t, viaConnect, stored(0, nil, 1))
	requireKeys(t, sink, "m", index.Holder{Pod: "b"}, "GPU", 1)
	s.RemovePod("b")
	cancel()
	require.NoError(t, <-done)
	require.NoError(t, viaBind.Close())
	require.NoError(t, viaConnect.Close())
	// Polled here rather than with require.Eventually, whose own goroutine
	// would be counted.
	deadline := time.Now().Add(waitLong)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	require.LessOrEqual(t, runtime.NumGoroutine(), before)
}

func TestUnknownEventIsCountedAndTheRestOfItsBatchApplies(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
	p := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@pod@m"})
	warmUp(t, p, s, 0)
	payload, err := msgpack.Marshal([]any{1.5, []any{
		map[string]any{"type": "BlockStored", "block_hashes": []uint64{1, 2}, "parent_block_hash": nil, "token_ids": []uint32{}, "block_size": 4},
		map[string]any{"type": "BlockPinned", "block_hashes": []uint64{1}, "until": 9.5},
		[]any{"BlockMoved", []uint64{2}, "CPU"},
		map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{1}},
	}, 0})
	require.NoError(t, err)
	_, err = p.PublishPayload(payload)
	require.NoError(t, err)
	requireKeys(t, sink, "m", index.Holder{Pod: "pod"}, "GPU", 2)
	st := s.Stats()
	require.Equal(t, uint64(2), st.UnknownEvents)
	require.Zero(t, st.DecodeErrors)
}

func TestHolderWhoseLastMessagesWereDroppedStaysStaleUntilTheGapShows(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, Workers: 1, QueueLen: 4, EnqueueTimeout: time.Millisecond}})
	p := newPublisher(t, PublisherConfig{Bind: anyEP(port), Topic: "kv@pod@m"})
	require.NoError(t, s.AddPod("pod", localEP(port), ""))
	warmUp(t, p, s, 0)
	h := index.Holder{Pod: "pod"}
	release := sink.Stall()
	// One batch blocks the worker in the sink, four wait in its queue, the
	// rest are dropped: the queued ones, older, apply after the drops.
	const batches = 40
	received := s.Stats().Messages
	var last uint64
	for i := range uint64(batches) {
		var err error
		last, err = p.Publish(&events.Batch{TS: 1, DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: []uint64{100 + i}, Medium: "GPU"}}})
		require.NoError(t, err)
	}
	// Released before every batch has reached the receive loop, the worker
	// would drain its queue and take the late batches, the last among them.
	require.Eventually(t, func() bool { return s.Stats().Messages >= received+batches }, waitLong, 5*time.Millisecond)
	require.NotZero(t, s.Stats().QueueFull)
	release()
	// The worker marks the holder stale when it gets to the drops, which may
	// be after the queued batches.
	require.Eventually(t, func() bool {
		st := s.Stats()
		return st.Messages == st.QueueFull+st.Batches && statusOf(s, h).State == "stale"
	}, waitLong, 5*time.Millisecond, "its last batches were dropped and nothing replays them")
	seq, _ := s.LastSeq(h)
	require.Less(t, seq, last)

	// The next batch shows the gap; the gap policy clears and the holder is
	// live again.
	publish(t, p, stored(0, nil, 7))
	requireKeys(t, sink, "m", h, "GPU", 7)
	settled(t, s)
	require.Equal(t, "live", statusOf(s, h).State)
}

func TestNewHolderPastMaxHoldersEvictsTheLeastRecentlyHeard(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	var logs testenv.SyncBuffer
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, MaxHolders: 2, Logger: testenv.TextLogger(&logs)}, Bind: []string{localEP(port)}})
	a := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@a@m"})
	a1 := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@a@m"})
	warmUp(t, a1, s, 1)
	warmUp(t, a, s, 0)
	publish(t, a1, stored(1, nil, 5))
	requireKeys(t, sink, "m", index.Holder{Pod: "a", Rank: 1}, "GPU", 5)
	publish(t, a, stored(0, nil, 6))
	requireKeys(t, sink, "m", index.Holder{Pod: "a"}, "GPU", 6)

	// b is new at the bound: a rank 1, heard from least recently, makes
	// room, its entries cleared; a keeps its own.
	b := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@b@m"})
	require.Eventually(t, func() bool {
		publish(t, b, stored(0, nil, 7))
		return len(sink.Keys("m", index.Holder{Pod: "b"}, "GPU")) > 0
	}, waitLong, 20*time.Millisecond)
	require.Equal(t, uint64(1), s.Stats().Evicted)
	require.Eventually(t, func() bool { return len(sink.Keys("m", index.Holder{Pod: "a", Rank: 1}, "GPU")) == 0 }, waitLong, 5*time.Millisecond)
	requireKeys(t, sink, "m", index.Holder{Pod: "a"}, "GPU", 6)
	const evicted = "holder limit reached"
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), evicted) }, waitLong, 5*time.Millisecond)
	require.Regexp(t, `pod=a rank=1`, logs.String())

	// Three active holders in two places evict each other, and the
	// warning is rate-limited.
	for i := range 50 {
		publish(t, a1, stored(1, nil, 8))
		publish(t, b, stored(0, nil, uint64(100+i)))
		publish(t, a, stored(0, nil, 9))
	}
	// The three connections' messages arrive in bursts, not in turn.
	require.Eventually(t, func() bool { return s.Stats().Messages >= 150 }, waitLong, 5*time.Millisecond)
	require.NoError(t, s.Sync(t.Context()))
	require.Greater(t, s.Stats().Evicted, uint64(2))
	require.Less(t, strings.Count(logs.String(), evicted), 10, "the warning is rate-limited")
	require.Len(t, s.Status(), 2)

	// Pods known only by their malformed payloads are bounded as well.
	malformed := func(pod string, arrived func() bool) {
		p := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@" + pod + "@m"})
		require.Eventually(t, func() bool {
			_, err := p.PublishPayload([]byte{0xc1})
			require.NoError(t, err)
			return arrived()
		}, waitLong, 20*time.Millisecond)
	}
	for _, pod := range []string{"x", "y"} {
		malformed(pod, func() bool { return statusOf(s, index.Holder{Pod: pod}).DecodeErrors > 0 })
	}
	// z's payloads are counted globally only: the total passes what x and
	// y count (the total read first, so what lands for them meanwhile
	// cannot make up for z).
	malformed("z", func() bool {
		total := s.Stats().DecodeErrors
		return total > statusOf(s, index.Holder{Pod: "x"}).DecodeErrors+statusOf(s, index.Holder{Pod: "y"}).DecodeErrors
	})
	require.Len(t, s.Status(), 4, "two holders and two pods with decode errors")
}
