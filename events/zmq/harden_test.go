//go:build cgo

package zmq

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// fromEP is a connect endpoint whose connection leaves from source address
// src (libzmq's "tcp://SRC:0;HOST:PORT"); Linux routes all of 127.0.0.0/8
// to the loopback interface, so 127.0.0.2 is a second host.
func fromEP(src string, port int) string { return fmt.Sprintf("tcp://%s:0;127.0.0.1:%d", src, port) }

func TestBindModeAcceptsAPodNamedByAnIPOnlyFromThatIP(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
	real := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@127.0.0.1:8000@m"})
	spoof := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: "kv@127.0.0.1:8000@m"})
	own := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: "kv@127.0.0.2:8000@m"})
	h := index.Holder{Pod: "127.0.0.1:8000"}
	warmUp(t, real, s, 0)
	publish(t, real, stored(0, nil, 1, 2))
	requireKeys(t, sink, "m", h, "GPU", 1, 2)
	warmUp(t, own, s, 0)

	// The spoofer's restart (seq 0, empty) and its stores under the
	// victim's name are refused and counted; the victim is intact.
	require.NoError(t, spoof.WaitSubscribed(t.Context()))
	publish(t, spoof, events.Batch{TS: 1, DPRank: events.Some(0)}, stored(0, nil, 666))
	require.Eventually(t, func() bool { return s.Stats().SenderMismatch >= 2 }, waitLong, 5*time.Millisecond)
	require.NoError(t, s.Sync(t.Context()))
	requireKeys(t, sink, "m", h, "GPU", 1, 2)
	st := statusOf(s, h)
	require.Zero(t, st.Restarts)
	require.Equal(t, events.StateLive, st.State)
}

func TestBindModeAcceptsDNSNamedPodsOnlyFromAllowedNetworks(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)},
		Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}})
	ok := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@vllm-0.svc:8000@m"})
	evil := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: "kv@evil2.attacker.example:7777@m"})
	warmUp(t, ok, s, 0)
	require.NoError(t, evil.WaitSubscribed(t.Context()))
	publish(t, evil, stored(0, nil, 9))
	require.Eventually(t, func() bool { return s.Stats().SenderMismatch >= 1 }, waitLong, 5*time.Millisecond)
	require.Empty(t, sink.Keys("m", index.Holder{Pod: "evil2.attacker.example:7777"}, "GPU"))
	require.Len(t, s.Status(), 1)
}

func TestBindModeBoundsThePodsOneSenderNames(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}, MaxPodsPerSender: 3})
	var pubs []*Publisher
	for i := range 5 {
		p := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: fmt.Sprintf("kv@127.0.0.2:%d@m", 9000+i)})
		require.NoError(t, p.WaitSubscribed(t.Context()))
		pubs = append(pubs, p)
	}
	for _, p := range pubs {
		publish(t, p, stored(0, nil, 1))
	}
	require.Eventually(t, func() bool { return s.Stats().SenderMismatch >= 2 }, waitLong, 5*time.Millisecond)
	require.NoError(t, s.Sync(t.Context()))
	require.Len(t, s.Status(), 3)
}

func TestAPublisherThatGoesAwayIsDisconnectedAndNoSource(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"bind", "connect"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			port := testenv.FreePort(t)
			sink := eventstest.NewRecSink()
			pod := "127.0.0.1:8000"
			var s *Subscriber
			var p *Publisher
			if mode == "bind" {
				s = startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
				p = newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@" + pod + "@m"})
			} else {
				p = newPublisher(t, PublisherConfig{Bind: localEP(port), Topic: "kv@" + pod + "@m"})
				s = startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}})
				require.NoError(t, s.AddPod(pod, localEP(port), ""))
			}
			h := index.Holder{Pod: pod}
			warmUp(t, p, s, 0)
			publish(t, p, stored(0, nil, 1))
			requireKeys(t, sink, "m", h, "GPU", 1)
			require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateLive }, waitLong, 5*time.Millisecond)
			require.NoError(t, p.Close())
			start := time.Now()
			require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateDisconnected }, waitLong, 5*time.Millisecond)
			t.Logf("disconnected after %v", time.Since(start))
			_, source := s.Source(h)
			require.False(t, source)
			requireKeys(t, sink, "m", h, "GPU", 1) // it still scores
			require.Equal(t, uint64(1), s.Stats().Disconnects)
		})
	}
}

func TestBindModeDisconnectsAHostsPodsWhenOneOfItsConnectionsCloses(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
	// Two engines on one host, 127.0.0.2: their messages carry the same
	// peer address, so which one a closed connection was is unknown.
	dead := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: "kv@127.0.0.2:9000@m"})
	alive := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: "kv@127.0.0.2:9001@m"})
	hd, ha := index.Holder{Pod: "127.0.0.2:9000"}, index.Holder{Pod: "127.0.0.2:9001"}
	warmUp(t, dead, s, 0)
	warmUp(t, alive, s, 0)
	for _, h := range []index.Holder{hd, ha} {
		require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateLive }, waitLong, 5*time.Millisecond)
	}

	require.NoError(t, dead.Close())
	for _, h := range []index.Holder{hd, ha} {
		require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateDisconnected }, waitLong, 5*time.Millisecond, "%v", h)
		_, source := s.Source(h)
		require.False(t, source)
	}
	// The engine still there is a source again with its next batch; the
	// one that went away stays out.
	publish(t, alive, stored(0, nil, 1))
	requireKeys(t, sink, "m", ha, "GPU", 1)
	require.Eventually(t, func() bool { return statusOf(s, ha).State == events.StateLive }, waitLong, 5*time.Millisecond)
	_, source := s.Source(ha)
	require.True(t, source)
	require.Equal(t, events.StateDisconnected, statusOf(s, hd).State)
}

func TestBindModeKeepsAnEngineThatWentAwayDownThoughItsLastMessagesComeAfter(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
	alive := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: "kv@127.0.0.2:9000@m"})
	warmUp(t, alive, s, 0)
	// Engines that publish a burst and go away at once: their last
	// messages are still queued when the close is seen.
	for i := range 10 {
		pod := fmt.Sprintf("127.0.0.2:%d", 9001+i)
		dead := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: "kv@" + pod + "@m"})
		warmUp(t, dead, s, 0)
		for j := range 50 {
			publish(t, dead, stored(0, nil, uint64(j+1)))
		}
		require.NoError(t, dead.Close())
		h := index.Holder{Pod: pod}
		require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateDisconnected }, waitLong, 5*time.Millisecond, pod)
		require.NoError(t, s.Sync(t.Context()))
		require.Equal(t, events.StateDisconnected, statusOf(s, h).State, pod)
		_, source := s.Source(h)
		require.False(t, source, pod)
	}
}

func TestBindModeKeepsThePerSenderBoundWhileASendersConnectionsComeAndGo(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}, MaxPodsPerSender: 3})
	anchor := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: "kv@127.0.0.2:9000@m"})
	warmUp(t, anchor, s, 0)
	for i := range 10 {
		p := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: fmt.Sprintf("kv@127.0.0.2:%d@m", 9100+i)})
		require.NoError(t, p.WaitSubscribed(t.Context()))
		publish(t, p, stored(0, nil, 1))
		require.NoError(t, p.Close())
		require.NoError(t, s.Sync(t.Context()))
	}
	require.Eventually(t, func() bool { return s.Stats().SenderMismatch >= 8 }, waitLong, 5*time.Millisecond)
	require.NoError(t, s.Sync(t.Context()))
	require.Len(t, s.Status(), 3)
}

func TestBindModeSaysWhyAPodIsRefusedAndWaitAppliedStopsWaiting(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	var logs syncBuffer
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: eventstest.NewRecSink(),
		Logger: slog.New(slog.NewTextHandler(&logs, nil)), SenderCheckHint: "--events-allow or --events-no-sender-check"},
		Bind: []string{localEP(port)}})
	// A pod named by an address it does not publish from, as a newcomer's
	// 10.0.0.x names published from loopback are.
	p := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@10.0.0.9:8000@m"})
	require.NoError(t, p.WaitSubscribed(t.Context()))
	h := index.Holder{Pod: "10.0.0.9:8000"}
	waited := make(chan error, 1)
	go func() { waited <- s.WaitApplied(t.Context(), h, 0) }()
	require.Eventually(t, func() bool {
		publish(t, p, stored(0, nil, 1))
		select {
		case err := <-waited:
			require.ErrorIs(t, err, events.ErrSenderRefused)
			require.ErrorContains(t, err, "10.0.0.9:8000")
			require.ErrorContains(t, err, "--events-allow or --events-no-sender-check")
			return true
		case <-time.After(50 * time.Millisecond):
			return false
		}
	}, waitLong, time.Millisecond, "WaitApplied waited on for a pod whose messages are dropped")
	require.Contains(t, logs.String(), "fix=\"--events-allow or --events-no-sender-check\"")
	require.Contains(t, logs.String(), "accepted from it only")

	// A pod that is not refused is still waited for.
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, s.WaitApplied(ctx, index.Holder{Pod: "127.0.0.1:8000"}, 0), context.DeadlineExceeded)
}

// syncBuffer is a bytes.Buffer a logger and a test may share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
