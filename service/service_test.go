package service

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
	"github.com/kvsource/kvsource/picker"
)

// startServe runs the service in-process on 127.0.0.1:0 until the test ends
// and returns it with its base URL.
func startServe(t *testing.T, args ...string) (*Service, string) {
	t.Helper()
	return startServeWith(t, slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})), args...)
}

// startServeWith is startServe logging to log.
func startServeWith(t *testing.T, log *slog.Logger, args ...string) (*Service, string) {
	t.Helper()
	cfg, err := parseFlags(append([]string{"--http", "127.0.0.1:0"}, args...), io.Discard)
	require.NoError(t, err)
	s, err := newWithLogger(context.Background(), cfg, log)
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, s.Shutdown(ctx))
	})
	return s, listen(t, s)
}

// parseFlags is ParseFlags on a flag set of its own writing to w.
func parseFlags(args []string, w io.Writer) (Config, error) {
	fs := flag.NewFlagSet("kvsource serve", flag.ContinueOnError)
	fs.SetOutput(w)
	return ParseFlags(fs, args)
}

// newWithLogger is New logging to log.
func newWithLogger(ctx context.Context, cfg Config, log *slog.Logger) (*Service, error) {
	cfg.Logger = log
	return New(ctx, cfg)
}

// listen serves s on 127.0.0.1:0 until it shuts down and returns its base
// URL.
func listen(tb testing.TB, s *Service) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	go func() { _ = s.Serve(ln) }()
	return "http://" + ln.Addr().String()
}

func TestServePodsListsAnEventsConnectEngineNeverReached(t *testing.T) {
	port := testenv.FreePort(t) // nothing listens
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", port)
	_, base := startServe(t, "--events-connect", "10.0.0.7:8000="+ep)
	var resp struct {
		Pods      []Pod
		Endpoints []Endpoint
	}
	code, body := call(t, "GET", base+"/v1/pods", nil)
	require.Equal(t, http.StatusOK, code)
	require.NoError(t, json.Unmarshal(body, &resp))
	require.Empty(t, resp.Pods)
	require.Equal(t, []Endpoint{{Pod: "10.0.0.7:8000", Endpoint: ep}}, resp.Endpoints)
}

// storedPrompt has 127.0.0.1:8002 store a 4-block prompt (of zero
// tokens) on its CPU tier through s's bind socket, and returns the prompt
// and that holder, for picks that pull from it.
func storedPrompt(t *testing.T, s *Service) ([]uint32, index.Holder) {
	t.Helper()
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 4*16)
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	src := index.Holder{Pod: "127.0.0.1:8002"}
	newServeFeeder(t, s).store(src.Pod, "m", "CPU", keys)
	return tokens, src
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func call(t *testing.T, method, url string, body any) (int, []byte) {
	t.Helper()
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		r = strings.NewReader(b)
	default:
		buf, err := json.Marshal(b)
		require.NoError(t, err)
		r = bytes.NewReader(buf)
	}
	req, err := http.NewRequest(method, url, r)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, out
}

// UnmarshalJSON reads a pod of /v1/pods: the fields it names, and every
// other field into Counters, so that tests see what the service rendered.
func (p *Pod) UnmarshalJSON(b []byte) error {
	type fields Pod // without this method
	if err := json.Unmarshal(b, (*fields)(p)); err != nil {
		return err
	}
	var all map[string]json.RawMessage
	if err := json.Unmarshal(b, &all); err != nil {
		return err
	}
	for _, known := range []string{"pod", "model", "dp_rank", "blocks", "last_seq", "state", "inflight_pulls"} {
		delete(all, known)
	}
	p.Counters = map[string]uint64{}
	for name, raw := range all {
		var v uint64
		if err := json.Unmarshal(raw, &v); err != nil {
			return fmt.Errorf("pod field %q: %w", name, err)
		}
		p.Counters[name] = v
	}
	return nil
}

// zeroHolderCounters is what /v1/pods shows of a holder that counted
// nothing: each per-holder counter of events.Counters at zero.
func zeroHolderCounters() map[string]uint64 {
	m := map[string]uint64{}
	for _, c := range events.Counters {
		if c.Holder != nil {
			m[c.Name] = 0
		}
	}
	return m
}

func TestServeParsesFlags(t *testing.T) {
	cfg, err := parseFlags([]string{
		"--events-bind", "tcp://*:5557", "--events-bind", "tcp://127.0.0.1:5558",
		"--events-connect", "10.0.0.1:8000=tcp://10.0.0.1:5557",
		"--events-connect", "10.0.0.2:8000=tcp://10.0.0.2:5557,replay=tcp://10.0.0.2:5558",
		"--algo", "xxhash", "--seed", "42", "--block-size", "64", "--min-cached-token-delta", "2048",
		"--events-replay", "10.0.0.3:8000=tcp://10.0.0.3:5558",
		"--snapshot", "/tmp/s", "--http", ":9000",
	}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, []string{"tcp://*:5557", "tcp://127.0.0.1:5558"}, cfg.EventsBind)
	require.Equal(t, []PodEndpoint{
		{Pod: "10.0.0.1:8000", Endpoint: "tcp://10.0.0.1:5557"},
		{Pod: "10.0.0.2:8000", Endpoint: "tcp://10.0.0.2:5557", Replay: "tcp://10.0.0.2:5558"},
	}, cfg.EventsConnect)
	require.Equal(t, []PodEndpoint{{Pod: "10.0.0.3:8000", Replay: "tcp://10.0.0.3:5558"}}, cfg.EventsReplay)
	require.Equal(t, "xxhash", cfg.Algo)
	require.Equal(t, "42", cfg.Seed)
	require.True(t, cfg.SeedSet)
	require.Equal(t, 64, cfg.BlockSize)
	require.Equal(t, 2048, cfg.MinCachedTokenDelta)
	require.Equal(t, "/tmp/s", cfg.Snapshot)
	require.Equal(t, ":9000", cfg.HTTP)

	for _, bad := range [][]string{
		{"--events-connect", "tcp://10.0.0.1:5557"},
		{"--events-connect", "pod=tcp://h:1,relay=tcp://h:2"},
		{"--events-connect", "pod="},
		{"--events-replay", "pod=tcp://h:1,replay=tcp://h:2"},
		{"--min-cached-token-delta", "0"},
		{"--inflight-ttl", "0s"},
		{"--block-size", "x"},
		{"stray"},
	} {
		_, err := parseFlags(bad, io.Discard)
		require.Error(t, err, "%q", bad)
	}
}

func TestServeParsesKeysAndPodModels(t *testing.T) {
	cfg, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Equal(t, KeysEngine, cfg.Keys)

	cfg, err = parseFlags([]string{"--keys", "content",
		"--events-connect", "a=tcp://h:1,model=Qwen/Qwen3-0.6B@v2",
		"--events-connect", "b=tcp://h:2,model=m,replay=tcp://h:3",
		"--events-connect", "c=tcp://h:4,replay=tcp://h:5",
	}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, KeysContent, cfg.Keys)
	require.Equal(t, []PodEndpoint{
		{Pod: "a", Endpoint: "tcp://h:1", Model: "Qwen/Qwen3-0.6B@v2"},
		{Pod: "b", Endpoint: "tcp://h:2", Replay: "tcp://h:3", Model: "m"},
		{Pod: "c", Endpoint: "tcp://h:4", Replay: "tcp://h:5"},
	}, cfg.EventsConnect)
	require.Equal(t, hashing.Content, mustHasher(t, cfg.contentConfig()).Config().Algo)

	// --algo does not matter to content keys: an xxhash algorithm without
	// a seed, which engine keys refuse, starts.
	cfg, err = parseFlags([]string{"--keys", "content", "--algo", "xxhash", "--http", "127.0.0.1:0"}, io.Discard)
	require.NoError(t, err)
	s, err := newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	require.Equal(t, hashing.Content, s.hasher.Config().Algo)

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--keys", "engines"}, `--keys "engines": want engine or content`},
		{[]string{"--algo", "content"}, "use --keys content"},
		{[]string{"--events-connect", "a=tcp://h:1,model="}, "unknown option"},
		{[]string{"--events-connect", "a=tcp://h:1,model=x,model=y"}, "given twice"},
		{[]string{"--events-connect", "a=tcp://h:1,lora=x"}, "[,model=MODEL]"},
		{[]string{"--events-replay", "a=tcp://h:1,model=x"}, "want POD=tcp://HOST:PORT"},
		{[]string{"--block-size", "0"}, "--block-size 0: must be at least 1"},
	} {
		_, err := parseFlags(tc.args, io.Discard)
		require.ErrorContains(t, err, tc.want, "%q", tc.args)
	}
}

func TestServeSeedFlagTellsUnsetFromEmpty(t *testing.T) {
	cfg, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.False(t, cfg.SeedSet)
	require.Equal(t, hashing.DefaultSeed, mustHasher(t, cfg.hashingConfig()).Config().Seed)

	cfg, err = parseFlags([]string{"--seed", ""}, io.Discard)
	require.NoError(t, err)
	require.True(t, cfg.SeedSet)
	h := mustHasher(t, cfg.hashingConfig())
	require.Equal(t, "", h.Config().Seed)
	empty, err := hashing.New(hashing.Config{SeedSet: true})
	require.NoError(t, err)
	require.Equal(t, empty.Root(), h.Root())
}

// mustHasher is the hasher of cfg.
func mustHasher(t *testing.T, cfg hashing.Config) *hashing.Hasher {
	t.Helper()
	h, err := hashing.New(cfg)
	require.NoError(t, err)
	return h
}

func TestServeRejectsBadRequestsWithJSONErrors(t *testing.T) {
	_, base := startServe(t)
	cases := []struct {
		name, method, path string
		body               any
		want               string
	}{
		{"invalid JSON", "POST", "/v1/pick", `{"model":`, "decoding request"},
		{"unknown field", "POST", "/v1/score", `{"model":"m","tokens":[1],"prompt":"hi"}`, "unknown field"},
		{"trailing data", "POST", "/v1/score", `{"model":"m","tokens":[1]} {}`, "trailing data"},
		{"missing model", "POST", "/v1/score", `{"tokens":[1,2]}`, `"model" is required`},
		{"missing tokens", "POST", "/v1/pick", `{"model":"m","destination":"p:1"}`, `"tokens" or "tokens_b64" is required`},
		{"negative token", "POST", "/v1/score", `{"model":"m","tokens":[-1]}`, "decoding request"},
		{"missing destination", "POST", "/v1/pick", `{"model":"m","tokens":[1]}`, `"destination" is required`},
		{"zero threshold", "POST", "/v1/pick", `{"model":"m","tokens":[1],"destination":"p:1","min_cached_token_delta":0}`, "at least 1"},
		{"negative waiting", "POST", "/v1/pick", `{"model":"m","tokens":[1],"destination":"p:1","candidates":[{"pod":"q:1","waiting":-2}]}`, "negative load"},
		{"candidate without pod", "POST", "/v1/pick", `{"model":"m","tokens":[1],"destination":"p:1","candidates":[{"waiting":1}]}`, "without \"pod\""},
		{"negative candidate rank", "POST", "/v1/pick", `{"model":"m","tokens":[1],"destination":"p:1","candidates":[{"pod":"q:1","dp_rank":-1}]}`, "negative dp_rank"},
		{"negative destination rank", "POST", "/v1/pick", `{"model":"m","tokens":[1],"destination":"p:1","destination_dp_rank":-2}`, "must not be negative"},
		{"bad multimodal item", "POST", "/v1/score", `{"model":"m","tokens":[1,2,3],"mm_items":[{"id":"img","offset":-4,"length":2}]}`, "hashing"},
		{"done without request id", "POST", "/v1/done", `{}`, `"request_id" is required`},
		{"model not a string", "POST", "/v1/score", `{"model":5,"tokens":[1]}`, `"model": want a string, got a number`},
		{"candidates not an array", "POST", "/v1/pick", `{"model":"m","tokens":[1],"destination":"p:1","candidates":{"pod":"x"}}`, `"candidates": want an array, got an object`},
		{"candidate pod not a string", "POST", "/v1/pick", `{"model":"m","tokens":[1],"destination":"p:1","candidates":[{"pod":5}]}`, `"candidates.pod": want a string, got a number`},
		{"multimodal offset not an integer", "POST", "/v1/score", `{"model":"m","tokens":[1],"mm_items":[{"id":"a","offset":"x","length":1}]}`, `"mm_items.offset": want an integer, got a string`},
		{"request id not a string", "POST", "/v1/done", `{"request_id":5}`, `"request_id": want a string, got a number`},
		{"rank not an integer", "POST", "/v1/pick", `{"model":"m","tokens":[1],"destination":"p:1","destination_dp_rank":1.5}`, `"destination_dp_rank": want an integer, got a number (1.5)`},
		{"done body not an object", "POST", "/v1/done", `[]`, `request body: want an object, got an array`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, body := call(t, tc.method, base+tc.path, tc.body)
			require.Equal(t, http.StatusBadRequest, code, "%s", body)
			var e ErrorResponse
			require.NoError(t, json.Unmarshal(body, &e), "%s", body)
			require.Contains(t, e.Error, tc.want)
		})
	}
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Contains(t, string(metrics), `kvsource_http_requests_total{code="400",path="/v1/pick"} 11`)
	code, body := call(t, "GET", base+"/healthz", nil)
	require.Equal(t, http.StatusOK, code)
	require.JSONEq(t, `{"status":"ok"}`, string(body))
}

func TestServeAnswersOtherMethodsAndPathsWithJSONErrorsFromTheMux(t *testing.T) {
	_, base := startServe(t)
	cases := []struct {
		name, method, path string
		body               any
		code               int
		allow, want        string
	}{
		{"GET on pick", "GET", "/v1/pick", nil, http.StatusMethodNotAllowed, "POST", "method GET not allowed, use POST"},
		{"POST on pods", "POST", "/v1/pods", `{}`, http.StatusMethodNotAllowed, "GET, HEAD", "method POST not allowed, use GET, HEAD"},
		{"DELETE on done", "DELETE", "/v1/done", nil, http.StatusMethodNotAllowed, "POST", "use POST"},
		{"unknown path", "GET", "/v1/nope", nil, http.StatusNotFound, "", "no endpoint /v1/nope"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest(tc.method, base+tc.path, nil)
			if s, ok := tc.body.(string); ok {
				req, err = http.NewRequest(tc.method, base+tc.path, strings.NewReader(s))
			}
			require.NoError(t, err)
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			require.Equal(t, tc.code, resp.StatusCode)
			require.Equal(t, tc.allow, resp.Header.Get("Allow"))
			require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
			var e ErrorResponse
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&e))
			require.Contains(t, e.Error, tc.want)
		})
	}
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Contains(t, string(metrics), `kvsource_http_requests_total{code="405",path="/v1/pick"} 1`)
}

func TestServeForgetsPullsNeverMarkedDone(t *testing.T) {
	s, base := startServe(t, "--inflight-ttl", "1s", "--events-bind", "tcp://127.0.0.1:0")
	tokens, src := storedPrompt(t, s)

	code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": "10.0.0.1:8000", "request_id": "r"})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Equal(t, 1, s.pk.Inflight(src))
	require.Equal(t, 1, s.pulls.m.Size())
	require.Eventually(t, func() bool { return s.pulls.m.Size() == 0 && s.pk.Inflight(src) == 0 }, 10*time.Second, 20*time.Millisecond)
	code, body = call(t, "POST", base+"/v1/done", map[string]any{"request_id": "r"})
	require.Equal(t, http.StatusOK, code)
	require.JSONEq(t, `{"released":false}`, string(body))
}

func TestServeDoneReleasesAPickWithoutRequestIDByItsKVRequestID(t *testing.T) {
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0")
	tokens, src := storedPrompt(t, s)

	code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": "10.0.0.1:8000"})
	require.Equal(t, http.StatusOK, code, "%s", body)
	var ans struct {
		Reason string `json:"reason"`
		KV     struct {
			Source struct {
				ID string `json:"kv_request_id"`
			} `json:"remote_kv_source"`
		} `json:"kv_transfer_params"`
	}
	require.NoError(t, json.Unmarshal(body, &ans))
	require.Equal(t, "pull", ans.Reason)
	require.NotEmpty(t, ans.KV.Source.ID)
	require.Equal(t, 1, s.pk.Inflight(src))

	code, body = call(t, "POST", base+"/v1/done", map[string]any{"request_id": ans.KV.Source.ID})
	require.Equal(t, http.StatusOK, code)
	require.JSONEq(t, `{"released":true}`, string(body))
	require.Equal(t, 0, s.pk.Inflight(src))
	require.Equal(t, 0, s.pulls.m.Size())
}

// FuzzRequests posts arbitrary bodies to the JSON endpoints: every
// answer is valid JSON, 200 or a 400 or 413 with a JSON error, never a 500 or a
// panic.
func FuzzRequests(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"destination":"p:1"}`,
		`{"model":"m","tokens":[],"destination":"p:1","candidates":[{"pod":"q:1","waiting":2,"load":0.5}],"min_cached_token_delta":16}`,
		`{"model":"m","tokens":[1],"lora_name":"a","cache_salt":"s","mm_items":[{"id":"i","offset":0,"length":1}],"pods":["p:1"]}`,
		`{"model":"m","tokens":[1],"destination":"p:1","candidates":[{"pod":"q:1","dp_rank":-3}]}`,
		`{"request_id":"r"}`,
		`{"model":"m","tokens":[4294967295],"destination_dp_rank":7,"destination":"[::1]:80"}`,
		`{"model":"m","tokens_b64":"AQAAAAIAAAA=","destination":"p:1"}`,
		`[]`, `null`, `{"model":1}`,
	} {
		f.Add(seed)
	}
	cfg, err := parseFlags([]string{"--http", "127.0.0.1:0"}, io.Discard)
	require.NoError(f, err)
	s, err := newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(f, err)
	keys, err := s.hasher.BlockKeys(nil, hashing.Request{Tokens: make([]uint32, 64)})
	require.NoError(f, err)
	s.idx.Store(index.Blocks{Model: "m", Holder: index.Holder{Pod: "q:1"}, Tier: index.TierCPU, Keys: keys})
	handlers := map[string]http.HandlerFunc{
		"/v1/score": s.instrument("/v1/score", s.handleScore),
		"/v1/pick":  s.instrument("/v1/pick", s.handlePick),
		"/v1/done":  s.instrument("/v1/done", s.handleDone),
	}
	f.Fuzz(func(t *testing.T, body string) {
		for path, h := range handlers {
			rec := httptest.NewRecorder()
			h(rec, httptest.NewRequest(http.MethodPost, path, strings.NewReader(body)))
			require.Contains(t, []int{http.StatusOK, http.StatusBadRequest, http.StatusRequestEntityTooLarge}, rec.Code, "%s %s: %s", path, body, rec.Body)
			require.True(t, json.Valid(rec.Body.Bytes()), "%s %s: %s", path, body, rec.Body)
			if rec.Code != http.StatusOK {
				var e ErrorResponse
				require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &e))
				require.NotEmpty(t, e.Error)
			}
		}
	})
}

func TestServeDecidesByPredictedSavingWithACalibration(t *testing.T) {
	dir := t.TempDir()
	// Recompute 10 ms + 0.1 ms/token, pull 60 ms + 0.01 ms/token: a pull
	// saves time from 0.09·t > 50, i.e. 35 blocks of 16 tokens on.
	calib := filepath.Join(dir, "calibration.json")
	require.NoError(t, os.WriteFile(calib, []byte(`{
		"recompute": [{"tokens": 1000, "ms": 110}, {"tokens": 2000, "ms": 210}, {"tokens": 4000, "ms": 410}],
		"pull": [{"tokens": 1000, "ms": 70}, {"tokens": 4000, "ms": 100}]}`), 0o600))
	s, base := startServe(t, "--calibration", calib, "--events-bind", "tcp://127.0.0.1:0")
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 40*16)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	feed := newServeFeeder(t, s)
	feed.store("127.0.0.1:8002", "m", "CPU", keys)
	feed.store("127.0.0.1:8003", "m", "GPU", keys[:10])

	for _, tc := range []struct {
		dest   string
		reason string
		saving float64
	}{
		{"10.0.0.1:8000", "pull", 0.09*40*16 - 50},
		{"127.0.0.1:8003", "below_threshold", 0},
	} {
		code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": tc.dest})
		require.Equal(t, http.StatusOK, code, "%s", body)
		var d PickResponse
		require.NoError(t, json.Unmarshal(body, &d))
		require.Equal(t, tc.reason, string(d.Reason), tc.dest)
		if tc.reason == "pull" {
			require.InDelta(t, tc.saving, *d.PredictedSavingMillis, 1e-6)
		} else {
			require.Nil(t, d.PredictedSavingMillis)
		}
	}

	bad := filepath.Join(dir, "bad.json")
	require.NoError(t, os.WriteFile(bad, []byte(`{"recompute": [{"tokens": 1000, "ms": 110}], "pull": []}`), 0o600))
	cfg, err := parseFlags([]string{"--calibration", bad}, io.Discard)
	require.NoError(t, err)
	_, err = newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.ErrorIs(t, err, picker.ErrSamples)
}

func TestServeRunsWithAnInflightTTLBelowTheSweepTick(t *testing.T) {
	s, base := startServe(t, "--inflight-ttl", "1ns", "--events-bind", "tcp://127.0.0.1:0")
	tokens, _ := storedPrompt(t, s)
	code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": "10.0.0.1:8000", "request_id": "r"})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Contains(t, string(body), `"reason":"pull"`)
	require.Eventually(t, func() bool { return s.pulls.m.Size() == 0 }, 10*time.Second, 5*time.Millisecond)
}

func TestServeGivesEveryPullItsOwnKVRequestID(t *testing.T) {
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0")
	tokens, _ := storedPrompt(t, s)
	pick := func(req map[string]any) string {
		t.Helper()
		code, body := call(t, "POST", base+"/v1/pick", req)
		require.Equal(t, http.StatusOK, code, "%s", body)
		var d PickResponse
		require.NoError(t, json.Unmarshal(body, &d))
		require.Equal(t, picker.ReasonPull, d.Reason)
		require.NotNil(t, d.KVTransferParams.RemoteKVSource)
		return d.KVTransferParams.RemoteKVSource.KVRequestID
	}
	req := map[string]any{"model": "m", "tokens": tokens, "destination": "10.0.0.1:8000"}
	first, second := pick(req), pick(req)
	require.NotEmpty(t, first)
	require.NotEqual(t, first, second, "requests without a request_id must not share a pull session")
	req["request_id"] = "req-7"
	require.Equal(t, "req-7", pick(req))
}

func TestServeTellsAnUnknownModelFromNoHolder(t *testing.T) {
	s, base := startServe(t)
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 4*16)
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	s.idx.Store(index.Blocks{Model: "m", Holder: index.Holder{Pod: "10.0.0.2:8000"}, Tier: index.TierCPU, Keys: keys[2:]})

	pick := func(model string) PickResponse {
		code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": model, "tokens": tokens, "destination": "10.0.0.1:8000"})
		require.Equal(t, http.StatusOK, code, "%s", body)
		var resp PickResponse
		require.NoError(t, json.Unmarshal(body, &resp))
		return resp
	}
	require.Equal(t, picker.ReasonNoHolder, pick("m").Reason, "a known model whose block 0 nobody holds")
	unknown := pick("M")
	require.Equal(t, picker.ReasonUnknownModel, unknown.Reason)
	require.Equal(t, 4, unknown.RecomputeBlocks)

	code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "M", "tokens": tokens})
	require.Equal(t, http.StatusNotFound, code, "%s", body)
	var e ErrorResponse
	require.NoError(t, json.Unmarshal(body, &e))
	require.Contains(t, e.Error, `unknown model "M"`)
	code, body = call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": tokens})
	require.Equal(t, http.StatusOK, code, "%s", body)

	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Contains(t, string(metrics), `kvsource_pick_decisions_total{reason="unknown_model"} 1`)
	require.Contains(t, string(metrics), `kvsource_http_requests_total{code="404",path="/v1/score"} 1`)
}

func TestServeSenderFlagsParseNetworksAndValidate(t *testing.T) {
	cfg, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Nil(t, cfg.EventsAllow, "default: DNS-named pods only from loopback")
	require.False(t, cfg.EventsNoSenderCheck)
	require.Equal(t, 64, cfg.EventsPodsPerSender)
	require.Equal(t, 4096, cfg.EventsMaxHolders)
	require.Equal(t, 10*time.Minute, cfg.SnapshotExpiry)

	cfg, err = parseFlags([]string{"--events-allow", "10.1.2.3/8", "--events-allow", "fd00::/8", "--events-no-sender-check",
		"--events-max-pods-per-sender", "2", "--events-max-holders", "9", "--snapshot-expiry", "30s"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}, cfg.EventsAllow)
	require.True(t, cfg.EventsNoSenderCheck)
	require.Equal(t, 2, cfg.EventsPodsPerSender)
	require.Equal(t, 9, cfg.EventsMaxHolders)
	require.Equal(t, 30*time.Second, cfg.SnapshotExpiry)

	for _, args := range [][]string{
		{"--events-allow", "10.0.0.1"},
		{"--events-allow", "pods.example"},
		{"--events-max-pods-per-sender", "0"},
		{"--events-max-holders", "0"},
		{"--snapshot-expiry", "0s"},
	} {
		_, err := parseFlags(args, io.Discard)
		require.Error(t, err, "%v", args)
	}
}
