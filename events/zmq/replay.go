//go:build cgo

package zmq

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	zmq4 "github.com/pebbe/zmq4"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/index"
)

// endpointFor returns the replay endpoint serving rank of src.
func (src *source) endpointFor(rank int) string {
	if src.replay == "" || !src.perRank || rank == 0 {
		return src.replay
	}
	return offsetPort(src.replay, rank)
}

// offsetPort adds off to a tcp:// endpoint's port, as vLLM does for
// data-parallel ranks; other transports get a "_dp<rank>" suffix.
func offsetPort(ep string, off int) string {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return ep + "_dp" + strconv.Itoa(off)
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return ep
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return ep
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+off))
}

// replayPoll is how often a replay waiting for a reply checks its context:
// the bound on how long Run takes to return once cancelled mid-replay.
const replayPoll = 50 * time.Millisecond

// Replay asks the pod's ROUTER replay socket for h's batches from seq from
// on (a DEALER sending [empty, from]) and hands each reply, in either of
// vLLM's formats, to fn until the end marker. It implements
// events.Replayer.
func (src *source) Replay(ctx context.Context, h index.Holder, from uint64, fn func(seq uint64, payload []byte) bool) error {
	endpoint := src.endpointFor(h.Rank)
	sock, err := zmq4.NewSocket(zmq4.DEALER)
	if err != nil {
		return fmt.Errorf("replay %s: %w", endpoint, err)
	}
	defer sock.Close()
	_ = sock.SetLinger(0)
	if err := sock.Connect(endpoint); err != nil {
		return fmt.Errorf("replay %s: %w", endpoint, err)
	}
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], from)
	if _, err := sock.SendMessage("", start[:]); err != nil {
		return fmt.Errorf("replay %s: %w", endpoint, err)
	}
	poller := zmq4.NewPoller()
	poller.Add(sock, zmq4.POLLIN)
	// idle bounds the wait for the next message; the caller's ctx bounds
	// the whole replay, since a trickling endpoint never lets idle run out.
	// Once replies flow, vLLM sends them back to back (it answers a replay
	// in one loop), so a pause of a tenth of the timeout means its ROUTER
	// dropped the rest: the replay ends with ErrReplayTimeout at once, and
	// the caller asks again from what it misses.
	idle := time.Now().Add(src.timeout)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		left := time.Until(idle)
		if left <= 0 {
			return fmt.Errorf("replay %s: no reply message in time: %w", endpoint, events.ErrReplayTimeout)
		}
		polled, err := poller.Poll(min(left, replayPoll))
		if err != nil {
			return fmt.Errorf("replay %s: %w", endpoint, err)
		}
		if len(polled) == 0 {
			continue
		}
		frames, err := sock.RecvMessageBytes(0)
		if err != nil {
			return fmt.Errorf("replay %s: %w", endpoint, err)
		}
		// v26: [empty, topic, seq, payload]; v25: [empty, seq, payload].
		if (len(frames) != 3 && len(frames) != 4) || len(frames[0]) != 0 || len(frames[len(frames)-2]) != 8 {
			return fmt.Errorf("replay %s: bad reply framing (%d frames)", endpoint, len(frames))
		}
		seq := binary.BigEndian.Uint64(frames[len(frames)-2])
		if seq == ^uint64(0) {
			return nil
		}
		if !fn(seq, frames[len(frames)-1]) {
			return nil
		}
		// From the end of fn, which may take a while under load: what
		// idle bounds is the endpoint's silence, not the caller's work.
		idle = time.Now().Add(src.timeout / 10)
	}
}
