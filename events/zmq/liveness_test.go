//go:build cgo

package zmq

import (
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	zmq4 "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// An engine killed and replaced by a fresh one on the same address (a
// container restart) that has not published yet: the new connection alone
// must not make the dead engine's blocks a pull source again. Its first
// message, a sequence starting again, clears them; then it is live.
func TestARestartedEngineInheritsNoBlocksBeforeItPublishes(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"bind", "connect"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			port := testenv.FreePort(t)
			sink := eventstest.NewRecSink()
			pod := "127.0.0.1:8000"
			h := index.Holder{Pod: pod}
			var s *Subscriber
			engine := func() *Publisher {
				if mode == "bind" {
					return newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@" + pod + "@m"})
				}
				return newPublisher(t, PublisherConfig{Bind: localEP(port), Topic: "kv@" + pod + "@m"})
			}
			var old *Publisher
			if mode == "bind" {
				s = startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
				old = engine()
			} else {
				old = engine()
				s = startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}})
				require.NoError(t, s.AddPod(pod, localEP(port), ""))
			}
			warmUp(t, old, s, 0)
			publish(t, old, stored(0, nil, 1, 2, 3))
			requireKeys(t, sink, "m", h, "GPU", 1, 2, 3)
			require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateLive }, waitLong, 5*time.Millisecond)

			require.NoError(t, old.Close())
			require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateDisconnected }, waitLong, 5*time.Millisecond)
			fresh := engine()
			restarted := time.Now()
			require.NoError(t, fresh.WaitSubscribed(t.Context()))
			require.Eventually(t, func() bool { return statusOf(s, h).State != events.StateDisconnected }, waitLong, 5*time.Millisecond)
			t.Logf("the fresh engine's connection seen %v after its start", time.Since(restarted).Round(time.Millisecond))
			state, source := s.Source(h)
			require.False(t, source, "the fresh engine inherited its predecessor's blocks")
			require.Equal(t, events.StateReconnected, state)
			requireKeys(t, sink, "m", h, "GPU", 1, 2, 3) // they still score

			published := time.Now()
			publish(t, fresh, stored(0, nil, 9))
			requireKeys(t, sink, "m", h, "GPU", 9)
			require.Eventually(t, func() bool { _, ok := s.Source(h); return ok }, waitLong, 5*time.Millisecond)
			t.Logf("a source again, with its own blocks only, %v after its first message", time.Since(published).Round(time.Millisecond))
			require.Equal(t, uint64(1), statusOf(s, h).Restarts)
		})
	}
}

// rawPub publishes frames under any topic, as a host whose engines come
// and go under new names does.
type rawPub struct {
	t    testing.TB
	sock *zmq4.Socket
	seq  uint64
}

// newRawPub connects an XPUB socket to endpoint and waits for the
// subscription.
func newRawPub(t testing.TB, endpoint string) *rawPub {
	t.Helper()
	sock, err := zmq4.NewSocket(zmq4.XPUB)
	require.NoError(t, err)
	_ = sock.SetLinger(0)
	t.Cleanup(func() { sock.Close() })
	require.NoError(t, sock.Connect(endpoint))
	_ = sock.SetRcvtimeo(waitLong)
	_, err = sock.RecvBytes(0)
	require.NoError(t, err, "no subscription")
	return &rawPub{t: t, sock: sock}
}

func (p *rawPub) publish(topic string, b events.Batch) {
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], p.seq)
	p.seq++
	_, err := p.sock.SendMessage(topic, seq[:], events.AppendBatch(nil, &b, events.LayoutMap, 0))
	require.NoError(p.t, err)
}

// After far more pod names came and went through one bind socket than the
// holder bound, an engine that holds blocks is still followed: killed, it
// is no source. The bind socket's per-address table forgets the pods the
// processor forgot, and so does a sender's count of the pods it names.
func TestBindModeFollowsALivePodAfterManyPodsCameAndWent(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	const maxHolders = 8
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, MaxHolders: maxHolders}, Bind: []string{localEP(port)}})
	churn := newRawPub(t, fromEP("127.0.0.3", port))
	// Pod names a host's engines used over days, each evicted in turn at
	// the holder bound: 10 times the tables' old bound of 2 x MaxHolders,
	// and past MaxPodsPerSender.
	for i := range 20 * maxHolders {
		churn.publish(fmt.Sprintf("kv@churn-%d.svc:1@m", i), stored(0, nil, uint64(i+1)))
		require.Eventually(t, func() bool { return s.Stats().Messages > uint64(i) }, waitLong, time.Millisecond)
	}
	require.NoError(t, s.Sync(t.Context()))
	h := index.Holder{Pod: "127.0.0.2:8000"}
	real := newPublisher(t, PublisherConfig{Connect: fromEP("127.0.0.2", port), Topic: "kv@" + h.Pod + "@m"})
	warmUp(t, real, s, 0)
	publish(t, real, stored(0, nil, 1))
	requireKeys(t, sink, "m", h, "GPU", 1)
	require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateLive }, waitLong, 5*time.Millisecond)
	require.NoError(t, real.Close())
	killed := time.Now()
	require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateDisconnected }, waitLong, 5*time.Millisecond,
		"the killed engine stayed %s", statusOf(s, h).State)
	t.Logf("the killed engine was no source %v after its close", time.Since(killed).Round(time.Microsecond))
	_, source := s.Source(h)
	require.False(t, source)
	require.Zero(t, s.Stats().SenderMismatch, "a host's pods over time are no flood")
}

// One host naming its own IP with hundreds of data-parallel ranks, and
// hosts naming many DNS pods, evict their own holders at the bound, not an
// idle healthy engine that published before them.
func TestBindModeAFloodCannotEvictAnIdleHealthyEngine(t *testing.T) {
	t.Parallel()
	for _, flood := range []string{"ranks", "names"} {
		t.Run(flood, func(t *testing.T) {
			t.Parallel()
			port := testenv.FreePort(t)
			sink := eventstest.NewRecSink()
			s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, MaxHolders: 16}, Bind: []string{localEP(port)},
				MaxPodsPerSender: 8})
			h := index.Holder{Pod: "127.0.0.1:8000"}
			healthy := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@" + h.Pod + "@m"})
			warmUp(t, healthy, s, 0)
			publish(t, healthy, stored(0, nil, 1, 2))
			requireKeys(t, sink, "m", h, "GPU", 1, 2)
			before := s.Stats().Messages
			sent := 0
			for i, src := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"} {
				p := newRawPub(t, fromEP(src, port))
				for j := range 100 {
					if flood == "ranks" {
						p.publish(fmt.Sprintf("kv@%s:9000@m", src), stored(j, nil, uint64(j+10)))
					} else {
						p.publish(fmt.Sprintf("kv@fake-%d-%d.svc:1@m", i, j%8), stored(0, nil, uint64(j+10)))
					}
					sent++
				}
			}
			require.Eventually(t, func() bool { return s.Stats().Messages >= before+uint64(sent) }, waitLong, time.Millisecond)
			require.NoError(t, s.Sync(t.Context()))
			requireKeys(t, sink, "m", h, "GPU", 1, 2)
			_, source := s.Source(h)
			require.True(t, source, "the healthy engine is no source after the flood")
			st := s.Stats()
			t.Logf("%d flood messages: %d holders evicted, %d messages dropped at the per-sender bound; the healthy engine kept its blocks",
				sent, st.Evicted, st.SenderHolders)
		})
	}
}

// In connect mode the sender is the pod dialled: an engine publishing
// hundreds of ranks makes at most its bound of holders and evicts no other
// pod's.
func TestConnectModeBoundsTheHoldersOfOnePod(t *testing.T) {
	t.Parallel()
	hport, fport := testenv.FreePort(t), testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, MaxHolders: 16}, MaxPodsPerSender: 4})
	healthy := newPublisher(t, PublisherConfig{Bind: localEP(hport), Topic: "kv@x@m"})
	flood := newPublisher(t, PublisherConfig{Bind: localEP(fport), Topic: "kv@x@m"})
	require.NoError(t, s.AddPod("10.0.0.1:8000", localEP(hport), ""))
	require.NoError(t, s.AddPod("10.0.0.9:8000", localEP(fport), ""))
	h := index.Holder{Pod: "10.0.0.1:8000"}
	warmUp(t, healthy, s, 0)
	publish(t, healthy, stored(0, nil, 1))
	requireKeys(t, sink, "m", h, "GPU", 1)
	warmUp(t, flood, s, 0)
	for rank := range 100 {
		publish(t, flood, stored(rank, nil, uint64(rank+10)))
	}
	require.Eventually(t, func() bool { return s.Stats().SenderHolders >= 96 }, waitLong, 5*time.Millisecond)
	require.NoError(t, s.Sync(t.Context()))
	require.Len(t, s.Status(), 5)
	requireKeys(t, sink, "m", h, "GPU", 1)
	require.Zero(t, s.Stats().Evicted)
}

// A new engine process on a dead one's address that serves another model
// (Kubernetes reuses pod IPs), or whose first batch is an empty one at 0
// where its predecessor's last was 0, inherits none of the dead process's
// blocks: a source again for its own only. vLLM's map layout and SGLang's
// array layout; the subscriber binding and connecting.
func TestARestartedEngineInheritsNoBlocksOfAnotherModelOrThroughAnEmptyFirstBatch(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"bind", "connect"} {
		for _, tc := range []struct {
			name   string
			layout events.Layout
			model  string // the new process's
			first  events.Batch
		}{
			{"vllm another model", events.LayoutMap, "m2", stored(0, nil, 9)},
			{"sglang another model", events.LayoutArray, "m2", stored(0, nil, 9)},
			{"sglang empty first batch at 0", events.LayoutArray, "m", events.Batch{TS: 1, DPRank: events.Some(0)}},
		} {
			t.Run(mode+" "+tc.name, func(t *testing.T) {
				t.Parallel()
				port := testenv.FreePort(t)
				sink := eventstest.NewRecSink()
				pod := "127.0.0.1:8000"
				h := index.Holder{Pod: pod}
				engine := func(model string) *Publisher {
					cfg := PublisherConfig{Topic: "kv@" + pod + "@" + model, Layout: tc.layout}
					if mode == "bind" {
						cfg.Connect = localEP(port)
					} else {
						cfg.Bind = localEP(port)
					}
					return newPublisher(t, cfg)
				}
				var s *Subscriber
				var old *Publisher
				if mode == "bind" {
					s = startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}, Bind: []string{localEP(port)}})
					old = engine("m")
				} else {
					old = engine("m")
					s = startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink}})
					require.NoError(t, s.AddPod(pod, localEP(port), ""))
				}
				// Its only batch, numbered 0, as an engine that served one
				// request before it died.
				require.NoError(t, old.WaitSubscribed(t.Context()))
				publish(t, old, stored(0, nil, 1, 2, 3))
				requireKeys(t, sink, "m", h, "GPU", 1, 2, 3)
				require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateLive }, waitLong, 5*time.Millisecond)

				require.NoError(t, old.Close())
				require.Eventually(t, func() bool { return statusOf(s, h).State == events.StateDisconnected }, 5*time.Second, 5*time.Millisecond)
				fresh := engine(tc.model)
				require.NoError(t, fresh.WaitSubscribed(t.Context()))
				publish(t, fresh, tc.first)
				require.Eventually(t, func() bool { return s.Stats().Batches+s.Stats().Heartbeats >= 2 }, waitLong, 5*time.Millisecond)
				require.NoError(t, s.Sync(t.Context()))
				require.Empty(t, sink.Keys("m", h, "GPU"), "the new process inherited the dead one's blocks (state %s)", statusOf(s, h).State)
				if tc.model != "m" {
					requireKeys(t, sink, tc.model, h, "GPU", 9)
				}
				require.Eventually(t, func() bool { _, ok := s.Source(h); return ok }, waitLong, 5*time.Millisecond)
				require.Equal(t, tc.model, statusOf(s, h).Model)
				require.Equal(t, uint64(1), statusOf(s, h).Restarts)
			})
		}
	}
}
