package events

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
)

// memReplay is a Replayer serving a fixed list of payloads (seq i is
// payloads[i]), optionally stalling before it answers until release is
// closed or its ctx is done.
type memReplay struct {
	payloads [][]byte
	started  chan struct{} // closed when the first request arrives
	release  chan struct{} // nil: answer at once
	once     sync.Once
}

func (r *memReplay) Replay(ctx context.Context, _ index.Holder, from uint64, fn func(uint64, []byte) bool) error {
	r.once.Do(func() { close(r.started) })
	if r.release != nil {
		select {
		case <-r.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	for seq := from; seq < uint64(len(r.payloads)); seq++ {
		if !fn(seq, r.payloads[seq]) {
			return nil
		}
	}
	return nil
}

func storedPayload(t testing.TB, keys ...uint64) []byte {
	t.Helper()
	b := batchOf(Event{Type: EventBlockStored, BlockHashes: keys, BlockSize: 4, Medium: "GPU"})
	return AppendBatch(nil, &b, LayoutMap, 0)
}

func TestWaitAppliedAndSyncReturnOnceTheBatchesApplied(t *testing.T) {
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink})
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	h := index.Holder{Pod: "a"}
	for seq := range uint64(3) {
		p.Handle(ctx, Message{Pod: "a", Model: "m", Seq: seq, Payload: storedPayload(t, seq+1)})
	}
	require.NoError(t, p.WaitApplied(ctx, h, 2))
	require.Equal(t, []uint64{1, 2, 3}, sink.Keys("m", h, "GPU"))

	p.Handle(ctx, Message{Pod: "b", Model: "m", Seq: 0, Payload: storedPayload(t, 7)})
	p.Handle(ctx, Message{Pod: "b", Model: "m", Seq: 1, Payload: []byte{0xc1}}) // malformed: handled, not applied
	require.NoError(t, p.Sync(ctx))
	require.Equal(t, []uint64{7}, sink.Keys("m", index.Holder{Pod: "b"}, "GPU"))
	require.Equal(t, uint64(1), p.Stats().DecodeErrors)

	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancelShort()
	require.ErrorIs(t, p.WaitApplied(short, h, 3), context.DeadlineExceeded, "seq 3 was never handed")
}

func TestSlowReplayOfOnePodDoesNotHoldAnotherPodsEvents(t *testing.T) {
	sink := eventstest.NewRecSink()
	// One worker: both pods' messages go through it.
	p := startProcessor(t, Config{Sink: sink, Workers: 1, ReplayDeadline: time.Minute})
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	slow := &memReplay{payloads: [][]byte{storedPayload(t, 1), storedPayload(t, 2), storedPayload(t, 3)},
		started: make(chan struct{}), release: make(chan struct{})}
	a, b := index.Holder{Pod: "a"}, index.Holder{Pod: "b"}

	p.Handle(ctx, Message{Pod: "a", Model: "m", Seq: 0, Payload: storedPayload(t, 1), Replay: slow})
	require.NoError(t, p.WaitApplied(ctx, a, 0))
	// Seq 1 and 2 are lost live: the gap's replay stalls.
	p.Handle(ctx, Message{Pod: "a", Model: "m", Seq: 3, Payload: storedPayload(t, 4), Replay: slow})
	<-slow.started
	p.Handle(ctx, Message{Pod: "a", Model: "m", Seq: 4, Payload: storedPayload(t, 5), Replay: slow})
	for seq := range uint64(3) {
		p.Handle(ctx, Message{Pod: "b", Model: "m", Seq: seq, Payload: storedPayload(t, 10+seq)})
	}
	require.NoError(t, p.WaitApplied(ctx, b, 2), "pod b's events apply while pod a replays")
	require.Equal(t, []uint64{10, 11, 12}, sink.Keys("m", b, "GPU"))
	last, _ := p.LastSeq(a)
	require.Equal(t, uint64(0), last, "pod a's later messages wait behind its replay")

	close(slow.release)
	require.NoError(t, p.WaitApplied(ctx, a, 4))
	require.Equal(t, []uint64{1, 2, 3, 4, 5}, sink.Keys("m", a, "GPU"))
	st := p.Stats()
	require.Equal(t, uint64(1), st.Gaps)
	require.Equal(t, uint64(2), st.Replayed)
	require.Zero(t, st.Unrecovered)
}

func TestCloseReturnsPromptlyWhenCancelledMidReplay(t *testing.T) {
	p, err := NewProcessor(Config{Sink: eventstest.NewRecSink(), ReplayDeadline: time.Minute, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	require.NoError(t, p.Start(ctx))
	stuck := &memReplay{started: make(chan struct{}), release: make(chan struct{})}
	p.Handle(ctx, Message{Pod: "a", Model: "m", Seq: 0, Payload: storedPayload(t, 1), Replay: stuck})
	p.Handle(ctx, Message{Pod: "a", Model: "m", Seq: 5, Payload: storedPayload(t, 6), Replay: stuck})
	<-stuck.started
	start := time.Now()
	cancel()
	p.Close()
	require.Less(t, time.Since(start), time.Second)
	require.Equal(t, uint64(1), p.Stats().ReplayErrors, "the cancelled replay failed")
}
