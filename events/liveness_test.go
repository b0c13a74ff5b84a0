package events

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
)

func rankPayload(t testing.TB, rank int, keys ...uint64) []byte {
	t.Helper()
	b := Batch{TS: 1, DPRank: Some(rank), Events: []Event{{Type: EventBlockStored, BlockHashes: keys, BlockSize: 4, Medium: "GPU"}}}
	return AppendBatch(nil, &b, LayoutMap, 0)
}

// After a disconnect, a holder is no source until a message sent after its
// reconnect shows whether its engine restarted: a continuing sequence
// keeps its entries, a sequence that starts again clears them first.
func TestAReconnectedHolderIsNoSourceUntilItsNextMessageShowsARestartOrNot(t *testing.T) {
	for _, tc := range []struct {
		name string
		seq  uint64
		want []uint64
	}{
		{"continuing sequence: live again, entries kept", 2, []uint64{1, 2, 3}},
		{"restart: cleared first", 0, []uint64{3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := eventstest.NewRecSink()
			p := startProcessor(t, Config{Sink: sink})
			h := index.Holder{Pod: "10.0.0.1:8000"}
			p.Handle(t.Context(), Message{Pod: h.Pod, Model: "m", Seq: 0, Payload: storedPayload(t, 1)})
			p.Handle(t.Context(), Message{Pod: h.Pod, Model: "m", Seq: 1, Payload: storedPayload(t, 2)})
			require.NoError(t, p.Sync(t.Context()))

			p.PodConnected(h.Pod, false)
			p.PodConnected(h.Pod, true)
			state, ok := p.Source(h)
			require.False(t, ok)
			require.Equal(t, StateReconnected, state)
			require.Equal(t, StateReconnected, statusOf(p, h).State)

			p.Handle(t.Context(), Message{Pod: h.Pod, Model: "m", Seq: tc.seq, Payload: storedPayload(t, 3)})
			require.NoError(t, p.Sync(t.Context()))
			state, ok = p.Source(h)
			require.True(t, ok, state)
			require.Equal(t, tc.want, sink.Keys("m", h, "GPU"))
		})
	}
}

// A message handed before the reconnect (the dead engine's last one, read
// late) does not vouch for whatever is at the address now.
func TestAMessageHandedBeforeTheReconnectDoesNotMakeTheHolderASource(t *testing.T) {
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink})
	h := index.Holder{Pod: "10.0.0.1:8000"}
	p.Handle(t.Context(), Message{Pod: h.Pod, Model: "m", Seq: 0, Payload: storedPayload(t, 1)})
	require.NoError(t, p.Sync(t.Context()))
	p.PodConnected(h.Pod, false)
	p.Handle(t.Context(), Message{Pod: h.Pod, Model: "m", Seq: 1, Payload: storedPayload(t, 2)})
	p.PodConnected(h.Pod, true)
	require.NoError(t, p.Sync(t.Context()))
	state, ok := p.Source(h)
	require.False(t, ok)
	require.Equal(t, StateReconnected, state)
}

// Each rank of a reconnected pod waits for a message of its own.
func TestEachRankOfAReconnectedPodWaitsForItsOwnMessage(t *testing.T) {
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink})
	pod := "10.0.0.1:8000"
	r0, r1 := index.Holder{Pod: pod}, index.Holder{Pod: pod, Rank: 1}
	p.Handle(t.Context(), Message{Pod: pod, Model: "m", Seq: 0, Payload: rankPayload(t, 0, 1)})
	p.Handle(t.Context(), Message{Pod: pod, Model: "m", Seq: 0, Payload: rankPayload(t, 1, 2)})
	require.NoError(t, p.Sync(t.Context()))
	p.PodConnected(pod, false)
	p.PodConnected(pod, true)
	p.Handle(t.Context(), Message{Pod: pod, Model: "m", Seq: 1, Payload: rankPayload(t, 0, 3)})
	require.NoError(t, p.Sync(t.Context()))
	_, ok := p.Source(r0)
	require.True(t, ok)
	state, ok := p.Source(r1)
	require.False(t, ok)
	require.Equal(t, StateReconnected, state)
}

// After thousands of pods came and went (each evicted at the holder bound
// and disconnected), a pod that holds blocks is still followed exactly: its
// disconnect makes it no source. The pods that left are forgotten with
// their last holder, so the processor's state is bounded by the holders.
func TestDisconnectTrackingStaysExactAfterChurn(t *testing.T) {
	sink := eventstest.NewRecSink()
	const maxHolders = 16
	p := startProcessor(t, Config{Sink: sink, MaxHolders: maxHolders})
	real := index.Holder{Pod: "10.0.0.1:8000"}
	p.Handle(t.Context(), Message{Pod: real.Pod, Model: "m", Payload: storedPayload(t, 1)})
	for i := range 2 * maxHolders * 20 {
		pod := fmt.Sprintf("10.9.%d.%d:8000", i/256, i%256)
		p.Handle(t.Context(), Message{Pod: pod, Model: "m", Payload: storedPayload(t, uint64(i+2))})
		if i%maxHolders == maxHolders-1 {
			// Keep the real pod the most recently heard, as a busy engine is.
			p.Handle(t.Context(), Message{Pod: real.Pod, Model: "m", Seq: uint64(i + 1), Payload: storedPayload(t, 1)})
		}
		require.NoError(t, p.Sync(t.Context()))
		p.PodConnected(pod, false)
	}
	require.Greater(t, p.Stats().Evicted, uint64(2*maxHolders*20-maxHolders))
	// An evicted holder's pod state goes once its worker has cleared it,
	// just after the last Sync: the count is exact once that has run.
	require.Eventually(t, func() bool { return p.pods.Len() <= maxHolders }, 10*time.Second, time.Millisecond,
		"%d pod states for %d holders", p.pods.Len(), maxHolders)

	_, ok := p.Source(real)
	require.True(t, ok)
	p.PodConnected(real.Pod, false)
	state, ok := p.Source(real)
	require.False(t, ok, "the pod's disconnect was not tracked")
	require.Equal(t, StateDisconnected, state)
}

// One sender naming one pod with thousands of data-parallel ranks makes
// at most MaxHoldersPerSender holders; the rest are dropped and counted,
// and an idle healthy engine of another sender keeps its blocks.
func TestOneSenderMakesAtMostItsBoundOfHolders(t *testing.T) {
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink, MaxHolders: 16, MaxHoldersPerSender: 4})
	healthy := index.Holder{Pod: "10.0.0.1:8000"}
	p.Handle(t.Context(), Message{Pod: healthy.Pod, Model: "m", Sender: "10.0.0.1", Payload: storedPayload(t, 1)})
	for rank := range 500 {
		p.Handle(t.Context(), Message{Pod: "10.0.0.9:8000", Model: "m", Sender: "10.0.0.9", Payload: rankPayload(t, rank, 2)})
	}
	require.NoError(t, p.Sync(t.Context()))
	require.Len(t, p.Status(), 5)
	require.Equal(t, uint64(496), p.Stats().SenderHolders)
	require.Zero(t, p.Stats().Evicted)
	require.Equal(t, []uint64{1}, sink.Keys("m", healthy, "GPU"))
}

// Under pressure the senders over their share lose holders first: a
// flood of names from many senders, each within its own bound, evicts
// the flood's holders and not an idle real pod that published before it.
// The case scaled down 32 times: 6,000 names from 94 senders
// against 4,096 holders and 64 per sender.
func TestAFloodFromManySendersEvictsItsOwnHoldersFirst(t *testing.T) {
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink, MaxHolders: 128, MaxHoldersPerSender: 8})
	real := index.Holder{Pod: "10.0.0.1:8000"}
	p.Handle(t.Context(), Message{Pod: real.Pod, Model: "m", Sender: "10.0.0.1", Payload: storedPayload(t, 1)})
	require.NoError(t, p.Sync(t.Context()))
	const names, senders = 188, 24
	for i := range names {
		sender := fmt.Sprintf("10.8.0.%d", i%senders)
		p.Handle(t.Context(), Message{Pod: fmt.Sprintf("fake-%d.svc:1", i), Model: "m", Sender: sender, Payload: storedPayload(t, uint64(i+2))})
	}
	require.NoError(t, p.Sync(t.Context()))
	require.GreaterOrEqual(t, p.Stats().Evicted, uint64(names+1-p.Config().MaxHolders))
	require.Equal(t, []uint64{1}, sink.Keys("m", real, "GPU"), "the idle real pod was evicted")
	_, ok := p.Source(real)
	require.True(t, ok)
	// The senders' counts follow the holders forgotten.
	require.Eventually(t, func() bool {
		p.senderMu.Lock()
		defer p.senderMu.Unlock()
		n := 0
		for _, c := range p.senders {
			n += c
		}
		return n == len(p.Status())
	}, 10*time.Second, time.Millisecond)
}
