package service

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/llmdsim"
	"github.com/kvsource/kvsource/internal/testenv"
)

func TestServeContentKeysMatchLLMDSimulator(t *testing.T) {
	for _, tc := range []struct {
		name   string
		format llmdsim.Format
	}{{"array", llmdsim.Array}, {"map", llmdsim.Map}} {
		t.Run(tc.name, func(t *testing.T) {
			const model, bs = "Qwen/Qwen3-0.6B", 16
			bind := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
			var logs syncLog
			base := startServeLogged(t, &logs, "--keys", "content", "--block-size", "16", "--events-bind", bind)
			pods := startSimPods(t, base, bind, model, tc.format, bs, "127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8103")
			a, b, c := pods[0], pods[1], pods[2]

			prompt := simTokens(8*bs+5, 1)
			n := len(prompt) / bs
			want := holdings{}
			// A caches the whole prompt in one event from block 0.
			a.sim.Store(prompt, 0)
			want.set(a.holder, index.TierGPU, 0, n, true)
			// B caches four blocks, then two more continuing the chain,
			// then evicts block 5.
			b.sim.Store(prompt[:4*bs], 0)
			b.flush(t)
			keys := b.sim.Store(prompt[:6*bs], 4)
			b.sim.Remove(keys[5])
			want.set(b.holder, index.TierGPU, 0, 5, true)
			// C caches another prompt, is cleared, then caches two blocks.
			c.sim.Store(simTokens(4*bs, 2), 0)
			c.flush(t)
			c.sim.Clear()
			c.sim.Store(prompt[:2*bs], 0)
			want.set(c.holder, index.TierGPU, 0, 2, true)
			for _, p := range pods {
				p.flush(t)
			}

			require.Eventually(t, func() bool {
				listed := podsByHolder(t, base)
				for _, p := range pods {
					if listed[p.holder].Blocks[index.TierGPU] != len(want[p.holder][index.TierGPU]) {
						return false
					}
				}
				return true
			}, 10*time.Second, 20*time.Millisecond, "the index never matched the simulators' events")
			for _, p := range podsByHolder(t, base) {
				require.Equal(t, model, p.Model)
				require.Equal(t, "live", p.State)
				require.Zero(t, p.Counters["decode_errors"])
			}

			code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": model, "tokens": prompt})
			require.Equal(t, http.StatusOK, code, "%s", body)
			var score struct {
				Blocks int
				Pods   []struct {
					Pod           string
					MatchedBlocks int `json:"matched_blocks"`
					Score         float64
				}
			}
			require.NoError(t, json.Unmarshal(body, &score))
			require.Equal(t, n, score.Blocks)
			holders := []index.Holder{a.holder, b.holder, c.holder}
			slices.SortFunc(holders, func(x, y index.Holder) int {
				return want.run(y, bothTiers, 0, n) - want.run(x, bothTiers, 0, n)
			})
			require.Len(t, score.Pods, len(holders))
			for i, hd := range holders {
				require.Equal(t, hd.Pod, score.Pods[i].Pod)
				require.Equal(t, want.run(hd, bothTiers, 0, n), score.Pods[i].MatchedBlocks, hd.Pod)
				require.InDelta(t, want.score(hd, n), score.Pods[i].Score, 1e-9, hd.Pod)
			}
			require.Equal(t, n, score.Pods[0].MatchedBlocks, "content keys match the simulator's blocks")

			// Picks: the simulator reports the GPU tier only, which is not
			// pulled from, so each answer is the destination's own prefix.
			for _, pc := range []struct {
				dest   index.Holder
				reason string
			}{
				{a.holder, "local_hit"},
				{b.holder, "self"},
				{c.holder, "self"},
				{index.Holder{Pod: "127.0.0.1:8109"}, "no_holder"},
			} {
				code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": model, "tokens": prompt, "destination": pc.dest.Pod})
				require.Equal(t, http.StatusOK, code, "%s", body)
				var pick struct {
					Reason string
					Source *string
					Cached int `json:"destination_cached_blocks"`
				}
				require.NoError(t, json.Unmarshal(body, &pick))
				require.Equal(t, pc.reason, pick.Reason, pc.dest.Pod)
				require.Nil(t, pick.Source)
				require.Equal(t, want.run(pc.dest, bothTiers, 0, n), pick.Cached, pc.dest.Pod)
			}
			require.NotContains(t, logs.String(), "level=ERROR")
		})
	}
}

// TestServeEngineKeysFromLLMDSimulatorAreReportedAsAMismatch: without
// --keys content the simulator's keys cannot match, and the hash-agreement
// check, which runs on its parent-0 events, says so and names the flag.
func TestServeEngineKeysFromLLMDSimulatorAreReportedAsAMismatch(t *testing.T) {
	const model = "m"
	bind := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	var logs syncLog
	base := startServeLogged(t, &logs, "--events-bind", bind)
	p := startSimPods(t, base, bind, model, llmdsim.Array, 16, "127.0.0.1:8201")[0]
	p.sim.Store(simTokens(4*16, 3), 0)
	p.flush(t)
	require.Eventually(t, func() bool { return podsByHolder(t, base)[p.holder].Counters["hash_mismatches"] > 0 },
		10*time.Second, 20*time.Millisecond, "the agreement check never ran on parent-0 events")
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "--keys content") }, 5*time.Second, 10*time.Millisecond)
	require.Contains(t, logs.String(), "pod="+p.holder.Pod)
}
