package calibrate

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// simCost is a simulated engine's cost model, in ms for t tokens: a
// prefill is a quadratic in t, a pull a floor plus a per-token term, and the
// first pull from a peer pays a session set-up on top.
type simCost struct {
	A, B, C      float64 // recompute: A + B·k + C·k², k = t/1000
	Floor, PerK  float64 // pull: Floor + PerK·k
	SessionSetup float64
}

func (c simCost) recompute(t int) time.Duration {
	k := float64(t) / 1e3
	return time.Duration((c.A + c.B*k + c.C*k*k) * float64(time.Millisecond))
}

func (c simCost) pull(t int) time.Duration {
	return time.Duration((c.Floor + c.PerK*float64(t)/1e3) * float64(time.Millisecond))
}

// simNet stands in for the P2P network (P2P address to pod) and keeps
// the pods' virtual clock: a request advances it by what the cost model
// charges before it answers, so the probes measure the model exactly,
// whatever the load on the machine running the test.
type simNet struct {
	mu   sync.Mutex
	pods map[string]*simPod
	t    time.Time
}

func (n *simNet) now() time.Time {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.t
}

func (n *simNet) advance(d time.Duration) {
	n.mu.Lock()
	n.t = n.t.Add(d)
	n.mu.Unlock()
}

// simPod speaks the subset of vLLM's OpenAI-compatible API and metrics
// calibrate needs: streaming /v1/completions of token-id prompts with
// cache_salt and kv_transfer_params.remote_kv_source (the shape vLLM's P2P
// tier parses, strictly), and /metrics with the external prefix-cache hit
// counter. A pull succeeds when the named P2P address is a pod holding the
// prompt in its CPU tier; it counts the pulled tokens as external hits.
type simPod struct {
	net       *simNet
	model     string
	blockSize int
	cost      simCost
	p2p       string
	// ignoreSource makes the pod recompute whatever kv_transfer_params say
	// (a consumer without the P2P tier); failCompletions makes it answer
	// every completion with 503.
	ignoreSource    bool
	failCompletions bool
	// noOffload makes the pod keep nothing in its CPU tier (its offload
	// counter stays still); hideOffload drops the counter from /metrics
	// (an engine without it: calibrate falls back to --settle).
	noOffload   bool
	hideOffload bool

	mu       sync.Mutex
	cached   map[uint64]bool
	sessions map[string]bool
	extHits  int
	offBytes int
	srv      *httptest.Server
}

func newCalibSimPod(t *testing.T, n *simNet, cost simCost) *simPod {
	t.Helper()
	p := &simPod{net: n, model: "sim-model", blockSize: 16, cost: cost, cached: map[uint64]bool{}, sessions: map[string]bool{}}
	p.srv = httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(p.srv.Close)
	// The P2P address is a port of its own, as vLLM's side channel is.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p.p2p = l.Addr().String()
	require.NoError(t, l.Close())
	n.mu.Lock()
	if n.pods == nil {
		n.pods = map[string]*simPod{}
	}
	n.pods[p.p2p] = p
	n.mu.Unlock()
	return p
}

type simSource struct {
	KVRequestID *string `json:"kv_request_id"`
	RemoteHost  *string `json:"remote_host"`
	RemotePort  *int    `json:"remote_port"`
}

type simRequest struct {
	Model            string   `json:"model"`
	Prompt           []uint32 `json:"prompt"`
	MaxTokens        int      `json:"max_tokens"`
	Stream           bool     `json:"stream"`
	CacheSalt        string   `json:"cache_salt"`
	KVTransferParams *struct {
		RemoteKVSource *simSource `json:"remote_kv_source"`
	} `json:"kv_transfer_params"`
}

func promptKey(salt string, prompt []uint32) uint64 {
	h := fnv.New64a()
	h.Write([]byte(salt))
	for _, t := range prompt {
		h.Write([]byte{byte(t), byte(t >> 8), byte(t >> 16), byte(t >> 24)})
	}
	return h.Sum64()
}

func (p *simPod) serve(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/v1/models":
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, p.model)
		return
	case "/metrics":
		p.mu.Lock()
		hits, off := p.extHits, p.offBytes
		p.mu.Unlock()
		if !p.hideOffload {
			fmt.Fprintf(w, "vllm:kv_offload_total_bytes_total{engine=\"0\",transfer_type=\"CPU_to_GPU\"} 7\n")
			fmt.Fprintf(w, "vllm:kv_offload_total_bytes_total{engine=\"0\",transfer_type=\"GPU_to_CPU\"} %d\n", off)
		}
		fmt.Fprintf(w, "# HELP vllm:external_prefix_cache_hits_total External prefix cache hits.\n# TYPE vllm:external_prefix_cache_hits_total counter\n")
		fmt.Fprintf(w, "vllm:external_prefix_cache_hits_total{engine=\"0\",model_name=%q} %d\n", p.model, hits)
		fmt.Fprintf(w, "vllm:num_requests_waiting{engine=\"0\",model_name=%q} 0\n", p.model)
		return
	case "/v1/completions":
	default:
		http.NotFound(w, r)
		return
	}
	if p.failCompletions {
		http.Error(w, `{"error":"engine unavailable"}`, http.StatusServiceUnavailable)
		return
	}
	var req simRequest
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if req.Model != p.model || !req.Stream || req.MaxTokens != 1 || len(req.Prompt) == 0 {
		http.Error(w, `{"error":"bad request"}`, http.StatusBadRequest)
		return
	}
	var src *simPod
	if kv := req.KVTransferParams; kv != nil && kv.RemoteKVSource != nil {
		s := kv.RemoteKVSource
		if s.KVRequestID == nil || *s.KVRequestID == "" || s.RemoteHost == nil || s.RemotePort == nil {
			http.Error(w, "remote_kv_source needs kv_request_id, remote_host and remote_port", http.StatusBadRequest)
			return
		}
		p.net.mu.Lock()
		src = p.net.pods[net.JoinHostPort(*s.RemoteHost, strconv.Itoa(*s.RemotePort))]
		p.net.mu.Unlock()
	}
	key := promptKey(req.CacheSalt, req.Prompt)
	// vLLM computes a prompt's last token itself: the blocks before it can
	// come from a cache.
	cacheable := (len(req.Prompt) - 1) / p.blockSize * p.blockSize
	wait := p.cost.recompute(len(req.Prompt))
	p.mu.Lock()
	local := p.cached[key]
	p.mu.Unlock()
	switch {
	case local:
		wait = p.cost.recompute(len(req.Prompt) - cacheable)
	case src != nil && !p.ignoreSource && src.holds(key):
		wait = p.cost.pull(cacheable) + p.cost.recompute(len(req.Prompt)-cacheable)
		p.mu.Lock()
		if !p.sessions[src.p2p] {
			p.sessions[src.p2p] = true
			wait += time.Duration(p.cost.SessionSetup * float64(time.Millisecond))
		}
		p.extHits += cacheable
		p.mu.Unlock()
	}
	p.net.advance(wait)
	if !p.noOffload {
		p.mu.Lock()
		p.cached[key] = true
		p.offBytes += len(req.Prompt) / p.blockSize * 1024
		p.mu.Unlock()
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprintf(w, "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"x\",\"finish_reason\":null}]}\n\n")
	w.(http.Flusher).Flush()
	fmt.Fprintf(w, "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n")
	fmt.Fprintf(w, "data: [DONE]\n\n")
}

func (p *simPod) holds(key uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cached[key]
}

// The cost model: pulls have a 36 ms floor and are cheap per token, prefills
// grow quadratically. A pulled prompt still computes its last token, which
// pays the prefill's 6 ms floor, so the probes measure a pull as
// 42 + 1.5·k ms and a recompute as 6 + 2.4·k + 0.36·k² ms (k thousand
// tokens): they cross at testCrossover tokens.
var testCost = simCost{A: 6, B: 2.4, C: 0.36, Floor: 36, PerK: 1.5, SessionSetup: 80}

// testCrossover solves 0.36·k² + 0.9·k - 36 = 0 for tokens.
var testCrossover = 1e3 * (-0.9 + math.Sqrt(0.81+4*0.36*36)) / (2 * 0.36)

func pair(t *testing.T) (consumer, source *simPod) {
	n := &simNet{t: time.Unix(1_700_000_000, 0)}
	return newCalibSimPod(t, n, testCost), newCalibSimPod(t, n, testCost)
}

func args(consumer, source *simPod, extra ...string) []string {
	return append([]string{
		"--consumer", consumer.srv.URL, "--source", source.srv.URL, "--source-p2p", source.p2p,
		"--model", "sim-model", "--lengths", "1024,4096,8192,16384", "--repeats", "2",
		"--settle", "0", "--progress", "never", "--prompt-seed", "7",
	}, extra...)
}

// parseFlags is ParseFlags on a flag set of its own writing to w.
func parseFlags(args []string, w io.Writer) (Config, error) {
	fs := flag.NewFlagSet("kvsource calibrate", flag.ContinueOnError)
	fs.SetOutput(w)
	return ParseFlags(fs, args)
}

// runCalibrateTest runs calibrate with args, timed by the consumer's
// virtual clock when there is one.
func runCalibrateTest(t *testing.T, args []string, consumer *simPod) (Config, string, error) {
	t.Helper()
	cfg, err := parseFlags(args, io.Discard)
	require.NoError(t, err)
	if consumer != nil {
		cfg.now = consumer.net.now
	}
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = Run(ctx, cfg, &out, &errOut)
	return cfg, out.String(), err
}

func TestCalibrateAgainstSimulatedPodsFindsTheCrossoverAndWritesServesCalibration(t *testing.T) {
	consumer, source := pair(t)
	file := filepath.Join(t.TempDir(), "calibration.json")
	_, out, err := runCalibrateTest(t, args(consumer, source, "--json", "--calibration", file), consumer)
	require.NoError(t, err)
	var rep Report
	require.NoError(t, json.Unmarshal([]byte(out), &rep))

	require.Len(t, rep.Rows, 4)
	require.Len(t, rep.Probes, 4*3*2, "three probes per length and arm")
	for _, row := range rep.Rows {
		require.Equal(t, (row.Tokens-1)/16*16, row.MovedTokens, "every pull moved the blocks before the last token (%d tokens)", row.Tokens)
	}
	require.InDelta(t, testCost.SessionSetup, rep.Rows[0].ColdPull-rep.Rows[0].PullMillis, 0.01, "the first pull pays the session set-up and is left out of the fit")
	long := rep.Rows[3]
	require.Less(t, long.PullMillis, long.RecomputeMillis, "at 16K the pull wins")
	require.Greater(t, rep.Rows[0].PullMillis, rep.Rows[0].RecomputeMillis, "at 1K recomputing wins")
	require.NotNil(t, rep.CrossoverTokens)
	// The pull covers the blocks before the last token, not quite all of
	// them: a few tokens off the analytic figure.
	require.InDelta(t, testCrossover, *rep.CrossoverTokens, 10, "the fit recovers the pods' crossover")
	require.NotNil(t, rep.MinCachedTokenDelta)
	require.GreaterOrEqual(t, float64(*rep.MinCachedTokenDelta), *rep.CrossoverTokens, "the margin asks for more than a tie")

	cal, err := Load(file)
	require.NoError(t, err, "serve reads what calibrate writes")
	require.Equal(t, *rep.MinCachedTokenDelta, cal.Threshold, "serve refits the same samples to the same threshold")
}

func TestCalibrateWithoutTheSourcesOffloadCounterSettlesInstead(t *testing.T) {
	consumer, source := pair(t)
	source.hideOffload = true
	_, out, err := runCalibrateTest(t, args(consumer, source, "--json", "--calibration", "", "--repeats", "1", "--settle", "1ms"), consumer)
	require.NoError(t, err)
	var rep Report
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.Len(t, rep.Rows, 4)
	require.Equal(t, 1008, rep.Rows[0].MovedTokens)
}

func TestCalibratePrintsTheTableCrossoverAndRecommendation(t *testing.T) {
	consumer, source := pair(t)
	_, out, err := runCalibrateTest(t, args(consumer, source, "--calibration", "", "--repeats", "1"), consumer)
	require.NoError(t, err)
	t.Log("\n" + out)
	for _, want := range []string{"tokens", "recompute", "cold pull", "crossover: pulling is faster from", "recommended: --min-cached-token-delta"} {
		require.Contains(t, out, want)
	}
	require.NotContains(t, out, "calibration written")
	for _, n := range []int{1024, 4096, 8192, 16384} {
		require.Contains(t, out, fmt.Sprintf("\n%8d  ", n), "a row for %d tokens", n)
	}
}

func TestCalibrateFailsClearly(t *testing.T) {
	closed := func() string {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		addr := l.Addr().String()
		require.NoError(t, l.Close())
		return "http://" + addr
	}
	t.Run("an unreachable consumer is reported before any probe", func(t *testing.T) {
		_, source := pair(t)
		url := closed()
		args := []string{"--consumer", url, "--source", source.srv.URL, "--model", "sim-model", "--progress", "never", "--calibration", ""}
		_, _, err := runCalibrateTest(t, args, nil)
		require.ErrorContains(t, err, url)
		require.ErrorContains(t, err, "connection refused")
	})
	t.Run("an unreachable source is reported before any probe", func(t *testing.T) {
		consumer, _ := pair(t)
		url := closed()
		args := []string{"--consumer", consumer.srv.URL, "--source", url, "--model", "sim-model", "--progress", "never", "--calibration", ""}
		_, _, err := runCalibrateTest(t, args, nil)
		require.ErrorContains(t, err, url)
		require.ErrorContains(t, err, "connection refused")
	})
	t.Run("a model the pods do not serve is reported before any probe", func(t *testing.T) {
		consumer, source := pair(t)
		args := args(consumer, source, "--calibration", "")
		args = append(args, "--model", "other-model")
		_, _, err := runCalibrateTest(t, args, consumer)
		require.ErrorContains(t, err, `does not serve model "other-model" (it serves ["sim-model"])`)
	})
	t.Run("a source whose engine fails is reported at the seed", func(t *testing.T) {
		consumer, source := pair(t)
		source.failCompletions = true
		_, _, err := runCalibrateTest(t, args(consumer, source, "--calibration", ""), consumer)
		require.ErrorContains(t, err, "seeding 1024 tokens")
		require.ErrorContains(t, err, "HTTP 503")
	})
	t.Run("a counter that does not move is a pull not verified", func(t *testing.T) {
		consumer, source := pair(t)
		consumer.ignoreSource = true
		_, _, err := runCalibrateTest(t, args(consumer, source, "--verify-timeout", "200ms", "--calibration", ""), consumer)
		require.ErrorIs(t, err, ErrNotVerified)
		require.ErrorContains(t, err, "vllm:external_prefix_cache_hits rose by 0 tokens")
	})
	t.Run("a wrong P2P address is a pull not verified", func(t *testing.T) {
		consumer, source := pair(t)
		args := args(consumer, source, "--verify-timeout", "200ms", "--calibration", "")
		args = append(args, "--source-p2p", "127.0.0.1:1")
		_, _, err := runCalibrateTest(t, args, consumer)
		require.ErrorIs(t, err, ErrNotVerified)
	})
	t.Run("a source that does not offload its seed says so", func(t *testing.T) {
		consumer, source := pair(t)
		source.noOffload = true
		_, _, err := runCalibrateTest(t, args(consumer, source, "--verify-timeout", "200ms", "--calibration", ""), consumer)
		require.ErrorIs(t, err, ErrNotOffloaded)
		require.ErrorContains(t, err, `vllm:kv_offload_total_bytes{transfer_type="gpu_to_cpu"} did not rise`)
	})
	t.Run("a consumer without the counter says so", func(t *testing.T) {
		_, source := pair(t)
		bare := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/models" {
				fmt.Fprint(w, `{"data":[{"id":"sim-model"}]}`)
				return
			}
			fmt.Fprintln(w, "vllm:num_requests_waiting 0")
		}))
		defer bare.Close()
		args := []string{"--consumer", bare.URL, "--source", source.srv.URL, "--model", "sim-model", "--progress", "never", "--calibration", ""}
		_, _, err := runCalibrateTest(t, args, nil)
		require.ErrorContains(t, err, "no vllm:external_prefix_cache_hits")
	})
}

func TestCalibrateFlags(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"missing consumer", []string{"--source", "http://h:1", "--model", "m"}, "required"},
		{"two lengths", []string{"--consumer", "http://h:1", "--source", "http://h:2", "--model", "m", "--lengths", "2048,4096,2048"}, "at least 3 distinct"},
		{"not a URL", []string{"--consumer", "h:1", "--source", "http://h:2", "--model", "m"}, "not an http(s) URL"},
		{"bad P2P address", []string{"--consumer", "http://h:1", "--source", "http://h:2", "--model", "m", "--source-p2p", "h"}, "--source-p2p"},
		{"margin out of range", []string{"--consumer", "http://h:1", "--source", "http://h:2", "--model", "m", "--margin", "1"}, "--margin"},
		{"a length under two blocks", []string{"--consumer", "http://h:1", "--source", "http://h:2", "--model", "m", "--lengths", "16,4096,8192"}, "under two blocks"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseFlags(tc.args, io.Discard)
			require.ErrorContains(t, err, tc.want)
		})
	}
	cfg, err := parseFlags([]string{"--consumer", "http://10.0.0.1:8000/", "--source", "http://10.0.0.2:8000", "--model", "m"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, "http://10.0.0.1:8000/metrics", cfg.ConsumerMetrics)
	require.Equal(t, "10.0.0.2:5710", cfg.SourceP2P, "vLLM's default P2P port on the source's host")
}

func TestCalibSumMetricSumsSeriesAndPrefersTotal(t *testing.T) {
	text := `# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 32
vllm:external_prefix_cache_hits_total{engine="1",model_name="m, {x}"} 16 1700000000
vllm:external_prefix_cache_hits_created{engine="0"} 1.7e9
vllm:external_prefix_cache_hits 5
`
	v, ok, err := sumMetric(strings.NewReader(text), hitMetrics, "")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 48.0, v)
	v, ok, err = sumMetric(strings.NewReader(text), hitMetrics, `engine="1"`)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 16.0, v, "only the series with the label")
	_, ok, err = sumMetric(strings.NewReader("other 1\n"), hitMetrics, "")
	require.NoError(t, err)
	require.False(t, ok)
	_, _, err = sumMetric(strings.NewReader("vllm:external_prefix_cache_hits_total{engine=\"0\"} x\n"), hitMetrics, "")
	require.Error(t, err)
}

func TestCalibrateProgressBarIsDrawnOnlyWhenOnAndCleared(t *testing.T) {
	var buf bytes.Buffer
	off := newProgress(&buf, 4, false)
	off.add()
	off.finish()
	require.Empty(t, buf.String())

	on := newProgress(&buf, 4, true)
	on.add()
	on.add()
	require.Contains(t, buf.String(), "2/4 probe pairs")
	on.finish()
	require.True(t, strings.HasSuffix(buf.String(), "\r"+strings.Repeat(" ", 72)+"\r"), "the bar is cleared")
}

func TestCalibReadStreamTimesTheFirstChoice(t *testing.T) {
	clock := time.Duration(0)
	elapsed := func() time.Duration { clock += time.Millisecond; return clock }
	cases := []struct {
		name, stream string
		want         time.Duration
		err          string
	}{
		{"first choice", ": ping\n\ndata: {\"choices\":[]}\n\ndata: {\"choices\":[{\"text\":\"a\"}],\"error\":null}\n\ndata: {\"choices\":[{\"text\":\"\"}]}\n\ndata: [DONE]\n\n", time.Millisecond, ""},
		{"no token", "data: {\"choices\":[]}\n\ndata: [DONE]\n\n", 0, "without a token"},
		{"no end", "data: {\"choices\":[{\"text\":\"a\"}]}\n\n", 0, "without [DONE]"},
		{"engine error", "data: {\"error\":{\"message\":\"boom\"}}\n\n", 0, "stream error"},
		{"not JSON", "data: {\n\n", 0, "bad event"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			clock = 0
			got, err := readStream(strings.NewReader(tc.stream), elapsed)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func FuzzParsers(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n"))
	f.Add([]byte("vllm:external_prefix_cache_hits_total{engine=\"0\",x=\"}\"} 12 17\n# HELP x\n"))
	f.Add([]byte("vllm:kv_offload_total_bytes_total{transfer_type=\"GPU_to_CPU\"} 1e3\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if d, err := readStream(bytes.NewReader(data), func() time.Duration { return time.Second }); err == nil {
			require.Equal(t, time.Second, d, "a token was seen")
		}
		for _, label := range []string{"", offloadLabel} {
			if _, _, err := sumMetric(bytes.NewReader(data), offloadMetrics, label); err != nil {
				require.NotEmpty(t, err.Error())
			}
		}
		_, _, _ = sumMetric(bytes.NewReader(data), hitMetrics, "")
	})
}
