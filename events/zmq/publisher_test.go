//go:build cgo

package zmq

import (
	"encoding/binary"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/internal/testenv"
)

func TestBindsEndpointFollowsVLLM(t *testing.T) {
	tests := map[string]bool{
		"tcp://*:5557": true, "tcp://[::]:5557": true, "ipc:///tmp/kv": true, "inproc://kv": true,
		"tcp://10.0.0.1:5557": false, "tcp://router:5557": false,
	}
	for ep, bind := range tests {
		require.Equal(t, bind, BindsEndpoint(ep), ep)
	}
}

// TestPublisherWireFormat checks the frames a plain ZMQ client sees: live
// [topic, seq, payload] with seq from 0, and replay replies in both formats.
func TestPublisherWireFormat(t *testing.T) {
	for _, format := range []ReplayFormat{ReplayV26, ReplayV25} {
		t.Run(format.String(), func(t *testing.T) {
			t.Parallel()
			port, rport := testenv.FreePort(t), testenv.FreePort(t)
			p := newPublisher(t, PublisherConfig{Bind: anyEP(port), ReplayEndpoint: localEP(rport), Topic: "kv@p@m",
				ReplayFormat: format, BufferSteps: 3})
			sub, err := zmq.NewSocket(zmq.SUB)
			require.NoError(t, err)
			defer sub.Close()
			require.NoError(t, sub.SetSubscribe(""))
			require.NoError(t, sub.Connect(localEP(port)))
			require.NoError(t, sub.SetRcvtimeo(50*time.Millisecond))
			// Publish until the subscription is up; remember the first seq seen.
			var frames [][]byte
			require.Eventually(t, func() bool {
				_, err := p.Publish(&events.Batch{TS: 2, Events: []events.Event{{Type: events.EventAllBlocksCleared}}})
				require.NoError(t, err)
				frames, err = sub.RecvMessageBytes(0)
				return err == nil
			}, waitLong, time.Millisecond)
			require.Len(t, frames, 3)
			require.Equal(t, "kv@p@m", string(frames[0]))
			require.Len(t, frames[1], 8)
			var b events.Batch
			require.NoError(t, events.NewDecoder().Decode(frames[2], &b))
			require.Equal(t, events.EventAllBlocksCleared, b.Events[0].Type)
			_, hasRank := b.DPRank.Get()
			require.False(t, hasRank)

			var last uint64
			for range 3 {
				last, err = p.Publish(&events.Batch{TS: 3})
				require.NoError(t, err)
			}
			require.GreaterOrEqual(t, last, binary.BigEndian.Uint64(frames[1])+1)

			dealer, err := zmq.NewSocket(zmq.DEALER)
			require.NoError(t, err)
			defer dealer.Close()
			require.NoError(t, dealer.SetRcvtimeo(waitLong))
			require.NoError(t, dealer.Connect(localEP(rport)))
			start := make([]byte, 8)
			binary.BigEndian.PutUint64(start, last-1) // within the 3 buffered
			_, err = dealer.SendMessage("", start)
			require.NoError(t, err)
			var seqs []uint64
			for {
				reply, err := dealer.RecvMessageBytes(0)
				require.NoError(t, err)
				require.Empty(t, reply[0])
				if format == ReplayV26 {
					require.Len(t, reply, 4)
				} else {
					require.Len(t, reply, 3)
				}
				seq := reply[len(reply)-2]
				if string(seq) == string(endSeq) {
					require.Empty(t, reply[len(reply)-1])
					if format == ReplayV26 {
						require.Empty(t, reply[1])
					}
					break
				}
				if format == ReplayV26 {
					require.Equal(t, "kv@p@m", string(reply[1]))
				}
				require.NoError(t, events.NewDecoder().Decode(reply[len(reply)-1], &b))
				seqs = append(seqs, binary.BigEndian.Uint64(seq))
			}
			require.Equal(t, []uint64{last - 1, last}, seqs)

			// A start before the buffer returns what is still buffered.
			binary.BigEndian.PutUint64(start, 0)
			_, err = dealer.SendMessage("", start)
			require.NoError(t, err)
			n := 0
			for {
				reply, err := dealer.RecvMessageBytes(0)
				require.NoError(t, err)
				if string(reply[len(reply)-2]) == string(endSeq) {
					break
				}
				n++
			}
			require.Equal(t, 3, n)
		})
	}
}

func TestReplayEndpointOfARankFollowsVLLMsPortRule(t *testing.T) {
	tests := []struct {
		src  source
		rank int
		want string
	}{
		{source{replay: "tcp://10.0.0.1:5558", perRank: true}, 0, "tcp://10.0.0.1:5558"},
		{source{replay: "tcp://10.0.0.1:5558", perRank: true}, 3, "tcp://10.0.0.1:5561"},
		{source{replay: "tcp://[fd00::1]:5558", perRank: true}, 1, "tcp://[fd00::1]:5559"},
		{source{replay: "ipc:///tmp/replay", perRank: true}, 2, "ipc:///tmp/replay_dp2"},
		// A connect-mode endpoint is already the rank's own.
		{source{replay: "tcp://10.0.0.1:5558"}, 3, "tcp://10.0.0.1:5558"},
		{source{perRank: true}, 1, ""},
	}
	for _, tc := range tests {
		require.Equal(t, tc.want, tc.src.endpointFor(tc.rank), "%+v rank %d", tc.src, tc.rank)
	}
}
