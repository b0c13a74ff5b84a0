package service

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/enginepub"
	"github.com/kvsource/kvsource/internal/testenv"
)

// matched is the blocks /v1/score finds of tokens on pod.
func matched(t *testing.T, base, pod string, tokens []uint32) int {
	t.Helper()
	code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": tokens, "pods": []string{pod}})
	require.Equal(t, http.StatusOK, code, "%s", body)
	var ans ScoreResponse
	require.NoError(t, json.Unmarshal(body, &ans))
	require.Len(t, ans.Pods, 1)
	return ans.Pods[0].MatchedBlocks
}

func TestServeFollowsSGLangAndTensorRTLLMPodsThroughTheirOwnPublishers(t *testing.T) {
	for _, tc := range []struct {
		name     string
		engine   enginepub.Engine
		flag     string // engine=
		pageSize int
		content  bool
	}{
		{"sglang page 1", enginepub.SGLang, "sglang", 1, false},
		{"sglang page 16", enginepub.SGLang, "sglang", 16, false},
		{"sglang page 1 content keys", enginepub.SGLang, "sglang", 1, true},
		{"sglang page 16 content keys", enginepub.SGLang, "sglang", 16, true},
		{"trtllm block 32", enginepub.TRTLLM, "trtllm", 32, false},
		{"trtllm block 16 content keys", enginepub.TRTLLM, "trtllm", 16, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var start uint64
			if tc.engine == enginepub.TRTLLM {
				start = uint64(time.Now().UnixNano()) // its batches number from time_ns
			}
			port, rport := testenv.FreePort(t), testenv.FreePort(t)
			pub, err := zmq.NewPublisher(zmq.PublisherConfig{Bind: fmt.Sprintf("tcp://127.0.0.1:%d", port),
				ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", rport), Topic: "kv@127.0.0.1:30000@m", FirstSeq: start})
			require.NoError(t, err)
			t.Cleanup(func() { _ = pub.Close() })
			engine := enginepub.New(enginepub.Config{Engine: tc.engine, PageSize: tc.pageSize, Capacity: 200, Start: start})
			publish := func() uint64 {
				_, payload := engine.Flush()
				seq, err := pub.PublishPayload(payload)
				require.NoError(t, err)
				return seq
			}
			// Served before kvsource listens: lost on the live stream,
			// fetched from the engine's replay buffer.
			system := simTokens(96, 1)
			engine.Serve(system)
			publish()
			engine.Serve(append(append([]uint32{}, system[:64]...), simTokens(32, 9)...))
			publish()

			pod := "127.0.0.1:30000"
			args := []string{"--events-connect", fmt.Sprintf("%s=tcp://127.0.0.1:%d,replay=tcp://127.0.0.1:%d,model=m,engine=%s", pod, port, rport, tc.flag)}
			if tc.content {
				args = append(args, "--keys", "content", "--block-size", fmt.Sprint(tc.pageSize))
			} else if tc.pageSize != engine.Config().PageSize || tc.engine == enginepub.SGLang && tc.pageSize != 1 {
				args = append(args, "--block-size", fmt.Sprint(tc.pageSize)) // the engine's page size
			}
			s, base := startServe(t, args...)
			if !tc.content {
				require.Contains(t, []string{"sglang", "trtllm_v1_block_key"}, s.cfg.Algo, "engine= alone gives the engine's keys")
			}
			require.NoError(t, pub.WaitSubscribed(t.Context()))
			h := index.Holder{Pod: pod}
			apply := func() {
				seq := publish()
				require.NoError(t, s.sub.WaitApplied(t.Context(), h, seq))
			}
			turn1 := append(append([]uint32{}, system...), simTokens(40, 2)...)
			turn2 := append(append([]uint32{}, turn1...), simTokens(24, 3)...)   // a multi-turn extension
			branch := append(append([]uint32{}, system...), simTokens(48, 4)...) // a second branch
			prompts := [][]uint32{system, turn1, turn2, branch}
			check := func() {
				t.Helper()
				for _, p := range prompts {
					require.Equal(t, engine.Holds(p), matched(t, base, pod, p), "%d tokens", len(p))
				}
			}
			for _, prompt := range [][]uint32{turn1, turn2, branch} {
				engine.Serve(prompt)
				apply()
				check()
			}
			require.Positive(t, engine.Holds(turn2))
			require.Positive(t, s.sub.Stats().Replayed, "the batches lost before start came from replay")
			if tc.engine == enginepub.TRTLLM {
				_, payload := engine.Heartbeat()
				seq, err := pub.PublishPayload(payload)
				require.NoError(t, err)
				require.NoError(t, s.sub.WaitApplied(t.Context(), h, seq))
				st := s.sub.Stats()
				require.Zero(t, st.Restarts, "a heartbeat is no restart")
				require.Zero(t, st.Gaps, "nor a gap")
			}
			// LRU eviction past the capacity, then a full reset.
			engine.Serve(simTokens(180, 5))
			apply()
			check()
			engine.Reset()
			apply()
			require.Zero(t, matched(t, base, pod, turn2))
			st := s.sub.Stats()
			require.Zero(t, st.DecodeErrors)
			require.Zero(t, st.HashMismatches)
			require.Zero(t, st.Unrecovered)
		})
	}
}

func TestServeTakesEachEnginesDefaultKeysOnlyForAFleetOfThatEngine(t *testing.T) {
	for _, tc := range []struct {
		args      []string
		algo      string
		blockSize int
	}{
		{[]string{"--events-bind", "tcp://*:5557", "--events-engine", "sglang"}, "sglang", 1},
		{[]string{"--events-connect", "a=tcp://h:1,engine=trtllm"}, "trtllm_v1_block_key", 32},
		{[]string{"--events-connect", "a=tcp://h:1,engine=trtllm", "--block-size", "64"}, "trtllm_v1_block_key", 64},
		{[]string{"--events-connect", "a=tcp://h:1,engine=sglang", "--algo", "sha256"}, "sha256", 16},
		{[]string{"--events-connect", "a=tcp://h:1,engine=sglang", "--events-connect", "b=tcp://h:2"}, "sha256", 16}, // mixed
		{[]string{"--events-bind", "tcp://*:5557", "--events-connect", "a=tcp://h:1,engine=sglang"}, "sha256", 16},   // bind pods are vLLM
		{nil, "sha256", 16},
	} {
		cfg, err := parseFlags(tc.args, io.Discard)
		require.NoError(t, err, "%q", tc.args)
		require.Equal(t, tc.algo, cfg.Algo, "%q", tc.args)
		require.Equal(t, tc.blockSize, cfg.BlockSize, "%q", tc.args)
	}
	_, err := parseFlags([]string{"--events-connect", "a=tcp://h:1,engine=dynamo"}, io.Discard)
	require.ErrorContains(t, err, "dynamo")
	_, err = parseFlags([]string{"--events-engine", "nope"}, io.Discard)
	require.ErrorContains(t, err, "--events-engine")
}
