//go:build cgo

package zmq

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
	"github.com/kvsource/kvsource/internal/vllmpod"
)

// Tests against vLLM's publisher behaviours nobody on this project chose:
// its default empty topic and its replay socket's dropped replies
// (internal/vllmpod).

func startPod(t *testing.T, cfg vllmpod.Config) *vllmpod.Pod {
	t.Helper()
	p, err := vllmpod.Start(cfg)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

func podPublish(t *testing.T, p *vllmpod.Pod, b events.Batch) {
	t.Helper()
	_, err := p.Publish(events.AppendBatch(nil, &b, events.LayoutMap, 0))
	require.NoError(t, err)
}

func TestEmptyTopicTakesTheModelFromThePodOrIsDroppedNamingTheFix(t *testing.T) {
	t.Parallel()
	var logs testenv.SyncBuffer
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, Logger: testenv.TextLogger(&logs)}})
	withModel, without := testenv.FreePort(t), testenv.FreePort(t)
	// vLLM's default topic is "".
	pa, pb := startPod(t, vllmpod.Config{Endpoint: localEP(withModel)}), startPod(t, vllmpod.Config{Endpoint: localEP(without)})
	require.NoError(t, s.AddPodConfig(PodConfig{Pod: "a", Endpoint: localEP(withModel), Model: testModel}))
	require.NoError(t, s.AddPod("b", localEP(without), ""))
	a, b := index.Holder{Pod: "a"}, index.Holder{Pod: "b"}
	require.Eventually(t, func() bool {
		podPublish(t, pa, stored(0, nil, 1))
		podPublish(t, pb, stored(0, nil, 2))
		return len(sink.Keys(testModel, a, "GPU")) > 0 && s.Stats().NoModel > 0
	}, waitLong, 20*time.Millisecond)
	require.Equal(t, testModel, statusOf(s, a).Model)
	require.Equal(t, events.HolderStatus{}, statusOf(s, b), "no holder under an empty model")
	require.Empty(t, sink.Keys("", b, "GPU"))
	require.Contains(t, logs.String(), "pod=b")
	require.Contains(t, logs.String(), "model=MODEL")
	require.Contains(t, logs.String(), "seq=")
}

func TestBindModeCountsTopicsByReasonAndLogsEachOncePerInterval(t *testing.T) {
	t.Parallel()
	var logs testenv.SyncBuffer
	port := testenv.FreePort(t)
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: eventstest.NewRecSink(), Logger: testenv.TextLogger(&logs)},
		Bind: []string{localEP(port)}})
	var pods []*vllmpod.Pod
	for _, topic := range []string{"", "kv-events", "kv@127.0.0.1:8000@"} {
		pods = append(pods, startPod(t, vllmpod.Config{Endpoint: localEP(port), Connect: true, Topic: topic}))
	}
	require.Eventually(t, func() bool {
		for _, p := range pods {
			podPublish(t, p, stored(0, nil, 5))
		}
		st := s.Stats()
		return st.EmptyTopic >= 3 && st.UnknownTopic >= 3 && st.NoModel >= 3
	}, waitLong, 5*time.Millisecond)
	// Messages still in flight when the loop ended count in one counter
	// before the other: wait for the two to agree.
	var st events.Stats
	require.Eventually(t, func() bool {
		st = s.Stats()
		return st.EmptyTopic+st.UnknownTopic+st.NoModel == st.BadMessages
	}, waitLong, 5*time.Millisecond)
	require.Zero(t, st.Batches)
	out := logs.String()
	// The limiter's interval is a second; the loop above may span a few.
	for _, msg := range []string{"vLLM's default empty topic", "topic names no pod", "a pod with no model"} {
		n := strings.Count(out, msg)
		require.GreaterOrEqual(t, n, 1, msg)
		require.Less(t, uint64(n), st.BadMessages, "%q is rate limited", msg)
	}
	require.Contains(t, out, "set topic to kv@POD@MODEL in the engine's kv_events_config")
	require.Contains(t, out, "pod=127.0.0.1:8000")
}

// TestReplayRecoversRepliesLostInTransit: the pod's replay socket queues
// 200 replies at most and sends faster than the subscriber applies, so most
// replies of one request are dropped; later rounds fetch them.
func TestReplayRecoversRepliesLostInTransit(t *testing.T) {
	t.Parallel()
	pubPort, replayPort := testenv.FreePort(t), testenv.FreePort(t)
	pod := startPod(t, vllmpod.Config{Endpoint: localEP(pubPort), ReplayEndpoint: localEP(replayPort),
		Topic: "kv@pod@" + testModel, ReplaySndHWM: 200})
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, ReplayDeadline: 20 * time.Second},
		ReplayTimeout: time.Second})
	require.NoError(t, s.AddPod("pod", localEP(pubPort), localEP(replayPort)))
	h := index.Holder{Pod: "pod"}
	batch := func(i int) []byte {
		b := stored(0, nil, uint64(i)+1)
		return events.AppendBatch(nil, &b, events.LayoutMap, 0)
	}
	// Until the subscription is up a PUB socket drops what it sends (and
	// replay fills what came before the first batch seen): publish until
	// the last batch sent is applied, checking before each new one.
	next := 0
	require.Eventually(t, func() bool {
		if seq, ok := s.LastSeq(h); ok && next > 0 && seq == uint64(next-1) {
			return true
		}
		_, err := pod.Publish(batch(next))
		require.NoError(t, err)
		next++
		return false
	}, waitLong, 20*time.Millisecond)
	const stall = 600
	for range stall {
		pod.Withhold(batch(next))
		next++
	}
	_, err := pod.Publish(batch(next))
	require.NoError(t, err)
	next++
	require.Eventually(t, func() bool { seq, _ := s.LastSeq(h); return seq == uint64(next-1) }, waitLong, 10*time.Millisecond)
	st := s.Stats()
	require.Len(t, sink.Keys(testModel, h, "GPU"), next, "every batch applied; %+v, %d replies dropped", st, pod.Dropped())
	require.Zero(t, st.Unrecovered)
	t.Logf("dropped %d replies; %d rounds recovered %d batches", pod.Dropped(), st.ReplayRounds, st.ReplayRecovered)
	// Whether the replay socket drops depends on how fast this run's
	// subscriber applies (a fast one took all 600 in 1 run of about 10
	// under load); when it did, later rounds must have fetched them.
	if pod.Dropped() > 0 {
		require.NotZero(t, st.ReplayRounds)
		require.NotZero(t, st.ReplayRecovered)
	}
}
