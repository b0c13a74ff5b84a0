//go:build cgo

package zmq

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

func TestSubscriberOnPortZeroAppliesWhatIsPublishedWithoutSleeping(t *testing.T) {
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{"tcp://127.0.0.1:0"}})
	addrs := s.Addrs()
	require.Len(t, addrs, 1)
	require.NotEqual(t, "tcp://127.0.0.1:0", addrs[0], "the port the bind got")
	ctx, cancel := context.WithTimeout(t.Context(), waitLong)
	defer cancel()
	pods := []string{"a", "b"}
	last := map[string]uint64{}
	for _, pod := range pods {
		p := newPublisher(t, PublisherConfig{Connect: addrs[0], Topic: "kv@" + pod + "@m"})
		require.NoError(t, p.WaitSubscribed(ctx))
		for i := range uint64(5) {
			seq, err := p.Publish(new(stored(0, nil, 100*uint64(len(pod))+i)))
			require.NoError(t, err)
			last[pod] = seq
		}
	}
	for _, pod := range pods {
		require.NoError(t, s.WaitApplied(ctx, index.Holder{Pod: pod}, last[pod]))
	}
	require.Equal(t, []uint64{100, 101, 102, 103, 104}, sink.Keys("m", index.Holder{Pod: "a"}, "GPU"))
	require.NoError(t, s.Sync(ctx))
	st := s.Stats()
	require.Equal(t, uint64(10), st.Batches, "nothing lost to the slow joiner")
	require.Zero(t, st.Gaps)
}

func TestPublisherOnPortZeroReportsItsAddresses(t *testing.T) {
	p := newPublisher(t, PublisherConfig{Bind: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv@a@m"})
	require.Regexp(t, `^tcp://127\.0\.0\.1:[1-9][0-9]*$`, p.Addr())
	require.Regexp(t, `^tcp://127\.0\.0\.1:[1-9][0-9]*$`, p.ReplayAddr())
	require.NotEqual(t, p.Addr(), p.ReplayAddr())
}

func TestPublisherConfigIsExplicit(t *testing.T) {
	for name, cfg := range map[string]PublisherConfig{
		"empty topic":          {Connect: "tcp://127.0.0.1:1"},
		"bind and connect set": {Bind: "tcp://127.0.0.1:0", Connect: "tcp://127.0.0.1:1", Topic: "kv@a@m"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := NewPublisher(cfg)
			require.ErrorIs(t, err, events.ErrConfig)
		})
	}
}

func TestRunReturnsWithinASecondOfCancellationMidReplay(t *testing.T) {
	port, rport := testenv.FreePort(t), testenv.FreePort(t)
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	defer close(release)
	// A replay endpoint that takes each request and never answers.
	serveReplay(t, localEP(rport), func(uint64, replySender) {
		select {
		case started <- struct{}{}:
		default:
		}
		<-release
	})
	s, err := NewSubscriber(SubscriberConfig{Events: events.Config{Sink: eventstest.NewRecSink(), ReplayDeadline: time.Minute},
		Bind: []string{localEP(port)}, ReplayTimeout: time.Minute})
	require.NoError(t, err)
	require.NoError(t, s.AddPod("pod", "", localEP(rport)))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	<-s.Ready()
	// Seq 0 is lost live: the first message the subscriber sees is seq 1,
	// and it asks replay for seq 0, which never comes.
	p := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@pod@m", Drop: func(seq uint64) bool { return seq == 0 }})
	wctx, wcancel := context.WithTimeout(t.Context(), waitLong)
	defer wcancel()
	require.NoError(t, p.WaitSubscribed(wctx))
	publish(t, p, stored(0, nil, 1), stored(0, nil, 2))
	select {
	case <-started:
	case <-wctx.Done():
		t.Fatal("no replay request")
	}
	cancelled := time.Now()
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		// Generous for a loaded machine under -race, and still a third of
		// the minute the replay would wait if Run did not end it.
		t.Fatalf("Run still runs %v after its context ended", time.Since(cancelled).Round(time.Millisecond))
	}
}

// A Run whose bind fails (the port is taken) may be run again once the
// port is free.
func TestRunMayBeRetriedAfterItsBindFailed(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ep := "tcp://" + l.Addr().String()
	s, err := NewSubscriber(SubscriberConfig{Events: events.Config{Sink: eventstest.NewRecSink()}, Bind: []string{ep}})
	require.NoError(t, err)
	require.Error(t, s.Run(context.Background()))
	require.NoError(t, l.Close())

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	select {
	case <-s.Ready():
	case err := <-done:
		t.Fatalf("the second Run failed: %v", err)
	}
	cancel()
	require.NoError(t, <-done)
}
