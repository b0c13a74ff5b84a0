package events

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/enginepub"
	"github.com/kvsource/kvsource/internal/testenv"
)

// End-to-end at the SDK level, per engine: models of SGLang's and
// TensorRT-LLM's publishers (internal/enginepub) feed a Processor and an
// index, and every pod's lookups are checked against the model's own
// cache, position by position.

type engineCase struct {
	name    string
	pub     enginepub.Config
	engine  Engine
	content bool // content keys, else the engine's own
	algo    hashing.Algo
}

func engineCases() []engineCase {
	var out []engineCase
	for _, ps := range []int{1, 16} {
		for _, content := range []bool{false, true} {
			out = append(out,
				engineCase{pub: enginepub.Config{Engine: enginepub.SGLang, PageSize: ps}, engine: EngineSGLang, content: content, algo: hashing.SGLang},
				engineCase{pub: enginepub.Config{Engine: enginepub.TRTLLM, PageSize: ps, Start: 1_764_633_600_123_456_789}, engine: EngineTRTLLM, content: content, algo: hashing.TRTV1},
			)
		}
	}
	out = append(out,
		engineCase{name: "sglang eagle", pub: enginepub.Config{Engine: enginepub.SGLang, PageSize: 16, EAGLE: true}, engine: EngineSGLang, algo: hashing.SGLangEAGLE},
		engineCase{name: "sglang eagle content", pub: enginepub.Config{Engine: enginepub.SGLang, PageSize: 1, EAGLE: true}, engine: EngineSGLang, content: true},
		engineCase{name: "sglang salted", pub: enginepub.Config{Engine: enginepub.SGLang, PageSize: 16, CacheSalt: "tenant"}, engine: EngineSGLang, algo: hashing.SGLang},
		engineCase{name: "trtllm salted", pub: enginepub.Config{Engine: enginepub.TRTLLM, PageSize: 16, CacheSalt: "tenant", Start: 1 << 60}, engine: EngineTRTLLM, algo: hashing.TRTV1},
	)
	for i := range out {
		if out[i].name == "" {
			keys := string(out[i].algo)
			if out[i].content {
				keys = "content"
			}
			out[i].name = fmt.Sprintf("%s page %d %s", out[i].engine, out[i].pub.PageSize, keys)
		}
	}
	return out
}

func randTokens(r *rand.Rand, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = r.Uint32N(150_000)
	}
	return out
}

func TestEnginesFeedTheIndexEndToEnd(t *testing.T) {
	for _, tc := range engineCases() {
		t.Run(tc.name, func(t *testing.T) {
			ps := tc.pub.PageSize
			router, err := hashing.New(hashing.Config{Algo: tc.algo, BlockSize: ps})
			if tc.content {
				router, err = hashing.New(hashing.Config{Algo: hashing.Content, BlockSize: ps})
			}
			require.NoError(t, err)
			ix := index.New(index.Config{})
			cfg := Config{Sink: ix}
			if tc.content {
				cfg.ContentKeys = router
			} else {
				cfg.Hasher = router
			}
			p := startProcessor(t, cfg)
			ctx := t.Context()

			r := rand.New(rand.NewPCG(23, uint64(ps)))
			system := randTokens(r, 3*ps+5)
			turn := func(prefix []uint32, n int) []uint32 { return slices.Concat(prefix, randTokens(r, n*ps+3)) }
			lruCfg, bigCfg := tc.pub, tc.pub
			lruCfg.Capacity = 6 * 3 // three short prompts' pages at most
			pods := map[string]*enginepub.Pod{
				"10.0.0.1:8000": enginepub.New(bigCfg),
				"10.0.0.2:8000": enginepub.New(lruCfg),
				"10.0.0.3:8000": enginepub.New(bigCfg),
			}
			a, b, c := pods["10.0.0.1:8000"], pods["10.0.0.2:8000"], pods["10.0.0.3:8000"]
			send := func(pod string, seq uint64, payload []byte) {
				p.Handle(ctx, Message{Pod: pod, Model: "m", Seq: seq, Payload: payload, Replay: pods[pod], Engine: tc.engine})
			}
			flush := func(pod string) {
				seq, payload := pods[pod].Flush()
				send(pod, seq, payload)
			}
			heartbeat := func(pod string) {
				seq, payload := pods[pod].Heartbeat()
				send(pod, seq, payload)
			}

			// Batches published before the router subscribed, fetched by
			// replay when the pod's first live batch arrives.
			q1 := turn(system, 2)
			a.Serve(q1)
			a.Flush()
			a.Serve(turn(system, 1))
			a.Flush()
			// A multi-turn extension and a second branch on pod a.
			q1b := turn(q1, 2)
			a.Serve(q1b)
			flush("10.0.0.1:8000")
			q5 := turn(system, 3)
			a.Serve(q5)
			flush("10.0.0.1:8000")
			// The shared prefix on pod b, then enough other prompts for its
			// LRU eviction to take the oldest.
			q3 := turn(system, 1)
			b.Serve(q3)
			flush("10.0.0.2:8000")
			var others [][]uint32
			for range 4 {
				o := randTokens(r, 5*ps+1)
				others = append(others, o)
				b.Serve(o)
				flush("10.0.0.2:8000")
			}
			// Pod c: a branch, a heartbeat, a full reset, then a new prompt.
			q4 := turn(system, 2)
			c.Serve(q4)
			flush("10.0.0.3:8000")
			heartbeat("10.0.0.3:8000")
			c.Reset()
			flush("10.0.0.3:8000")
			x := randTokens(r, 4*ps+2)
			c.Serve(x)
			flush("10.0.0.3:8000")
			heartbeat("10.0.0.3:8000")
			require.NoError(t, p.Sync(ctx))

			queries := slices.Concat([][]uint32{system, q1, q1b, q3, q4, q5, x, turn(q1b, 1), randTokens(r, 3*ps)}, others)
			var res index.Result
			salt := ""
			if tc.engine == EngineTRTLLM {
				salt = tc.pub.CacheSalt // SGLang does not hash it
			}
			for qi, q := range queries {
				keys, err := router.BlockKeys(nil, hashing.Request{Tokens: q, CacheSalt: salt})
				require.NoError(t, err)
				ix.Lookup("m", keys, &res)
				for name, pod := range pods {
					want := pod.Holds(q)
					got := 0
					if hit := res.Holder(index.Holder{Pod: name}); hit != nil {
						got = hit.Prefix
					}
					if tc.content && tc.pub.EAGLE && got == want+1 {
						// Content keys cover a page's own tokens: SGLang's
						// bigram for its last position also needs the token
						// after it, which a prompt ending at the page lacks.
						continue
					}
					require.Equal(t, want, got, "query %d on %s", qi, name)
				}
			}
			require.NotZero(t, a.Holds(q1b))
			require.NotZero(t, b.Holds(others[3]))
			require.Zero(t, b.Holds(q3), "pod b evicted its oldest prompt")
			require.Zero(t, c.Holds(q4), "pod c was reset")

			st := p.Stats()
			require.Zero(t, st.DecodeErrors)
			require.Zero(t, st.Gaps)
			require.Zero(t, st.Unrecovered)
			require.Zero(t, st.Restarts)
			if tc.engine == EngineTRTLLM && tc.pub.CacheSalt != "" {
				// TensorRT-LLM's events do not carry the salt its keys
				// mix in: block 0 cannot be rechecked.
				require.NotZero(t, st.HashMismatches)
			} else {
				require.Zero(t, st.HashMismatches)
			}
			require.Zero(t, st.Unresolved)
			require.Equal(t, uint64(2), st.Replayed, "the batches lost before the start")
			if !tc.content {
				require.NotZero(t, st.HashChecks)
				// Engine keys: the index holds the engine's own keys.
				keys, err := router.BlockKeys(nil, hashing.Request{Tokens: q1b, CacheSalt: salt})
				require.NoError(t, err)
				require.Equal(t, a.Keys(q1b), keys)
			}
		})
	}
}

func mustKeys(t *testing.T, h *hashing.Hasher, tokens []uint32) []uint64 {
	t.Helper()
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	return keys
}

func TestTRTLLMRestartIsAJumpForwardNotAGap(t *testing.T) {
	for _, engine := range []Engine{EngineTRTLLM, EngineVLLM} {
		t.Run(engine.String(), func(t *testing.T) {
			ix := index.New(index.Config{})
			router, err := hashing.New(hashing.Config{Algo: hashing.TRTV1, BlockSize: 16})
			require.NoError(t, err)
			p := startProcessor(t, Config{Sink: ix, Hasher: router})
			ctx := t.Context()
			const pod = "10.0.0.9:8000"
			old := enginepub.New(enginepub.Config{Engine: enginepub.TRTLLM, PageSize: 16, Start: 1_000_000_000_000})
			prompt := seqTokens(1, 64)
			old.Serve(prompt)
			seq, payload := old.Flush()
			p.Handle(ctx, Message{Pod: pod, Model: "m", Seq: seq, Payload: payload, Replay: old, Engine: engine})
			require.NoError(t, p.Sync(ctx))
			require.Equal(t, 4, old.Holds(prompt))

			// The engine restarts a minute later: its numbers start again
			// at its new time_ns, and the router misses its first batch.
			fresh := enginepub.New(enginepub.Config{Engine: enginepub.TRTLLM, PageSize: 16, Start: 1_000_000_000_000 + 60e9})
			other := seqTokens(500, 32)
			fresh.Serve(other)
			fresh.Flush()
			fresh.Serve(prompt[:32])
			seq, payload = fresh.Flush()
			p.Handle(ctx, Message{Pod: pod, Model: "m", Seq: seq, Payload: payload, Replay: fresh, Engine: engine})
			require.NoError(t, p.Sync(ctx))

			var res index.Result
			ix.Lookup("m", mustKeys(t, router, prompt), &res)
			hit := res.Holder(index.Holder{Pod: pod})
			require.NotNil(t, hit)
			require.Equal(t, 2, hit.Prefix, "the old process's blocks are gone, the new one's are there")
			ix.Lookup("m", mustKeys(t, router, other), &res)
			st := p.Stats()
			if engine == EngineTRTLLM {
				require.Equal(t, uint64(1), st.Restarts)
				require.Zero(t, st.Gaps)
				require.Equal(t, 2, res.Holder(index.Holder{Pod: pod}).Prefix, "replayed from the new process's start")
				return
			}
			// As vLLM the jump is a gap whose range the new buffer lacks:
			// GapClear ends up with the same entries, but the restart is
			// counted as a lost range.
			require.Equal(t, uint64(1), st.Gaps)
			require.Equal(t, uint64(1), st.Unrecovered)
			require.Zero(t, st.Restarts)
		})
	}
}

func TestAHeartbeatRepeatingTheLastSequenceIsNoRestart(t *testing.T) {
	sink := index.New(index.Config{})
	p := startProcessor(t, Config{Sink: sink})
	ctx := t.Context()
	stored, err := msgpack.Marshal([]any{1.0, []any{[]any{"BlockStored", []int64{-3}, nil, []int{1}, 1}}})
	require.NoError(t, err)
	empty, err := msgpack.Marshal([]any{2.0, []any{}})
	require.NoError(t, err)
	h := index.Holder{Pod: "10.0.0.1:8000"}
	p.Handle(ctx, Message{Pod: h.Pod, Model: "m", Seq: 1_764_633_600_000_000_000, Payload: stored})
	for range 3 {
		p.Handle(ctx, Message{Pod: h.Pod, Model: "m", Seq: 1_764_633_600_000_000_000, Payload: empty})
	}
	require.NoError(t, p.Sync(ctx))
	st := p.Stats()
	require.Equal(t, uint64(3), st.Heartbeats)
	require.Zero(t, st.Restarts)
	require.Zero(t, st.Gaps)
	var res index.Result
	sink.Lookup("m", []uint64{uint64(1<<64 - 3)}, &res)
	require.NotNil(t, res.Holder(h), "the block stays")
	// An empty batch at the next number is an ordinary batch.
	p.Handle(ctx, Message{Pod: h.Pod, Model: "m", Seq: 1_764_633_600_000_000_001, Payload: empty})
	require.NoError(t, p.WaitApplied(ctx, h, 1_764_633_600_000_000_001))
	require.Equal(t, uint64(3), p.Stats().Heartbeats)
}

func TestParseEngine(t *testing.T) {
	for in, want := range map[string]Engine{"": EngineVLLM, "vLLM": EngineVLLM, "sglang": EngineSGLang, "trtllm": EngineTRTLLM,
		"TensorRT-LLM": EngineTRTLLM, "tensorrt_llm": EngineTRTLLM} {
		got, err := ParseEngine(in)
		require.NoError(t, err)
		require.Equal(t, want, got, in)
		again, err := ParseEngine(got.String())
		require.NoError(t, err)
		require.Equal(t, got, again)
	}
	_, err := ParseEngine("llama.cpp")
	require.ErrorIs(t, err, ErrConfig)
	require.Equal(t, hashing.SGLang, EngineSGLang.Hashing().Algo)
	require.Equal(t, 1, EngineSGLang.Hashing().BlockSize)
	require.Equal(t, hashing.TRTV1, EngineTRTLLM.Hashing().Algo)
}

func TestPerPageEventsApplyAsOneIndexCallPerChain(t *testing.T) {
	// SGLang at page size 1: a page per event. Each chain is one Store,
	// and a removal run one Remove, in the batch's order.
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink})
	pod := enginepub.New(enginepub.Config{Engine: enginepub.SGLang, PageSize: 1, Capacity: 24})
	a, b := seqTokens(1, 16), seqTokens(100, 16)
	pod.Serve(a)
	pod.Serve(b) // evicts 8 pages of a's: 8 BlockRemoved events after b's 16 BlockStored
	seq, payload := pod.Flush()
	h := index.Holder{Pod: "10.0.0.1:8000"}
	p.Handle(t.Context(), Message{Pod: h.Pod, Model: "m", Seq: seq, Payload: payload, Engine: EngineSGLang})
	require.NoError(t, p.WaitApplied(t.Context(), h, seq))
	require.Equal(t, 2, sink.Stores(), "one Store per chain")
	want := slices.Concat(pod.Keys(a)[:8], pod.Keys(b))
	slices.Sort(want)
	require.Equal(t, want, sink.Keys("m", h, "GPU"))
	require.Equal(t, uint64(16+16+8), p.Stats().Blocks)
}

func TestAMismatchNamesTheEngineWhoseKeysTheStreamCarries(t *testing.T) {
	tests := []struct {
		pub  enginepub.Config
		want string
	}{
		{enginepub.Config{Engine: enginepub.SGLang, PageSize: 16}, "SGLang's sglang keys (block size 16), not vLLM's: set --algo sglang"},
		{enginepub.Config{Engine: enginepub.SGLang, PageSize: 16, EAGLE: true}, "SGLang's sglang_eagle keys"},
		{enginepub.Config{Engine: enginepub.TRTLLM, PageSize: 16, Start: 1 << 61}, "TensorRT-LLM's trtllm_v1_block_key keys"},
	}
	for _, tc := range tests {
		t.Run(tc.want, func(t *testing.T) {
			var logs testenv.SyncBuffer
			p := startProcessor(t, Config{Sink: index.New(index.Config{}), Hasher: &hashing.Hasher{}, Logger: testenv.TextLogger(&logs)})
			pod := enginepub.New(tc.pub)
			pod.Serve(seqTokens(1, 64))
			seq, payload := pod.Flush()
			h := index.Holder{Pod: "10.0.0.1:8000"}
			p.Handle(t.Context(), Message{Pod: h.Pod, Model: "m", Seq: seq, Payload: payload})
			require.NoError(t, p.WaitApplied(t.Context(), h, seq))
			require.NotZero(t, p.Stats().HashMismatches)
			require.Contains(t, logs.String(), tc.want)
		})
	}
}
