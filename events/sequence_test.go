package events

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

func TestDecideTakesEachSequenceNumberAsTheStreamsStateSays(t *testing.T) {
	// A holder that applied 9 and received 9 live last.
	live := seqState{started: true, next: 10, liveMax: 9, hasSeq: true}
	// One whose replay ran ahead: applied up to 14, received 9 live last.
	ahead := seqState{started: true, next: 15, liveMax: 9, hasSeq: true}
	// One that applied 0 only.
	atZero := seqState{started: true, next: 1, liveMax: 0, hasSeq: true}
	trt := live
	trt.trt = true
	for _, tc := range []struct {
		name    string
		s       seqState
		m       seqMsg
		want    action
		replays bool
	}{
		{"a new holder joins wherever it numbers, catching up on what came before", seqState{}, seqMsg{seq: 500}, actJoin, true},
		{"a new holder joining at 0 has nothing before it to catch up on", seqState{}, seqMsg{seq: 0}, actJoin, false},
		{"the number expected applies", live, seqMsg{seq: 10}, actApply, false},
		{"an empty batch expected applies", live, seqMsg{seq: 10, empty: true}, actApply, false},
		{"an empty batch repeating the last applied number is a heartbeat", live, seqMsg{seq: 9, empty: true}, actHeartbeat, false},
		{"an empty batch repeating it after a reconnect is still a heartbeat", live, seqMsg{seq: 9, empty: true, reconnected: true}, actHeartbeat, false},
		{"an empty batch repeating an applied 0 is a heartbeat", atZero, seqMsg{seq: 0, empty: true}, actHeartbeat, false},
		{"an empty batch at 0 repeating 0 after a reconnect is a new process's first", atZero, seqMsg{seq: 0, empty: true, reconnected: true}, actBackwards, false},
		{"a batch with events repeating the last applied number goes backwards", live, seqMsg{seq: 9}, actBackwards, true},
		{"a tapped empty batch repeating the last applied number is the relay's restart", live, seqMsg{seq: 9, empty: true, tapped: true}, actBackwards, true},
		{"an empty batch repeating a number never applied goes backwards", seqState{started: true, next: 10, liveMax: 9}, seqMsg{seq: 9, empty: true}, actBackwards, true},
		{"a jump forward is a gap", live, seqMsg{seq: 12}, actGap, true},
		{"an empty batch jumping forward is a gap, not a heartbeat", live, seqMsg{seq: 12, empty: true}, actGap, true},
		{"vLLM's jump forward by TRTRestartJump is a gap", live, seqMsg{seq: 10 + TRTRestartJump}, actGap, true},
		{"TensorRT-LLM's jump forward short of TRTRestartJump is a gap", trt, seqMsg{seq: 9 + TRTRestartJump}, actGap, true},
		{"TensorRT-LLM's jump forward by TRTRestartJump is a new process", trt, seqMsg{seq: 10 + TRTRestartJump}, actRestart, true},
		{"TensorRT-LLM's empty batch repeating its last number is a heartbeat", trt, seqMsg{seq: 9, empty: true, reconnected: true}, actHeartbeat, false},
		{"a number a replay that ran ahead applied already is a duplicate", ahead, seqMsg{seq: 12}, actDuplicate, false},
		{"the last number a replay that ran ahead applied is a duplicate", ahead, seqMsg{seq: 14}, actDuplicate, false},
		{"a number received live before goes backwards", ahead, seqMsg{seq: 9}, actBackwards, true},
		{"0 after applied numbers goes backwards, with nothing before it", live, seqMsg{seq: 0}, actBackwards, false},
		{"a number before the live maximum goes backwards", live, seqMsg{seq: 3}, actBackwards, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := decide(tc.s, tc.m)
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.replays, got.replays(tc.m.seq))
		})
	}
}

func TestOnlyTheActionsThatCatchUpOrCloseAGapReplay(t *testing.T) {
	for a, want := range map[action]bool{actJoin: true, actApply: false, actHeartbeat: false, actRestart: true, actGap: true,
		actDuplicate: false, actBackwards: true} {
		require.Equal(t, want, a.replays(7), "action %d", a)
		require.Equal(t, a == actGap, a.replays(0), "action %d at 0", a)
	}
}

// countingReplayer answers every replay with no batches, counting them.
type countingReplayer struct{ n int }

func (r *countingReplayer) Replay(context.Context, index.Holder, uint64, func(uint64, []byte) bool) error {
	r.n++
	return nil
}

// The live path and the prediction that runs a replay off the worker read
// one state machine: step replays exactly when replays says it will.
func TestStepReplaysExactlyWhenReplaysPredicts(t *testing.T) {
	p, err := NewProcessor(Config{Sink: eventstest.NewRecSink(), Logger: testenv.TextLogger(discard{})})
	require.NoError(t, err)
	stored := batchOf(storedTokens(nil, seqTokens(0, 4), 1))
	cases := 0
	for _, engine := range []Engine{EngineVLLM, EngineTRTLLM} {
		for _, started := range []bool{false, true} {
			for next := range uint64(4) {
				for liveMax := range next + 1 {
					for _, seq := range []uint64{0, 1, 2, 3, 4, 6, next + TRTRestartJump} {
						for _, b := range []Batch{{}, stored} {
							r := &countingReplayer{}
							h := &holder{id: index.Holder{Pod: "pod"}, model: "m", replay: r, engine: engine,
								started: started, next: next, liveMax: liveMax}
							h.hasSeq.Store(started && next > 0)
							w := newWorker(p)
							w.batch = b
							predicted := w.replays(h, seq, 0)
							w.step(h, seq, 0, nil)
							require.Equal(t, predicted, r.n > 0, "engine %d started %v next %d live max %d seq %d events %d",
								engine, started, next, liveMax, seq, len(b.Events))
							cases++
						}
					}
				}
			}
		}
	}
	t.Logf("%d cases", cases)
}
