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

func TestServeFollowsAnSGLangPodWithItsOwnKeysFromEngineAlone(t *testing.T) {
	for _, pageSize := range []int{1, 16} {
		t.Run(fmt.Sprintf("page size %d", pageSize), func(t *testing.T) {
			port := testenv.FreePort(t)
			pub, err := zmq.NewPublisher(zmq.PublisherConfig{Bind: fmt.Sprintf("tcp://127.0.0.1:%d", port), Topic: "kv@127.0.0.1:30000@m"}) // connect mode names pod and model by flag
			require.NoError(t, err)
			t.Cleanup(func() { _ = pub.Close() })
			pod := "127.0.0.1:30000"
			args := []string{"--events-connect", fmt.Sprintf("%s=tcp://127.0.0.1:%d,model=m,engine=sglang", pod, port)}
			if pageSize != 1 {
				args = append(args, "--block-size", fmt.Sprint(pageSize)) // SGLang's --page-size
			}
			s, base := startServe(t, args...)
			require.Equal(t, "sglang", s.cfg.Algo, "engine=sglang alone gives SGLang's keys")
			require.NoError(t, pub.WaitSubscribed(t.Context()))
			engine := enginepub.New(enginepub.Config{Engine: enginepub.SGLang, PageSize: pageSize, Capacity: 200})
			publish := func() {
				_, payload := engine.Flush()
				seq, err := pub.PublishPayload(payload)
				require.NoError(t, err)
				require.NoError(t, s.sub.WaitApplied(t.Context(), index.Holder{Pod: pod}, seq))
			}
			system := simTokens(96, 1)
			turn1 := append(append([]uint32{}, system...), simTokens(40, 2)...)
			turn2 := append(append([]uint32{}, turn1...), simTokens(24, 3)...)   // a multi-turn extension
			branch := append(append([]uint32{}, system...), simTokens(48, 4)...) // a second branch
			for _, prompt := range [][]uint32{turn1, turn2, branch} {
				engine.Serve(prompt)
				publish()
				for _, p := range [][]uint32{system, turn1, turn2, branch} {
					require.Equal(t, engine.Holds(p), matched(t, base, pod, p))
				}
			}
			require.Positive(t, engine.Holds(turn2))
			// LRU eviction past the capacity, then a full reset.
			engine.Serve(simTokens(180, 5))
			publish()
			for _, p := range [][]uint32{system, turn1, turn2, branch} {
				require.Equal(t, engine.Holds(p), matched(t, base, pod, p))
			}
			engine.Reset()
			publish()
			require.Eventually(t, func() bool { return matched(t, base, pod, turn2) == 0 }, 10*time.Second, 10*time.Millisecond)
			require.Zero(t, s.sub.Stats().DecodeErrors)
			require.Zero(t, s.sub.Stats().HashMismatches)
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
