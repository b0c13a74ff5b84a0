package events

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
)

// storeCall is one Sink.Store call.
type storeCall struct {
	group     int
	parent    uint64
	hasParent bool
	keys      []uint64
}

// callSink records every Store call as made.
type callSink struct{ stores []storeCall }

func (s *callSink) Store(b index.Blocks) {
	c := storeCall{group: b.Group, keys: append([]uint64(nil), b.Keys...)}
	c.parent, c.hasParent = b.Parent.Key()
	s.stores = append(s.stores, c)
}
func (s *callSink) Remove(string, index.Holder, string, int, []uint64) {}
func (s *callSink) ClearHolder(string, index.Holder, string)           {}

// applyEvents decodes one batch of events through a worker, as a live
// message would be, so the decoder's acceptance of the event is part of
// what is tested.
func applyEvents(t *testing.T, sink Sink, events ...Event) {
	t.Helper()
	p := startProcessor(t, Config{Sink: sink})
	b := Batch{DPRank: Some(0), TS: 1, Events: events}
	p.Handle(t.Context(), Message{Pod: "pod", Model: "m", Seq: 0, Payload: AppendBatch(nil, &b, LayoutMap, 0)})
	require.NoError(t, p.Sync(t.Context()))
	require.Equal(t, uint64(1), p.Stats().Batches, "the batch was applied")
}

func TestApplyStoresHybridSkipEventsOneKeyAtATimeWithoutParent(t *testing.T) {
	t.Parallel()
	withGroup := func(e Event, g int) Event { e.GroupIdx = Some(g); return e }
	cases := []struct {
		name  string
		event Event
		want  []storeCall
	}{
		{
			name:  "a full event is one chained Store",
			event: storedTokens(ptr(9), seqTokens(0, 8), 1, 2),
			want:  []storeCall{{parent: 9, hasParent: true, keys: []uint64{1, 2}}},
		},
		{
			name:  "a full event from block 0 is one Store without parent",
			event: storedTokens(nil, seqTokens(0, 8), 1, 2),
			want:  []storeCall{{keys: []uint64{1, 2}}},
		},
		{
			name:  "an event known only by hash is one Store",
			event: storedTokens(nil, nil, 1, 2, 3),
			want:  []storeCall{{keys: []uint64{1, 2, 3}}},
		},
		{
			name:  "a skip event stores each key alone and drops the parent",
			event: withGroup(storedTokens(ptr(9), seqTokens(0, 16), 1, 3), 1),
			want: []storeCall{
				{group: 1, keys: []uint64{1}},
				{group: 1, keys: []uint64{3}},
			},
		},
		{
			name:  "a skip event from block 0 stores each key alone",
			event: storedTokens(nil, seqTokens(0, 12), 5, 6),
			want:  []storeCall{{keys: []uint64{5}}, {keys: []uint64{6}}},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sink := &callSink{}
			applyEvents(t, sink, tc.event)
			require.Equal(t, tc.want, sink.stores)
		})
	}
}

func TestApplyHybridSkipDoesNotMakeTheIndexCountSkippedBlocks(t *testing.T) {
	t.Parallel()
	// The prompt is blocks k0..k5. The engine stores k0 k1, then a
	// sliding-window group reports k3 k4 k5 after k1 with token_ids
	// covering four blocks: k2 was skipped. Chained, k5 would claim four
	// blocks above it and the run from k1 would span the hole.
	prompt := []uint64{100, 101, 102, 103, 104, 105}
	ix := index.New(index.Config{})
	applyEvents(t, ix,
		storedTokens(nil, seqTokens(0, 8), prompt[0], prompt[1]),
		storedTokens(ptr(prompt[1]), seqTokens(8, 16), prompt[3], prompt[4], prompt[5]),
	)
	h := index.Holder{Pod: "pod"}
	var res index.Result
	ix.Lookup("m", prompt, &res)
	require.NotNil(t, res.Holder(h))
	require.Equal(t, 2, res.Holder(h).Prefix, "the prefix stops before the skipped block")
	for start, want := range []int{2, 1, 0, 3, 2, 1} {
		require.Equal(t, want, ix.Run("m", h, prompt, start, nil), "run from block %d", start)
	}
	require.Empty(t, ix.Holders("m", prompt[2], nil), "the skipped block")
}
