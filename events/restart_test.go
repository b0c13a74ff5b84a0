package events

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/enginepub"
)

// engineBatch is one engine process's batch storing a chain, in its own
// wire form, and the keys it stores.
type engineBatch func(tokens []uint32) (payload []byte, keys []uint64)

func engineBatches(engine Engine) engineBatch {
	if engine == EngineSGLang {
		pod := enginepub.New(enginepub.Config{Engine: enginepub.SGLang, PageSize: 4})
		return func(tokens []uint32) ([]byte, []uint64) {
			pod.Serve(tokens)
			_, payload := pod.Flush()
			return payload, pod.Keys(tokens)
		}
	}
	var next uint64 = 1
	return func(tokens []uint32) ([]byte, []uint64) {
		keys := make([]uint64, len(tokens)/4)
		for i := range keys {
			keys[i], next = next, next+1
		}
		b := batchOf(storedTokens(nil, tokens, keys...))
		return AppendBatch(nil, &b, LayoutMap, 0), keys
	}
}

// A new engine process on a dead one's address (Kubernetes reuses pod
// IPs) serving another model has none of the old process's blocks, under
// any model: its holder must not stay a source, or a score, for them.
func TestAnEngineRestartedUnderAnotherModelInheritsNoBlocksOfTheOld(t *testing.T) {
	for _, engine := range []Engine{EngineVLLM, EngineSGLang} {
		// The new process's first message: its first batch, or a later
		// one when the router missed the first (no replay endpoint).
		for _, first := range []uint64{0, 7} {
			t.Run(fmt.Sprintf("%s first seq %d", engine, first), func(t *testing.T) {
				ix := index.New(index.Config{})
				p := startProcessor(t, Config{Sink: ix})
				ctx := t.Context()
				h := index.Holder{Pod: "10.0.0.7:8000"}
				old, fresh := engineBatches(engine), engineBatches(engine)
				prompt := seqTokens(1, 16)
				payload, oldKeys := old(prompt)
				for seq := range uint64(3) {
					p.Handle(ctx, Message{Pod: h.Pod, Model: "model-a", Seq: seq, Payload: payload, Engine: engine})
				}
				require.NoError(t, p.WaitApplied(ctx, h, 2))
				var res index.Result
				ix.Lookup("model-a", oldKeys, &res)
				require.NotNil(t, res.Holder(h))

				// The pod is killed; a new one on its IP serves model-b.
				p.PodConnected(h.Pod, false)
				p.PodConnected(h.Pod, true)
				payload, newKeys := fresh(seqTokens(500, 8))
				p.Handle(ctx, Message{Pod: h.Pod, Model: "model-b", Seq: first, Payload: payload, Engine: engine})
				require.NoError(t, p.Sync(ctx))

				_, source := p.Source(h)
				require.True(t, source, "a source for its own model's blocks")
				ix.Lookup("model-b", newKeys, &res)
				require.NotNil(t, res.Holder(h))
				ix.Lookup("model-a", oldKeys, &res)
				require.Nil(t, res.Holder(h), "the new process holds none of the old model's blocks")
				require.Equal(t, []index.HolderModel{{Model: "model-b", Holder: h}}, ix.HolderList(),
					"no (model-a, holder) pair is left to list as stale")
				require.Equal(t, "model-b", statusOf(p, h).Model)
				require.Equal(t, uint64(1), p.Stats().Restarts)
			})
		}
	}
}

// An empty batch numbered 0 repeating an applied 0 is a heartbeat of the
// same process, or the first batch of a new one (SGLang numbers from 0):
// after a reconnect it is taken as a restart, so that the new process is
// no source for the dead one's blocks. Without a reconnect, or repeating
// a later number (which no new process starts at), it stays a heartbeat.
func TestAnEmptyFirstBatchAtZeroAfterAReconnectIsARestartNotAHeartbeat(t *testing.T) {
	for _, tc := range []struct {
		engine    Engine
		last      uint64 // the old stream's last number
		reconnect bool
		restart   bool
	}{
		{EngineSGLang, 0, true, true},
		{EngineTRTLLM, 0, true, true},
		{EngineSGLang, 0, false, false},
		{EngineTRTLLM, 0, false, false},
		{EngineSGLang, 5, true, false},
		{EngineTRTLLM, 1_764_633_600_000_000_000, true, false},
	} {
		t.Run(fmt.Sprintf("%s last %d reconnect %v", tc.engine, tc.last, tc.reconnect), func(t *testing.T) {
			ix := index.New(index.Config{})
			p := startProcessor(t, Config{Sink: ix})
			ctx := t.Context()
			h := index.Holder{Pod: "10.0.0.8:8000"}
			stored := batchOf(storedTokens(nil, seqTokens(1, 8), 11, 12))
			p.Handle(ctx, Message{Pod: h.Pod, Model: "m", Seq: tc.last, Payload: AppendBatch(nil, &stored, LayoutMap, 0), Engine: tc.engine})
			require.NoError(t, p.WaitApplied(ctx, h, tc.last))
			if tc.reconnect {
				p.PodConnected(h.Pod, false)
				p.PodConnected(h.Pod, true)
			}
			empty := batchOf()
			p.Handle(ctx, Message{Pod: h.Pod, Model: "m", Seq: tc.last, Payload: AppendBatch(nil, &empty, LayoutArray, 0), Engine: tc.engine})
			require.NoError(t, p.Sync(ctx))

			var res index.Result
			ix.Lookup("m", []uint64{11, 12}, &res)
			state, source := p.Source(h)
			st := p.Stats()
			if tc.restart {
				require.Nil(t, res.Holder(h), "the new process inherited the dead one's blocks (state %s)", state)
				require.Equal(t, uint64(1), st.Restarts)
				require.Zero(t, st.Heartbeats)
				require.True(t, source, "live again, with its own (no) blocks")
				return
			}
			require.NotNil(t, res.Holder(h), "a heartbeat keeps the blocks")
			require.Equal(t, uint64(1), st.Heartbeats)
			require.Zero(t, st.Restarts)
			if !tc.reconnect {
				require.True(t, source)
			}
		})
	}
}

// One sender naming a new model on every message (20,000 names of 498
// bytes held 209 MiB and listed 19,999 stale pairs) leaves one model
// state: a holder's entries follow its current model, and the index frees
// a model nobody holds.
func TestModelNamesOfOneHolderDoNotAccumulate(t *testing.T) {
	ix := index.New(index.Config{})
	p := startProcessor(t, Config{Sink: ix})
	ctx := t.Context()
	h := index.Holder{Pod: "10.0.0.9:8000"}
	const models = 5000
	prefix := strings.Repeat("m", 490)
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range models {
		b := batchOf(storedTokens(nil, seqTokens(i, 4), uint64(i+1)))
		p.Handle(ctx, Message{Pod: h.Pod, Model: fmt.Sprintf("%s-%07d", prefix, i), Seq: uint64(i), Payload: AppendBatch(nil, &b, LayoutMap, 0),
			Sender: "10.0.0.9"})
	}
	require.NoError(t, p.WaitApplied(ctx, h, models-1))
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d model names of %d bytes: heap %+d KiB, %d models, %d (model, holder) pairs", models, len(prefix)+8, grew>>10,
		ix.Stats().Models, len(ix.HolderList()))
	require.Equal(t, 1, ix.Stats().Models)
	require.Len(t, ix.HolderList(), 1)
	require.Less(t, grew, int64(4<<20))
}

// A holder an index snapshot brought in keeps, once its engine publishes,
// only what the snapshot had under the model it publishes: a process that
// took over the address may serve another model, and the snapshot's
// entries under the old one are no stream's. Continuing or with a gap, the
// new model's own snapshot entries stay when the sequence continues.
func TestASnapshotHolderKeepsOnlyTheModelItsEnginePublishes(t *testing.T) {
	for _, tc := range []struct {
		name     string
		seq      uint64
		keepsOwn bool
	}{
		{"sequence continues", 6, true},
		{"sequence gap", 9, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ix := index.New(index.Config{})
			h := index.Holder{Pod: "10.0.0.9:8000"}
			ix.Store(index.Blocks{Model: "model-a", Holder: h, Tier: index.TierGPU, Keys: []uint64{101, 102}})
			ix.Store(index.Blocks{Model: "model-b", Holder: h, Tier: index.TierGPU, Keys: []uint64{201, 202}})
			p := startProcessor(t, Config{Sink: ix, InitialSeqs: map[index.Holder]uint64{h: 5}})
			ctx := t.Context()
			stored := batchOf(storedTokens(nil, seqTokens(1, 8), 301, 302))
			p.Handle(ctx, Message{Pod: h.Pod, Model: "model-b", Seq: tc.seq, Payload: AppendBatch(nil, &stored, LayoutMap, 0)})
			require.NoError(t, p.WaitApplied(ctx, h, tc.seq))

			var res index.Result
			ix.Lookup("model-a", []uint64{101, 102}, &res)
			require.Nil(t, res.Holder(h), "the snapshot's other model is not the stream's")
			ix.Lookup("model-b", []uint64{201, 202}, &res)
			require.Equal(t, tc.keepsOwn, res.Holder(h) != nil, "the published model's snapshot entries")
			ix.Lookup("model-b", []uint64{301, 302}, &res)
			require.NotNil(t, res.Holder(h))
			require.Equal(t, []index.HolderModel{{Model: "model-b", Holder: h}}, ix.HolderList())
		})
	}
}

// A replica reads batches a relay applied (Config.Tapped): heartbeats never
// reach it, so an empty batch repeating the last applied number is the
// relay's restart, a new process's first batch at 0 after its
// predecessor's, and clears the holder as the relay's own subscriber did,
// although the replica sees no reconnect.
func TestATappedStreamTakesARepeatedEmptyBatchAsARestart(t *testing.T) {
	for _, tapped := range []bool{true, false} {
		t.Run(fmt.Sprintf("tapped %v", tapped), func(t *testing.T) {
			ix := index.New(index.Config{})
			p := startProcessor(t, Config{Sink: ix, Tapped: tapped})
			ctx := t.Context()
			h := index.Holder{Pod: "10.0.0.8:8000"}
			stored := batchOf(storedTokens(nil, seqTokens(1, 8), 11, 12))
			p.Handle(ctx, Message{Pod: h.Pod, Model: "m", Seq: 0, Payload: AppendBatch(nil, &stored, LayoutMap, 0), Engine: EngineSGLang})
			require.NoError(t, p.WaitApplied(ctx, h, 0))
			empty := batchOf()
			p.Handle(ctx, Message{Pod: h.Pod, Model: "m", Seq: 0, Payload: AppendBatch(nil, &empty, LayoutArray, 0), Engine: EngineSGLang})
			require.NoError(t, p.Sync(ctx))

			var res index.Result
			ix.Lookup("m", []uint64{11, 12}, &res)
			require.Equal(t, !tapped, res.Holder(h) != nil, "the dead process's blocks")
			st := p.Stats()
			if tapped {
				require.Equal(t, uint64(1), st.Restarts)
				require.Zero(t, st.Heartbeats)
			} else {
				require.Zero(t, st.Restarts)
				require.Equal(t, uint64(1), st.Heartbeats)
			}
		})
	}
}
