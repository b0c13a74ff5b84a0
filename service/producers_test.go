package service

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/llmdsim"
	"github.com/kvsource/kvsource/internal/testenv"
	"github.com/kvsource/kvsource/internal/vllmpod"
)

// The tests in this file feed serve from producers nobody on this project
// wrote, modelled in internal/llmdsim and internal/vllmpod, and check its
// answers against reference models that know blocks only by their position
// in the prompt.

// startServeLogged is startServe with the service's log lines (warnings
// and up) also written to logs.
func startServeLogged(t *testing.T, logs *syncLog, args ...string) string {
	t.Helper()
	_, base := startServeWith(t, slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn})), args...)
	return base
}

// syncLog collects log output written from several goroutines.
type syncLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *syncLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// podsByHolder returns /v1/pods by holder.
func podsByHolder(t *testing.T, base string) map[index.Holder]Pod {
	t.Helper()
	code, body := call(t, "GET", base+"/v1/pods", nil)
	require.Equal(t, http.StatusOK, code)
	var resp struct{ Pods []Pod }
	require.NoError(t, json.Unmarshal(body, &resp))
	m := map[index.Holder]Pod{}
	for _, p := range resp.Pods {
		m[index.Holder{Pod: p.Pod, Rank: p.DPRank}] = p
	}
	return m
}

// simPod is one simulated llm-d simulator pod: its event stream and the
// socket it dials the service's bind endpoint with.
type simPod struct {
	holder index.Holder
	sim    *llmdsim.Sim
	pub    *vllmpod.Pod
}

func (p *simPod) flush(t *testing.T) {
	t.Helper()
	payload, err := p.sim.Flush()
	require.NoError(t, err)
	_, err = p.pub.Publish(payload)
	require.NoError(t, err)
}

// startSimPods starts one simulator per holder, dialling bind, and returns
// once the service lists every one of them: the simulator has no replay, so
// batches published before the connection is up would be lost.
func startSimPods(t *testing.T, base, bind, model string, format llmdsim.Format, blockSize int, pods ...string) []*simPod {
	t.Helper()
	var out []*simPod
	for _, pod := range pods {
		pub, err := vllmpod.Start(vllmpod.Config{Endpoint: bind, Connect: true, Topic: llmdsim.Topic(pod, model)})
		require.NoError(t, err)
		t.Cleanup(pub.Close)
		out = append(out, &simPod{holder: index.Holder{Pod: pod},
			sim: &llmdsim.Sim{Seed: "42", Model: model, BlockSize: blockSize, Format: format}, pub: pub})
	}
	require.Eventually(t, func() bool {
		listed := podsByHolder(t, base)
		all := true
		for _, p := range out {
			if _, ok := listed[p.holder]; !ok {
				all = false
				p.flush(t) // an empty batch, until one gets through
			}
		}
		return all
	}, 10*time.Second, 20*time.Millisecond, "the simulators never reached the service")
	return out
}

func simTokens(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = 100 + (seed*7919+uint32(i)*31)%30000
	}
	return out
}

// p2pGuideKeys are the event keys of p2pGuideTokens as a vLLM engine with
// llm-d's P2P guide settings (sha256, PYTHONHASHSEED=0, block size 64)
// publishes them, computed with CPython's hashlib and pickle (protocol 5),
// as vLLM's hash_block_tokens does.
var p2pGuideKeys = []uint64{14126091773836244283, 16774577411076865265, 18446553418615572246, 10500738091550637961,
	8749112542080501348, 9832188618749114282, 15002927663629684377, 12083904845529154191, 12417367455953427276,
	15544836538432223367, 13882150914967409726, 16919356959902701508, 7077776337968009822, 10350080882892808138,
	13873766031327744069, 8645255495276482415, 15654292524944006498, 7691757356620874856, 12199627203079025872,
	13586030270812441769, 1340007160295843247, 17118247712422394264, 2223675042818463595, 3380575389677753990,
	2989474055530278883, 350268249448864347, 17162559678808625104, 1871066043586373767, 2798740624532329001,
	2549001485407520173, 18388402580745395240, 6334082677822198264, 18289790824161797625, 17377384426778663580,
	11108913258244184893, 16168097994164105188, 4682370804882816582, 15773265889793809453, 11029445935367658906,
	2461446122457065659}

func p2pGuideTokens() []uint32 {
	out := make([]uint32, 40*64)
	for i := range out {
		out[i] = uint32((i*7919+3)%32000 + 1)
	}
	return out
}

// vllmStored is a vLLM >= 0.26 BlockStored in the map layout for blocks
// [from, to) of keys and tokens, self-describing: its own hashes, tokens,
// parent and block size, whatever the tier.
func vllmStored(keys []uint64, tokens []uint32, bs, from, to int, medium string) map[string]any {
	var parent any
	if from > 0 {
		parent = keys[from-1]
	}
	return map[string]any{"type": "BlockStored", "block_hashes": keys[from:to], "parent_block_hash": parent,
		"token_ids": tokens[from*bs : to*bs], "block_size": bs, "medium": medium}
}

func vllmBatch(t *testing.T, events ...any) []byte {
	t.Helper()
	if events == nil {
		events = []any{}
	}
	b, err := msgpack.Marshal([]any{1.5, events, 0})
	require.NoError(t, err)
	return b
}

// startVLLMPods starts one vLLM-style pod per name, publishing on a bound
// PUB socket with a replay socket, and returns them with the
// --events-connect flags that reach them (topic kv@POD@MODEL unless model
// is "", vLLM's default empty topic).
func startVLLMPods(t *testing.T, topicModel string, pods ...string) ([]*vllmpod.Pod, []string) {
	t.Helper()
	var out []*vllmpod.Pod
	var flags []string
	for _, pod := range pods {
		port, replay := testenv.FreePort(t), testenv.FreePort(t)
		topic := ""
		if topicModel != "" {
			topic = "kv@" + pod + "@" + topicModel
		}
		p, err := vllmpod.Start(vllmpod.Config{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port),
			ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replay), Topic: topic})
		require.NoError(t, err)
		t.Cleanup(p.Close)
		out = append(out, p)
		flags = append(flags, "--events-connect", fmt.Sprintf("%s=tcp://127.0.0.1:%d,replay=tcp://127.0.0.1:%d", pod, port, replay))
	}
	return out, flags
}

// awaitHoldings publishes empty batches on pods until /v1/pods shows want:
// the first batches may go out before the service's subscription is up, and
// the next one makes it fetch them by replay.
func awaitHoldings(t *testing.T, base string, pods []*vllmpod.Pod, want holdings) {
	t.Helper()
	require.Eventually(t, func() bool {
		listed := podsByHolder(t, base)
		ok := true
		for hd, tiers := range want {
			for tier, blocks := range tiers {
				if listed[hd].Blocks[tier] != len(blocks) {
					ok = false
				}
			}
		}
		if !ok {
			for _, p := range pods {
				_, err := p.Publish(vllmBatch(t))
				require.NoError(t, err)
			}
		}
		return ok
	}, 10*time.Second, 50*time.Millisecond, "the index never matched the published events")
}

func TestServeLLMDP2PGuideSettings(t *testing.T) {
	const model, bs, delta = "meta-llama/Llama-3.1-8B-Instruct", 64, 2048
	tokens, keys := p2pGuideTokens(), p2pGuideKeys
	n := len(keys)
	pods, flags := startVLLMPods(t, model, "10.0.3.1:8000", "10.0.3.2:8000", "10.0.3.3:8000")
	a, b, c := index.Holder{Pod: "10.0.3.1:8000"}, index.Holder{Pod: "10.0.3.2:8000"}, index.Holder{Pod: "10.0.3.3:8000"}
	var logs syncLog
	base := startServeLogged(t, &logs, append(flags, "--block-size", "64", "--seed", "0",
		"--min-cached-token-delta", fmt.Sprint(delta))...)

	want := holdings{}
	// A computed the whole prompt and offloaded every GPU block to CPU,
	// each reported with its own hash, tokens and parent, in two events.
	_, err := pods[0].Publish(vllmBatch(t, vllmStored(keys, tokens, bs, 0, n, "GPU")))
	require.NoError(t, err)
	_, err = pods[0].Publish(vllmBatch(t, vllmStored(keys, tokens, bs, 0, 20, "CPU"), vllmStored(keys, tokens, bs, 20, n, "CPU")))
	require.NoError(t, err)
	want.set(a, index.TierGPU, 0, n, true)
	want.set(a, index.TierCPU, 0, n, true)
	_, err = pods[1].Publish(vllmBatch(t, vllmStored(keys, tokens, bs, 0, 4, "GPU")))
	require.NoError(t, err)
	want.set(b, index.TierGPU, 0, 4, true)
	_, err = pods[2].Publish(vllmBatch(t, vllmStored(keys, tokens, bs, 0, 9, "GPU")))
	require.NoError(t, err)
	want.set(c, index.TierGPU, 0, 9, true)
	awaitHoldings(t, base, pods, want)
	for hd, p := range podsByHolder(t, base) {
		require.Equal(t, model, p.Model, hd.Pod)
		require.Zero(t, p.Counters["hash_mismatches"], "%s: --seed 0 --block-size 64 hashes as the guide's engines do", hd.Pod)
		require.Zero(t, p.Counters["chunked_offload"], hd.Pod)
	}

	// Every block-0 event was checked (A's GPU and CPU, B's, C's).
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Contains(t, string(metrics), "kvsource_events_hash_checks_total 4\n")
	require.Contains(t, string(metrics), "kvsource_events_hash_mismatches_total 0\n")

	code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": model, "tokens": tokens})
	require.Equal(t, http.StatusOK, code, "%s", body)
	var score struct {
		Pods []struct {
			Pod           string
			MatchedBlocks int `json:"matched_blocks"`
			Tiers         map[string]int
		}
	}
	require.NoError(t, json.Unmarshal(body, &score))
	require.Len(t, score.Pods, 3)
	for i, hd := range []index.Holder{a, c, b} {
		require.Equal(t, hd.Pod, score.Pods[i].Pod)
		require.Equal(t, want.run(hd, bothTiers, 0, n), score.Pods[i].MatchedBlocks)
		require.Equal(t, want.run(hd, []string{index.TierCPU}, 0, n), score.Pods[i].Tiers[index.TierCPU])
	}

	// The reference rule: the destination's prefix L in any tier; the best
	// gain is another holder's CPU run from L; a pull needs the gain, in
	// tokens, to reach --min-cached-token-delta.
	for _, dest := range []index.Holder{a, b, c} {
		l := want.run(dest, bothTiers, 0, n)
		best, src := 0, index.Holder{}
		for _, hd := range []index.Holder{a, b, c} {
			if g := want.run(hd, []string{index.TierCPU}, l, n); hd != dest && g > best {
				best, src = g, hd
			}
		}
		reason := "pull"
		switch {
		case l == n:
			reason = "local_hit"
		case best*bs < delta:
			reason = "below_threshold"
		}
		code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": model, "tokens": tokens,
			"destination": dest.Pod, "request_id": "r-" + dest.Pod})
		require.Equal(t, http.StatusOK, code, "%s", body)
		var pick struct {
			Reason        string
			Source        *string
			Cached        int      `json:"destination_cached_blocks"`
			SourceBlocks  int      `json:"source_blocks"`
			MissingBlocks []string `json:"missing_blocks"`
			BlockSize     int      `json:"block_size"`
		}
		require.NoError(t, json.Unmarshal(body, &pick))
		require.Equal(t, reason, pick.Reason, dest.Pod)
		require.Equal(t, l, pick.Cached, dest.Pod)
		require.Equal(t, bs, pick.BlockSize)
		if reason != "pull" {
			require.Nil(t, pick.Source, dest.Pod)
			continue
		}
		require.Equal(t, src.Pod, *pick.Source)
		require.Equal(t, best, pick.SourceBlocks)
		var missing []string
		for _, k := range keys[l : l+best] {
			missing = append(missing, fmt.Sprint(k))
		}
		require.Equal(t, missing, pick.MissingBlocks)
	}
	// The cases cover both sides of the threshold: B's gain is 36 blocks
	// (2,304 tokens), C's 31 (1,984).
	require.Equal(t, 36, want.run(a, []string{index.TierCPU}, 4, n))
	require.Equal(t, 31, want.run(a, []string{index.TierCPU}, 9, n))
	require.NotContains(t, logs.String(), "level=ERROR")
}

func TestServeEmptyTopicTakesTheModelFromTheFlag(t *testing.T) {
	const model = "Qwen/Qwen3-8B"
	tokens, keys := p2pGuideTokens()[:4*64], p2pGuideKeys[:4]
	// vLLM's default kv_events_config: topic "".
	pods, flags := startVLLMPods(t, "", "10.0.5.1:8000", "10.0.5.2:8000")
	flags[1] += ",model=" + model // the first pod gets its model from the flag; the second has none
	var logs syncLog
	base := startServeLogged(t, &logs, append(flags, "--block-size", "64", "--seed", "0")...)
	for _, p := range pods {
		_, err := p.Publish(vllmBatch(t, vllmStored(keys, tokens, 64, 0, 4, "GPU")))
		require.NoError(t, err)
	}
	a := index.Holder{Pod: "10.0.5.1:8000"}
	want := holdings{}
	want.set(a, index.TierGPU, 0, 4, true)
	awaitHoldings(t, base, pods, want)
	listed := podsByHolder(t, base)
	require.Len(t, listed, 1, "the pod without a model is not indexed under an empty one")
	require.Equal(t, model, listed[a].Model)
	require.Zero(t, listed[a].Counters["hash_mismatches"])

	code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": model, "tokens": tokens})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Contains(t, string(body), `"matched_blocks":4`)
	// The second pod's message travels on its own connection: it may come
	// after the first pod's is applied, or be lost before the service's
	// subscription reaches the pod (and a pod without a model is not
	// replayed), so the pod publishes until one is counted.
	require.Eventually(t, func() bool {
		_, metrics := call(t, "GET", base+"/metrics", nil)
		if regexp.MustCompile(`kvsource_events_no_model_total [1-9]`).Match(metrics) {
			return true
		}
		_, err := pods[1].Publish(vllmBatch(t, vllmStored(keys, tokens, 64, 0, 4, "GPU")))
		require.NoError(t, err)
		return false
	}, 10*time.Second, 20*time.Millisecond)
	require.Contains(t, logs.String(), "pod=10.0.5.2:8000")
	require.Contains(t, logs.String(), "model=MODEL")
}
