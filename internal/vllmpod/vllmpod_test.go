package vllmpod

import (
	"encoding/binary"
	"fmt"
	"net"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"
)

func freeEP(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return fmt.Sprintf("tcp://%s", l.Addr())
}

func dealer(t *testing.T, ep string, from uint64) *zmq.Socket {
	t.Helper()
	d, err := zmq.NewSocket(zmq.DEALER)
	require.NoError(t, err)
	t.Cleanup(func() { d.Close() })
	_ = d.SetLinger(0)
	require.NoError(t, d.Connect(ep))
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], from)
	_, err = d.SendMessage("", sb[:])
	require.NoError(t, err)
	return d
}

// readAll reads replies until the end marker or until none comes for a
// while, returning the batches' sequence numbers and whether the end marker
// came.
func readAll(t *testing.T, d *zmq.Socket) (seqs []uint64, ended bool) {
	t.Helper()
	p := zmq.NewPoller()
	p.Add(d, zmq.POLLIN)
	for {
		polled, err := p.Poll(500 * time.Millisecond)
		require.NoError(t, err)
		if len(polled) == 0 {
			return seqs, false
		}
		f, err := d.RecvMessageBytes(0)
		require.NoError(t, err)
		require.Len(t, f, 4)
		require.Empty(t, f[0])
		s := binary.BigEndian.Uint64(f[2])
		if s == ^uint64(0) {
			return seqs, true
		}
		seqs = append(seqs, s)
	}
}

func TestReplayAnswersFromTheRequestedSequenceWithinTheBuffer(t *testing.T) {
	ep, rep := freeEP(t), freeEP(t)
	p, err := Start(Config{Endpoint: ep, ReplayEndpoint: rep, Topic: "kv@a@m", BufferSteps: 3})
	require.NoError(t, err)
	defer p.Close()
	for i := range 5 {
		if i%2 == 0 {
			_, err := p.Publish([]byte{byte(i)})
			require.NoError(t, err)
		} else {
			p.Withhold([]byte{byte(i)})
		}
	}
	seqs, ended := readAll(t, dealer(t, rep, 1))
	require.True(t, ended)
	require.Equal(t, []uint64{2, 3, 4}, seqs, "only the last BufferSteps batches are kept")
	require.Zero(t, p.Dropped())
}

func TestReplayDropsWhatASlowReadersPipeCannotHold(t *testing.T) {
	ep, rep := freeEP(t), freeEP(t)
	p, err := Start(Config{Endpoint: ep, ReplayEndpoint: rep})
	require.NoError(t, err)
	defer p.Close()
	payload := make([]byte, 6<<10)
	const n = 4000
	for range n {
		p.Withhold(payload)
	}
	d := dealer(t, rep, 0)
	// The reader starts only once the whole reply has been sent or dropped.
	require.Eventually(t, func() bool { return p.Served() == 1 }, 30*time.Second, time.Millisecond)
	seqs, ended := readAll(t, d)
	dropped := p.Dropped()
	require.NotZero(t, dropped, "4,000 replies of 6 KiB overflow the default high-water mark")
	endDropped := uint64(1)
	if ended {
		endDropped = 0
	}
	require.Equal(t, uint64(n), uint64(len(seqs))+dropped-endDropped)
	for i := 1; i < len(seqs); i++ {
		require.Less(t, seqs[i-1], seqs[i], "replies keep their order")
	}
	require.Equal(t, uint64(0), seqs[0], "the first replies always fit")
	t.Logf("received %d of %d batches, dropped %d replies", len(seqs), n, dropped)
}
