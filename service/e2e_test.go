package service

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// holdings is the reference model of the end-to-end test: which
// blocks (by position in the prompt) each holder holds in each tier.
type holdings map[index.Holder]map[string]map[int]bool

func (h holdings) set(hd index.Holder, tier string, from, to int, held bool) {
	if h[hd] == nil {
		h[hd] = map[string]map[int]bool{}
	}
	if h[hd][tier] == nil {
		h[hd][tier] = map[int]bool{}
	}
	for i := from; i < to; i++ {
		if held {
			h[hd][tier][i] = true
		} else {
			delete(h[hd][tier], i)
		}
	}
}

func (h holdings) holds(hd index.Holder, tiers []string, i int) bool {
	for _, t := range tiers {
		if h[hd][t][i] {
			return true
		}
	}
	return false
}

func (h holdings) run(hd index.Holder, tiers []string, from, n int) int {
	i := from
	for i < n && h.holds(hd, tiers, i) {
		i++
	}
	return i - from
}

var bothTiers = []string{index.TierGPU, index.TierCPU}

// score is the reference weighted score: each block of the any-tier prefix
// weighs 1.0 if GPU's own prefix covers it, else 0.8.
func (h holdings) score(hd index.Holder, n int) float64 {
	p, gpu := h.run(hd, bothTiers, 0, n), h.run(hd, []string{index.TierGPU}, 0, n)
	return float64(min(gpu, p)) + 0.8*float64(p-min(gpu, p))
}

// pyPublisher is one run of the shared vLLM publisher model.
type pyPublisher struct {
	args    []string
	batches []map[string]any
}

func (p pyPublisher) start(t *testing.T, ctx context.Context) *exec.Cmd {
	t.Helper()
	var in bytes.Buffer
	for _, b := range p.batches {
		line, err := json.Marshal(b)
		require.NoError(t, err)
		in.Write(append(line, '\n'))
	}
	script := testenv.Data(t, "interop", "vllm_publisher.py")
	cmd := exec.CommandContext(ctx, testenv.PythonPath, append([]string{script}, p.args...)...)
	cmd.Stdin = &in
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		if t.Failed() {
			t.Logf("publisher %v output:\n%s", p.args, out.String())
		}
	})
	return cmd
}

func pyStoredEvent(keys []uint64, tokens []uint32, from, to int, tier, lora string) map[string]any {
	var parent any
	if from > 0 {
		parent = keys[from-1]
	}
	return map[string]any{"type": "BlockStored", "block_hashes": keys[from:to], "parent_block_hash": parent,
		"token_ids": tokens[from*16 : to*16], "block_size": 16, "medium": tier, "lora_name": lora}
}

func TestServeEndToEndWithVLLMPublisher(t *testing.T) {
	testenv.Python(t)
	const model, lora = "org/llama-3@v1", "sql-adapter"
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 20*16+5)
	for i := range tokens {
		tokens[i] = uint32(1000 + i*31%5000)
	}
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens, LoRAName: lora})
	require.NoError(t, err)
	n := len(keys)
	require.Equal(t, 20, n)

	podA := index.Holder{Pod: "127.0.0.1:8001"}
	podB := index.Holder{Pod: "127.0.0.1:8002"}
	// Pod C runs two data-parallel ranks: separate caches, separate holders.
	podC := index.Holder{Pod: "127.0.0.1:8003", Rank: 1}
	podC0 := index.Holder{Pod: podC.Pod}
	want := holdings{}
	want.set(podA, index.TierGPU, 0, 6, true)
	want.set(podA, index.TierCPU, 0, 6, true)
	want.set(podB, index.TierGPU, 0, 20, true)
	want.set(podB, index.TierCPU, 0, 15, true)
	want.set(podB, index.TierGPU, 18, 20, false)
	want.set(podC, index.TierGPU, 0, 3, true)
	want.set(podC, index.TierCPU, 0, 12, true)
	want.set(podC0, index.TierCPU, 0, 4, true)

	// Every publisher has a replay endpoint, so that a first batch sent
	// before the service's subscription arrived is fetched, not lost. Pod
	// C's rank 1 replays on its rank-0 port plus one.
	portA, replayA, portB, replayB, bindPort := testenv.FreePort(t), testenv.FreePort(t), testenv.FreePort(t), testenv.FreePort(t), testenv.FreePort(t)
	replayC0, replayC := testenv.FreePortPair(t)
	_, base := startServe(t,
		"--events-bind", fmt.Sprintf("tcp://127.0.0.1:%d", bindPort),
		"--events-replay", fmt.Sprintf("%s=tcp://127.0.0.1:%d", podC.Pod, replayC0),
		"--events-connect", fmt.Sprintf("%s=tcp://127.0.0.1:%d,replay=tcp://127.0.0.1:%d", podA.Pod, portA, replayA),
		"--events-connect", fmt.Sprintf("%s=tcp://127.0.0.1:%d,replay=tcp://127.0.0.1:%d", podB.Pod, portB, replayB),
	)

	batch := func(rank int, evs ...map[string]any) map[string]any {
		return map[string]any{"events": evs, "dp_rank": rank, "ts": 1.5}
	}
	topic := func(pod string) string { return "kv@" + pod + "@" + model }
	// The publishers stay up (their linger) until the test kills them: a
	// holder is a pull source only while its engine's connection is.
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	pubs := []pyPublisher{
		// Pod A binds its PUB socket; the service connects (llm-d's pod
		// discovery mode).
		{[]string{"--endpoint", fmt.Sprintf("tcp://*:%d", portA), "--topic", topic(podA.Pod),
			"--replay", fmt.Sprintf("tcp://*:%d", replayA), "--warmup", "1", "--linger", "120"},
			[]map[string]any{
				batch(0, pyStoredEvent(keys, tokens, 0, 6, "GPU", lora)),
				batch(0, pyStoredEvent(keys, tokens, 0, 6, "CPU", lora)),
			}},
		// Pod B too, in the older array layout, and its offload batch is
		// lost live: the service must notice the gap and replay it.
		{[]string{"--endpoint", fmt.Sprintf("tcp://*:%d", portB), "--topic", topic(podB.Pod), "--layout", "array",
			"--replay", fmt.Sprintf("tcp://*:%d", replayB), "--drop-seq", "1", "--warmup", "1", "--linger", "120"},
			[]map[string]any{
				batch(0, pyStoredEvent(keys, tokens, 0, 20, "GPU", lora)),
				batch(0, pyStoredEvent(keys, tokens, 0, 15, "CPU", lora)),
				batch(0, map[string]any{"type": "BlockRemoved", "block_hashes": keys[18:20], "medium": "GPU"}),
			}},
		// Pod C (data-parallel rank 1) connects to the service's bind socket.
		{[]string{"--endpoint", fmt.Sprintf("tcp://127.0.0.1:%d", bindPort), "--topic", topic(podC.Pod),
			"--replay", fmt.Sprintf("tcp://*:%d", replayC), "--warmup", "1", "--linger", "120"},
			[]map[string]any{
				batch(1, pyStoredEvent(keys, tokens, 0, 3, "GPU", lora)),
				batch(1, pyStoredEvent(keys, tokens, 0, 3, "CPU", lora), pyStoredEvent(keys, tokens, 3, 12, "CPU", lora)),
			}},
		// Pod C's rank 0, its own engine process and event stream.
		{[]string{"--endpoint", fmt.Sprintf("tcp://127.0.0.1:%d", bindPort), "--topic", topic(podC.Pod),
			"--replay", fmt.Sprintf("tcp://*:%d", replayC0), "--warmup", "1", "--linger", "120"},
			[]map[string]any{
				batch(0, pyStoredEvent(keys, tokens, 0, 4, "CPU", lora)),
			}},
	}
	var cmds []*exec.Cmd
	for _, p := range pubs {
		cmds = append(cmds, p.start(t, ctx))
	}

	// Wait until every holder's blocks match the reference.
	var pods []Pod
	require.Eventually(t, func() bool {
		code, body := call(t, "GET", base+"/v1/pods", nil)
		var resp struct{ Pods []Pod }
		if code != http.StatusOK || json.Unmarshal(body, &resp) != nil || len(resp.Pods) != 4 {
			return false
		}
		for _, p := range resp.Pods {
			hd := index.Holder{Pod: p.Pod, Rank: p.DPRank}
			if p.Blocks[index.TierGPU] != len(want[hd][index.TierGPU]) || p.Blocks[index.TierCPU] != len(want[hd][index.TierCPU]) {
				return false
			}
		}
		pods = resp.Pods
		return true
	}, 15*time.Second, 50*time.Millisecond, "index never matched the published events")
	for _, p := range pods {
		require.Equal(t, model, p.Model)
		require.Equal(t, "live", p.State, p.Pod)
		require.Zero(t, p.Counters["decode_errors"], p.Pod)
		require.Zero(t, p.Counters["hash_mismatches"], p.Pod, "the service hashes as the engines do")
		require.Equal(t, slices.Sorted(maps.Keys(zeroHolderCounters())), slices.Sorted(maps.Keys(p.Counters)),
			"every per-holder counter of events.Counters, and only those")
	}
	var listed []index.Holder
	var seqs []uint64
	for _, p := range pods {
		listed = append(listed, index.Holder{Pod: p.Pod, Rank: p.DPRank})
		seqs = append(seqs, p.LastSeq)
	}
	require.Equal(t, []index.Holder{podA, podB, podC0, podC}, listed)
	require.Equal(t, []uint64{1, 2, 0, 1}, seqs)
	require.Equal(t, uint64(1), pods[1].Counters["gaps"])
	require.GreaterOrEqual(t, pods[1].Counters["replays"], uint64(1))

	// Scores, against the reference.
	code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": model, "tokens": tokens, "lora_name": lora})
	require.Equal(t, http.StatusOK, code, "%s", body)
	var score ScoreResponse
	require.NoError(t, json.Unmarshal(body, &score))
	require.Equal(t, model, score.Model)
	require.Equal(t, n, score.Blocks)
	holders := []index.Holder{podA, podB, podC, podC0}
	slices.SortFunc(holders, func(a, b index.Holder) int {
		return int(1000*want.score(b, n)) - int(1000*want.score(a, n))
	})
	require.Len(t, score.Pods, 4)
	for i, hd := range holders {
		got := score.Pods[i]
		require.Equal(t, hd, index.Holder{Pod: got.Pod, Rank: got.DPRank}, "rank %d", i)
		require.Equal(t, want.run(hd, bothTiers, 0, n), got.MatchedBlocks)
		require.Equal(t, want.run(hd, []string{"GPU"}, 0, n), got.Tiers["GPU"])
		require.Equal(t, want.run(hd, []string{"CPU"}, 0, n), got.Tiers["CPU"])
		require.InDelta(t, want.score(hd, n), got.Score, 1e-9)
	}
	// Without the LoRA the prompt hashes differently: nobody matches.
	_, body = call(t, "POST", base+"/v1/score", map[string]any{"model": model, "tokens": tokens, "pods": []string{podA.Pod}})
	require.NoError(t, json.Unmarshal(body, &score))
	require.Equal(t, []PodScore{{Pod: podA.Pod, Tiers: map[string]int{"GPU": 0, "CPU": 0}}}, score.Pods)

	// Picks, against the reference decision.
	pick := func(req map[string]any) PickResponse {
		t.Helper()
		req["model"], req["lora_name"] = model, lora
		if req["tokens"] == nil {
			req["tokens"] = tokens
		}
		code, body := call(t, "POST", base+"/v1/pick", req)
		require.Equal(t, http.StatusOK, code, "%s", body)
		var resp PickResponse
		require.NoError(t, json.Unmarshal(body, &resp), "%s", body)
		return resp
	}
	// expect is the rule, computed from the reference holdings
	// alone. The holders are those of the reference, narrowed to the
	// request's candidates when it names any: a candidate with dp_rank is
	// that holder, one without stands for every rank of its pod (ranks are
	// separate holders). The destination's L is its consecutive prefix in
	// any tier; every other holder's gain is its consecutive run in the
	// pullable tier (CPU) from block L on; the decision pulls when the best
	// gain, in tokens, reaches the threshold (the request's, else the flag's
	// default of 1), and the source is a holder whose gain is within one
	// block of the best.
	expect := func(req map[string]any, dest index.Holder) (reason string, l, best int, band []index.Holder) {
		threshold := 1
		if v, ok := req["min_cached_token_delta"]; ok {
			threshold = v.(int)
		}
		var holders []index.Holder
		for hd := range want {
			holders = append(holders, hd)
		}
		if cands, ok := req["candidates"].([]map[string]any); ok {
			holders = nil
			for _, c := range cands {
				if r, ok := c["dp_rank"]; ok {
					holders = append(holders, index.Holder{Pod: c["pod"].(string), Rank: r.(int)})
					continue
				}
				for hd := range want {
					if hd.Pod == c["pod"] {
						holders = append(holders, hd)
					}
				}
			}
		}
		l = want.run(dest, bothTiers, 0, n)
		if l == n {
			return "local_hit", l, 0, nil
		}
		gains := map[index.Holder]int{}
		for _, hd := range holders {
			if hd != dest {
				gains[hd] = want.run(hd, []string{index.TierCPU}, l, n)
				best = max(best, gains[hd])
			}
		}
		switch {
		case best == 0 && l == 0:
			return "no_holder", l, 0, nil
		case best == 0:
			return "self", l, 0, nil
		case best*16 < threshold:
			return "below_threshold", l, best, nil
		}
		for hd, g := range gains {
			if g >= best-1 {
				band = append(band, hd)
			}
		}
		return "pull", l, best, band
	}
	newcomer := index.Holder{Pod: "127.0.0.1:8009"}
	cases := []struct {
		name string
		req  map[string]any
		dest index.Holder
		// source, when set, is the only holder the rule allows.
		source *index.Holder
	}{
		{"locality broken: pull from the longest CPU run", map[string]any{"request_id": "req-1", "destination": podA.Pod}, podA, &podB},
		{"destination with the longest prefix", map[string]any{"request_id": "req-2", "destination": podB.Pod}, podB, nil},
		{"candidate without rank stands for its ranks", map[string]any{"request_id": "req-3", "destination": newcomer.Pod,
			"candidates": []map[string]any{{"pod": podC.Pod, "waiting": 3}}}, newcomer, &podC},
		{"gain below the request's threshold", map[string]any{"request_id": "req-4", "destination": podA.Pod, "min_cached_token_delta": 1000}, podA, nil},
		{"rank given explicitly", map[string]any{"request_id": "req-5", "destination": podA.Pod,
			"candidates": []map[string]any{{"pod": podC.Pod, "dp_rank": 1}, {"pod": podB.Pod, "dp_rank": 0, "waiting": 10}}}, podA, &podB},
		{"another rank of the destination's pod is a source", map[string]any{"request_id": "req-6", "destination": podC0.Pod,
			"candidates": []map[string]any{{"pod": podC.Pod}}}, podC0, &podC},
		{"destination rank 1 gets nothing from rank 0's shorter run", map[string]any{"request_id": "req-7", "destination": podC.Pod,
			"destination_dp_rank": 1, "candidates": []map[string]any{{"pod": podC.Pod, "dp_rank": 0}}}, podC, nil},
		{"rank 0 alone as candidate", map[string]any{"request_id": "req-8", "destination": newcomer.Pod,
			"candidates": []map[string]any{{"pod": podC.Pod, "dp_rank": 0}}}, newcomer, &podC0},
	}
	reasons := map[string]int{}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := pick(tc.req)
			reason, l, best, band := expect(tc.req, tc.dest)
			reasons[reason]++
			require.Equal(t, reason, string(got.Reason))
			require.Equal(t, tc.dest, index.Holder{Pod: got.Destination, Rank: got.DestinationDPRank})
			require.Equal(t, l, got.DestinationCachedBlocks)
			require.Equal(t, n, got.Blocks)
			require.Equal(t, 16, got.BlockSize)
			if reason != "pull" {
				require.Nil(t, got.Source)
				require.Empty(t, got.Header)
				require.Empty(t, got.MissingBlocks)
				require.Nil(t, got.KVTransferParams.RemoteKVSource)
				require.Equal(t, n-l, got.RecomputeBlocks)
				require.Equal(t, best, got.BestSourceBlocks)
				return
			}
			require.NotNil(t, got.Source)
			src := index.Holder{Pod: *got.Source, Rank: *got.SourceDPRank}
			require.Contains(t, band, src)
			if tc.source != nil {
				require.Equal(t, []index.Holder{*tc.source}, band, "the case's premise")
			}
			g := want.run(src, []string{"CPU"}, l, n)
			require.Equal(t, g, got.SourceBlocks)
			require.Equal(t, n-l-g, got.RecomputeBlocks)
			var missing []string
			for _, k := range keys[l : l+g] {
				missing = append(missing, strconv.FormatUint(k, 10))
			}
			require.Equal(t, missing, got.MissingBlocks)
			// llm-d's sidecar reads the source's rank from the header's
			// port: rank r is the pod's port plus r.
			host, port, ok := strings.Cut(src.Pod, ":")
			require.True(t, ok)
			p, err := strconv.Atoi(port)
			require.NoError(t, err)
			require.Equal(t, map[string]string{"x-kv-cache-source-host-port": host + ":" + strconv.Itoa(p+src.Rank)}, got.Header)
			rks := got.KVTransferParams.RemoteKVSource
			require.NotNil(t, rks)
			require.Equal(t, strings.Split(src.Pod, ":")[0], rks.RemoteHost)
			require.Equal(t, 5710+src.Rank, rks.RemotePort)
			require.Equal(t, tc.req["request_id"], rks.KVRequestID)
		})
	}
	require.Equal(t, map[string]int{"pull": 5, "self": 2, "below_threshold": 1}, reasons, "the cases cover these reasons")

	// Pulls count against their source until done: req-1 and req-5 went
	// to pod B, req-3 and req-6 to pod C's rank 1, req-8 to its rank 0.
	inflight := func() map[index.Holder]int {
		var resp struct{ Pods []Pod }
		_, body := call(t, "GET", base+"/v1/pods", nil)
		require.NoError(t, json.Unmarshal(body, &resp))
		m := map[index.Holder]int{}
		for _, p := range resp.Pods {
			m[index.Holder{Pod: p.Pod, Rank: p.DPRank}] = p.InflightPulls
		}
		return m
	}
	require.Equal(t, map[index.Holder]int{podA: 0, podB: 2, podC: 2, podC0: 1}, inflight())
	for _, want := range []bool{true, false} {
		code, body := call(t, "POST", base+"/v1/done", map[string]any{"request_id": "req-1"})
		require.Equal(t, http.StatusOK, code)
		require.JSONEq(t, fmt.Sprintf(`{"released":%v}`, want), string(body))
	}
	require.Equal(t, map[index.Holder]int{podA: 0, podB: 1, podC: 2, podC0: 1}, inflight())

	short := pick(map[string]any{"destination": podA.Pod, "tokens": tokens[:10]})
	require.Equal(t, "no_holder", string(short.Reason))

	_, metrics := call(t, "GET", base+"/metrics", nil)
	for _, line := range []string{
		`kvsource_pick_decisions_total{reason="pull"} 5`,
		`kvsource_pick_decisions_total{reason="self"} 2`,
		`kvsource_pick_decisions_total{reason="below_threshold"} 1`,
		`kvsource_pick_decisions_total{reason="no_holder"} 1`,
		`kvsource_events_gaps_total 1`,
		`kvsource_events_hash_mismatches_total 0`,
		`kvsource_events_decode_errors_total 0`,
		`kvsource_index_holders 4`,
		`kvsource_http_requests_total{code="200",path="/v1/pick"} 9`,
	} {
		require.Contains(t, string(metrics), line+"\n")
	}
	// kill -9 of the engines: their holders leave the pull sources within
	// 5 s, disconnected, their entries kept for scoring.
	for _, c := range cmds {
		require.NoError(t, c.Process.Signal(syscall.Signal(0)), "a publisher exited before the test killed it")
		require.NoError(t, c.Process.Kill())
		require.ErrorContains(t, c.Wait(), "signal: killed")
	}
	killed := time.Now()
	require.Eventually(t, func() bool {
		_, metrics := call(t, "GET", base+"/metrics", nil)
		return strings.Contains(string(metrics), `kvsource_holders{state="disconnected"} 4`+"\n")
	}, 5*time.Second, 20*time.Millisecond, "killed engines still listed as connected")
	t.Logf("all four holders disconnected %v after the kill", time.Since(killed).Round(time.Millisecond))
	after := pick(map[string]any{"request_id": "req-9", "destination": podA.Pod})
	require.Equal(t, "no_live_source", string(after.Reason))
	require.Nil(t, after.Source)
	require.Equal(t, "disconnected", after.SkippedState)
	require.Equal(t, 2, after.SkippedSources, "pod B and pod C's rank 1 extend pod A's prefix")
	require.Zero(t, after.BestSourceBlocks, "best counts live sources only")
}
