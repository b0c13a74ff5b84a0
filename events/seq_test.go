package events

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"

	"github.com/kvsource/kvsource/internal/testenv"
)

// engineModel is a brute-force model of one vLLM engine's cache: the keys
// it holds per tier, changed by the batches it publishes.
type engineModel struct {
	rng  *rand.Rand
	held map[string]map[uint64]bool
	next uint64 // next fresh key
}

func (m *engineModel) batch() Batch {
	b := Batch{DPRank: Some(0), TS: 1}
	for range 1 + m.rng.IntN(3) {
		tier := []string{"GPU", "CPU"}[m.rng.IntN(2)]
		switch r := m.rng.IntN(10); {
		case r < 5:
			e := Event{Type: EventBlockStored, Medium: tier, BlockSize: 4}
			for range 1 + m.rng.IntN(4) {
				m.next++
				e.BlockHashes = append(e.BlockHashes, m.next)
				m.held[tier][m.next] = true
			}
			b.Events = append(b.Events, e)
		case r < 9:
			e := Event{Type: EventBlockRemoved, Medium: tier}
			for k := range m.held[tier] {
				if m.rng.IntN(3) == 0 {
					e.BlockHashes = append(e.BlockHashes, k)
					delete(m.held[tier], k)
				}
			}
			b.Events = append(b.Events, e)
		default:
			b.Events = append(b.Events, Event{Type: EventAllBlocksCleared})
			m.held = map[string]map[uint64]bool{"GPU": {}, "CPU": {}}
		}
	}
	return b
}

// TestSequenceTrackingNeverLeavesBlocksTheEngineDropped feeds a worker
// batches from engines that restart, with random losses, and checks after
// every batch that the index holds a subset of what the engine holds
// (GapClear's promise), and exactly that while nothing was lost.
func TestSequenceTrackingNeverLeavesBlocksTheEngineDropped(t *testing.T) {
	for seed := range uint64(30) {
		rng := rand.New(rand.NewPCG(seed, 77))
		sink := eventstest.NewRecSink()
		// Its restarts come microseconds apart, which is a conflict for a
		// real engine; this test is about one engine's numbers.
		s, err := NewProcessor(Config{Sink: sink, ConflictRestarts: 1 << 30, Logger: testenv.TextLogger(discard{})})
		require.NoError(t, err)
		w := newWorker(s)
		h := index.Holder{Pod: "pod"}
		eng := &engineModel{rng: rng, held: map[string]map[uint64]bool{"GPU": {}, "CPU": {}}}
		var seq uint64
		lossless := true
		var restarts, losses uint64
		delivered := false
		for step := range 400 {
			if step > 0 && rng.IntN(60) == 0 {
				// A restart: a new process, empty cache, sequence from 0.
				// Its first batch arrives (a restart whose first batches
				// are all lost is indistinguishable from a gap).
				eng.held = map[string]map[uint64]bool{"GPU": {}, "CPU": {}}
				seq = 0
				if delivered {
					restarts++
				}
				lossless = true
				b := eng.batch()
				w.handle(message{Message: Message{Pod: "pod", Model: "m", Seq: seq, Payload: AppendBatch(nil, &b, LayoutMap, 0)}})
				delivered = true
				seq++
				continue
			}
			b := eng.batch()
			payload := AppendBatch(nil, &b, LayoutArray, 0)
			if rng.IntN(8) == 0 {
				seq++
				lossless = false
				losses++
				continue
			}
			w.handle(message{Message: Message{Pod: "pod", Model: "m", Seq: seq, Payload: payload}})
			delivered = true
			seq++
			for _, tier := range []string{"GPU", "CPU"} {
				got := sink.Keys("m", h, tier)
				for _, k := range got {
					require.True(t, eng.held[tier][k], "seed %d step %d: %s block %d is gone from the engine", seed, step, tier, k)
				}
				if lossless {
					require.Len(t, got, len(eng.held[tier]), "seed %d step %d: lossless stream must match", seed, step)
				}
			}
		}
		st := statusOf(s, h)
		require.Equal(t, restarts, st.Restarts, "seed %d", seed)
		require.LessOrEqual(t, st.Unrecovered, losses, "seed %d", seed)
		require.Equal(t, "live", st.State)
	}
}

func TestARestartRepeatingTheLastNumberIsLoggedAsARepeatNotAsGoingBackwards(t *testing.T) {
	for _, tc := range []struct {
		first, then uint64
		want        string
	}{
		{0, 0, "its sequence repeated an applied number"},
		{5, 0, "its sequence went back to an applied number"},
	} {
		var logs strings.Builder
		s, err := NewProcessor(Config{Sink: eventstest.NewRecSink(), Logger: testenv.TextLogger(&logs)})
		require.NoError(t, err)
		w := newWorker(s)
		b := batchOf(storedTokens(nil, seqTokens(0, 4), 1))
		w.handle(message{Message: Message{Pod: "pod", Model: "m", Seq: tc.first, Payload: AppendBatch(nil, &b, LayoutArray, 0)}})
		w.handle(message{Message: Message{Pod: "pod", Model: "m", Seq: tc.then, Payload: AppendBatch(nil, &b, LayoutArray, 0)}})
		require.Contains(t, logs.String(), tc.want)
		require.Contains(t, logs.String(), fmt.Sprintf("last_applied_seq=%d seq=%d", tc.first, tc.then))
	}
}
