package events

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/llmdsim"
)

// Tests against producers nobody on this project wrote: llm-d's simulator
// (internal/llmdsim) and the way vLLM's replay socket loses replies.

func TestDecodeReadsParentZeroAsNoParentInBothLLMDLayouts(t *testing.T) {
	tokens := seqTokens(1, 12)
	for _, format := range []llmdsim.Format{llmdsim.Array, llmdsim.Map} {
		sim := &llmdsim.Sim{Model: "m", BlockSize: 4, Format: format}
		keys := sim.Store(tokens[:8], 0)
		sim.Store(tokens, 2)
		payload, err := sim.Flush()
		require.NoError(t, err)
		var b Batch
		require.NoError(t, NewDecoder().Decode(payload, &b))
		require.Len(t, b.Events, 2)
		first, next := b.Events[0], b.Events[1]
		_, has := first.Parent.Get()
		require.False(t, has, "format %d: a chain's first block", format)
		require.Equal(t, format == llmdsim.Array, first.ZeroParent, "the array layout sends 0, the map layout nil")
		require.Equal(t, keys, first.BlockHashes)
		require.Equal(t, tokens[:8], first.TokenIDs)
		require.Equal(t, 4, first.BlockSize)
		p, has := next.Parent.Get()
		require.True(t, has)
		require.False(t, next.ZeroParent)
		require.Equal(t, keys[1], p)
	}
}

func TestContentKeysResolveLLMDStreamsAndCountTokenlessEvents(t *testing.T) {
	for _, format := range []llmdsim.Format{llmdsim.Array, llmdsim.Map} {
		t.Run(fmt.Sprint(format), func(t *testing.T) {
			ck, err := hashing.New(hashing.Config{Algo: hashing.Content, BlockSize: 4})
			require.NoError(t, err)
			sink := eventstest.NewRecSink()
			p := startProcessor(t, Config{Sink: sink, ContentKeys: ck})
			ctx := t.Context()
			sim := &llmdsim.Sim{Seed: "42", Model: "m", BlockSize: 4, Format: format}
			tokens := seqTokens(7, 16)
			sim.Store(tokens[:8], 0)
			sim.Store(tokens, 2)
			payload, err := sim.Flush()
			require.NoError(t, err)
			p.Handle(ctx, Message{Pod: "pod", Model: "m", Seq: 0, Payload: payload})
			require.NoError(t, p.Sync(ctx))
			want, err := ck.BlockKeys(nil, hashing.Request{Tokens: tokens})
			require.NoError(t, err)
			slices.Sort(want)
			h := index.Holder{Pod: "pod"}
			require.Equal(t, want, sink.Keys("m", h, "GPU"), "the request side's content keys")
			require.Zero(t, p.Stats().Unresolved)
			if format == llmdsim.Array {
				require.Equal(t, uint64(1), p.Stats().ZeroParents)
			}

			// An event without tokens naming blocks never seen cannot be
			// keyed: counted for its holder, the rest of the state kept.
			payload, err = msgpack.Marshal([]any{2.0, []any{map[string]any{"type": "BlockStored",
				"block_hashes": []uint64{999, 1000}, "medium": "CPU", "block_size": 0}}, 0})
			require.NoError(t, err)
			p.Handle(ctx, Message{Pod: "pod", Model: "m", Seq: 1, Payload: payload})
			require.NoError(t, p.Sync(ctx))
			require.Equal(t, uint64(1), statusOf(p, h).Tokenless)
			require.Equal(t, uint64(1), p.Stats().Tokenless)
			require.Equal(t, uint64(2), p.Stats().Unresolved)
			require.Equal(t, want, sink.Keys("m", h, "GPU"))
			require.Empty(t, sink.Keys("m", h, "CPU"))
		})
	}
}

// lossyReplay serves payloads (seq i is payloads[i]) the way vLLM's replay
// socket does for a reader slower than it: of each request's replies only
// the first window arrive, the rest and the end marker are lost.
type lossyReplay struct {
	payloads [][]byte
	window   int
	log      requestLog
}

func (r *lossyReplay) Replay(_ context.Context, _ index.Holder, from uint64, fn func(uint64, []byte) bool) error {
	r.log.add(from)
	sent := 0
	for seq := from; seq < uint64(len(r.payloads)); seq++ {
		if sent == r.window {
			return fmt.Errorf("lossy: tail dropped: %w", ErrReplayTimeout)
		}
		sent++
		if !fn(seq, r.payloads[seq]) {
			return nil
		}
	}
	return nil
}

// holeyReplay drops the replies whose seq is in drop, as a ROUTER does for
// replies that meet a full pipe, and sends the rest and the end marker.
type holeyReplay struct {
	payloads [][]byte
	drop     map[uint64]bool // in the first request's replies
	log      requestLog
}

func (r *holeyReplay) Replay(_ context.Context, _ index.Holder, from uint64, fn func(uint64, []byte) bool) error {
	first := r.log.add(from) == 1
	for seq := from; seq < uint64(len(r.payloads)); seq++ {
		if first && r.drop[seq] {
			continue
		}
		if !fn(seq, r.payloads[seq]) {
			return nil
		}
	}
	return nil
}

// requestLog records the from of each replay request.
type requestLog struct {
	mu    sync.Mutex
	froms []uint64
}

func (l *requestLog) add(from uint64) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.froms = append(l.froms, from)
	return len(l.froms)
}

func (l *requestLog) get() []uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.froms)
}

func replayPayloads(t *testing.T, n int) (payloads [][]byte, keys []uint64) {
	t.Helper()
	for i := range n {
		payloads = append(payloads, storedPayload(t, uint64(i)+1))
		keys = append(keys, uint64(i)+1)
	}
	return payloads, keys
}

// gapThroughReplay hands batch 0 and then batch n-1 of payloads live, so
// that batches 1 to n-2 come by replay, and waits until n-1 applied.
func gapThroughReplay(t *testing.T, p *Processor, payloads [][]byte, r Replayer) {
	t.Helper()
	ctx := t.Context()
	n := uint64(len(payloads))
	p.Handle(ctx, Message{Pod: "pod", Model: "m", Seq: 0, Payload: payloads[0], Replay: r})
	p.Handle(ctx, Message{Pod: "pod", Model: "m", Seq: n - 1, Payload: payloads[n-1], Replay: r})
	require.NoError(t, p.WaitApplied(ctx, index.Holder{Pod: "pod"}, n-1))
}

func TestReplayAsksAgainFromTheFirstMissingBatch(t *testing.T) {
	payloads, all := replayPayloads(t, 40)
	tail, holes := &lossyReplay{payloads: payloads, window: 12}, &holeyReplay{payloads: payloads, drop: map[uint64]bool{20: true, 21: true, 30: true}}
	for _, tc := range []struct {
		name   string
		replay Replayer
		froms  func() []uint64
		want   []uint64 // each request's from
	}{
		{"tail and end marker lost", tail, tail.log.get, []uint64{1, 13, 25, 37}},
		{"holes in the middle", holes, holes.log.get, []uint64{1, 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := eventstest.NewRecSink()
			p := startProcessor(t, Config{Sink: sink})
			gapThroughReplay(t, p, payloads, tc.replay)
			require.Equal(t, all, sink.Keys("m", index.Holder{Pod: "pod"}, "GPU"), "every batch applied")
			st := p.Stats()
			require.Zero(t, st.Unrecovered)
			require.Equal(t, uint64(len(tc.want)-1), st.ReplayRounds)
			require.NotZero(t, st.ReplayRecovered)
			require.Equal(t, tc.want, tc.froms())
		})
	}
}

func TestReplayRoundsAreBoundedAndTheRestCountsAsLost(t *testing.T) {
	payloads, _ := replayPayloads(t, 40)
	r := &lossyReplay{payloads: payloads, window: 5}
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink, ReplayRounds: 3})
	gapThroughReplay(t, p, payloads, r)
	require.Equal(t, []uint64{1, 6, 11}, r.log.get())
	st := p.Stats()
	require.Equal(t, uint64(2), st.ReplayRounds)
	require.Equal(t, uint64(10), st.ReplayRecovered)
	require.Equal(t, uint64(1), st.Unrecovered, "what three rounds did not fetch is lost")
	require.Equal(t, []uint64{40}, sink.Keys("m", index.Holder{Pod: "pod"}, "GPU"), "GapClear: cleared, then the live batch")
}
