//go:build cgo

package zmq

import (
	"encoding/binary"
	"sync/atomic"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// replySender sends one replay reply message; false once the server stops.
type replySender func(seq uint64, b events.Batch) bool

// startScriptedReplay runs a replay socket that answers a request for seq
// from 0 with its end marker alone and lets answer reply to any other.
func startScriptedReplay(t *testing.T, endpoint string, answer func(from uint64, send replySender)) {
	t.Helper()
	serveReplay(t, endpoint, func(from uint64, send replySender) {
		if from > 0 {
			answer(from, send)
		}
		send(^uint64(0), events.Batch{DPRank: events.Some(0), TS: 1})
	})
}

// startStingyReplay runs a replay socket that answers every request with
// the given batches from seq 0 on, and then never with its end marker.
func startStingyReplay(t *testing.T, endpoint string, batches ...events.Batch) {
	t.Helper()
	serveReplay(t, endpoint, func(_ uint64, send replySender) {
		for i := range batches {
			send(uint64(i), batches[i])
		}
	})
}

// serveReplay runs a replay socket until the test ends, letting handle
// answer each request for the batches from seq from on.
func serveReplay(t *testing.T, endpoint string, handle func(from uint64, send replySender)) {
	t.Helper()
	router, err := zmq.NewSocket(zmq.ROUTER)
	require.NoError(t, err)
	require.NoError(t, router.SetLinger(0))
	require.NoError(t, router.Bind(endpoint))
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		defer router.Close()
		poller := zmq.NewPoller()
		poller.Add(router, zmq.POLLIN)
		for {
			select {
			case <-done:
				return
			default:
			}
			polled, err := poller.Poll(20 * time.Millisecond)
			if err != nil || len(polled) == 0 {
				continue
			}
			req, err := router.RecvMessageBytes(0)
			if err != nil || len(req) != 3 || len(req[2]) != 8 {
				continue
			}
			from := binary.BigEndian.Uint64(req[2])
			send := func(seq uint64, b events.Batch) bool {
				select {
				case <-done:
					return false
				default:
				}
				var seqb [8]byte
				binary.BigEndian.PutUint64(seqb[:], seq)
				_, err := router.SendMessage(req[0], "", seqb[:], events.AppendBatch(nil, &b, events.LayoutMap, 0))
				return err == nil
			}
			handle(from, send)
		}
	}()
	t.Cleanup(func() {
		close(done)
		<-stopped
	})
}

func TestReplayEndsOnceTheMissingRangeIsCoveredOrItsDeadlinePasses(t *testing.T) {
	tests := []struct {
		name string
		// answer replies to a gap's replay request for seq from on; the
		// batch at from stores block 1, the one lost live.
		answer      func(from uint64, send replySender)
		keys        []uint64
		timeouts    uint64
		unrecovered uint64
	}{
		{
			name: "endpoint sending batches past the gap forever",
			answer: func(from uint64, send replySender) {
				if !send(from, stored(0, nil, 1)) {
					return
				}
				for seq := from + 1; send(seq, events.Batch{TS: 1, DPRank: events.Some(0)}); seq++ {
					time.Sleep(5 * time.Millisecond)
				}
			},
			keys: []uint64{1, 2},
		},
		{
			name: "endpoint trickling batches already applied",
			answer: func(from uint64, send replySender) {
				for send(from-1, events.Batch{TS: 1, DPRank: events.Some(0)}) {
					time.Sleep(20 * time.Millisecond)
				}
			},
			keys:        []uint64{2},
			timeouts:    1,
			unrecovered: 1,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			port, rport, other := testenv.FreePort(t), testenv.FreePort(t), testenv.FreePort(t)
			sink := eventstest.NewRecSink()
			// One worker: the stalled replay would hold the other pod too.
			s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, Workers: 1, ReplayDeadline: 500 * time.Millisecond}, ReplayTimeout: 200 * time.Millisecond})
			startScriptedReplay(t, localEP(rport), tc.answer)
			var drop atomic.Int64
			drop.Store(-1)
			p := newPublisher(t, PublisherConfig{Bind: anyEP(port), Topic: "kv@pod@m",
				Drop: func(seq uint64) bool { return int64(seq) == drop.Load() }})
			bystander := newPublisher(t, PublisherConfig{Bind: anyEP(other), Topic: "kv@other@m"})
			require.NoError(t, s.AddPod("pod", localEP(port), localEP(rport)))
			require.NoError(t, s.AddPod("other", localEP(other), ""))
			warmUp(t, p, s, 0)
			warmUp(t, bystander, s, 0)
			seq, err := p.Publish(&events.Batch{DPRank: events.Some(0), TS: 1})
			require.NoError(t, err)
			drop.Store(int64(seq + 1))
			publish(t, p, stored(0, nil, 1), stored(0, nil, 2))
			publish(t, bystander, stored(0, nil, 9))

			h := index.Holder{Pod: "pod"}
			requireKeys(t, sink, "m", h, "GPU", tc.keys...)
			requireKeys(t, sink, "m", index.Holder{Pod: "other"}, "GPU", 9)
			settled(t, s)
			st := s.Stats()
			require.Equal(t, tc.timeouts, st.ReplayTimeouts)
			require.Equal(t, tc.timeouts, st.ReplayErrors)
			require.Equal(t, tc.unrecovered, statusOf(s, h).Unrecovered)
			require.Equal(t, "live", statusOf(s, h).State)
			require.Equal(t, seq+2, statusOf(s, h).LastSeq)
		})
	}
}
