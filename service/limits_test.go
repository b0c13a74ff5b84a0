package service

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
)

func TestServeLimitFlagsDefaultAndValidate(t *testing.T) {
	cfg, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Equal(t, Limits{MaxInflight: 2 * runtime.GOMAXPROCS(0), RequestTimeout: 5 * time.Second, MaxTokens: 1 << 20}, cfg.Limits)
	cfg, err = parseFlags([]string{"--max-inflight-requests", "3", "--request-timeout", "250ms", "--max-tokens", "4096"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, Limits{MaxInflight: 3, RequestTimeout: 250 * time.Millisecond, MaxTokens: 4096}, cfg.Limits)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--max-inflight-requests", "0"}, "--max-inflight-requests must be at least 1"},
		{[]string{"--max-tokens", "0"}, "--max-tokens must be at least 1"},
		{[]string{"--request-timeout", "0s"}, "--request-timeout must be positive"},
		{[]string{"--request-timeout", "30s"}, "must be less than --http-write-timeout"},
		{[]string{"--max-body-memory", "20MiB"}, "--max-body-memory (20MiB) must hold two bodies of --max-tokens"},
	} {
		_, err := parseFlags(tc.args, io.Discard)
		require.ErrorContains(t, err, tc.want, "%v", tc.args)
	}
}

// counterValue is a counter's value, read from /metrics as a scraper would.
func counterValue(s *Service, name string, labels ...string) float64 {
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	var pairs []string
	for i := 0; i+1 < len(labels); i += 2 {
		pairs = append(pairs, fmt.Sprintf("%s=%q", labels[i], labels[i+1]))
	}
	prefix := name + " "
	if len(pairs) > 0 {
		prefix = name + "{" + strings.Join(pairs, ",") + "} "
	}
	for _, line := range strings.Split(rec.Body.String(), "\n") {
		if v, ok := strings.CutPrefix(line, prefix); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return -1
			}
			return f
		}
	}
	return 0
}

func rejected(s *Service, path, reason string) float64 {
	return counterValue(s, "kvsource_http_rejected_total", "path", path, "reason", reason)
}

func answered(s *Service, path string, code int) float64 {
	return counterValue(s, "kvsource_http_requests_total", "code", strconv.Itoa(code), "path", path)
}

func TestServeRefusesLongIdentifiersWith400(t *testing.T) {
	s, base := startServe(t)
	long := strings.Repeat("x", MaxFieldBytes+1)
	ok := strings.Repeat("x", MaxFieldBytes)
	tokens := make([]uint32, 64)
	cases := []struct {
		name, path string
		body       func(v string) map[string]any
	}{
		{"lora_name", "/v1/score", func(v string) map[string]any { return map[string]any{"model": "m", "tokens": tokens, "lora_name": v} }},
		{"cache_salt", "/v1/score", func(v string) map[string]any { return map[string]any{"model": "m", "tokens": tokens, "cache_salt": v} }},
		{"model", "/v1/score", func(v string) map[string]any { return map[string]any{"model": v, "tokens": tokens} }},
		{"pods", "/v1/score", func(v string) map[string]any {
			return map[string]any{"model": "m", "tokens": tokens, "pods": []string{v}}
		}},
		{"mm_items id", "/v1/score", func(v string) map[string]any {
			return map[string]any{"model": "m", "tokens": tokens, "mm_items": []map[string]any{{"id": v, "offset": 0, "length": 8}}}
		}},
		{"request_id", "/v1/pick", func(v string) map[string]any {
			return map[string]any{"model": "m", "tokens": tokens, "destination": "p:1", "request_id": v}
		}},
		{"destination", "/v1/pick", func(v string) map[string]any { return map[string]any{"model": "m", "tokens": tokens, "destination": v} }},
		{"candidates pod", "/v1/pick", func(v string) map[string]any {
			return map[string]any{"model": "m", "tokens": tokens, "destination": "p:1", "candidates": []map[string]any{{"pod": v}}}
		}},
		{"request_id", "/v1/done", func(v string) map[string]any { return map[string]any{"request_id": v} }},
	}
	want := map[string]float64{}
	for _, tc := range cases {
		t.Run(tc.path+" "+tc.name, func(t *testing.T) {
			code, body := call(t, "POST", base+tc.path, tc.body(long))
			require.Equal(t, http.StatusBadRequest, code, "%s", body)
			var e ErrorResponse
			require.NoError(t, json.Unmarshal(body, &e))
			require.Equal(t, fmt.Sprintf("%q is %d bytes, at most %d", tc.name, len(long), MaxFieldBytes), e.Error)
			want[tc.path]++
			code, body = call(t, "POST", base+tc.path, tc.body(ok))
			require.Equal(t, http.StatusOK, code, "at the limit: %s", body)
		})
	}
	for path, n := range want {
		require.Equal(t, n, rejected(s, path, rejectFieldSize), path)
	}
}

func TestServeRefusesTooManyTokensAndOversizeBodiesWith413(t *testing.T) {
	s, base := startServe(t, "--max-tokens", "1000")
	code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": make([]uint32, 1001)})
	require.Equal(t, http.StatusRequestEntityTooLarge, code, "%s", body)
	require.Contains(t, string(body), `\"tokens\": 1001 tokens, at most 1000 (--max-tokens)`)
	require.Equal(t, 1.0, rejected(s, "/v1/score", rejectTokens))
	code, body = call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": make([]uint32, 1000), "destination": "p:1"})
	require.Equal(t, http.StatusOK, code, "%s", body)

	// A declared length over the limit is refused before the body is read,
	// one without a length once the limit is read.
	limit := bodyLimit(1000)
	big := `{"model":"m","tokens":[` + strings.Repeat("1,", int(limit)/2) + `1]}`
	for _, declared := range []bool{true, false} {
		var r io.Reader = strings.NewReader(big)
		if !declared {
			r = io.MultiReader(r)
		}
		resp, err := http.Post(base+"/v1/pick", "application/json", r)
		require.NoError(t, err)
		msg, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode, "%s", msg)
		require.Contains(t, string(msg), "request body too large")
	}
	require.Equal(t, 2.0, rejected(s, "/v1/pick", rejectBodySize))
	// /v1/done has a small body limit of its own.
	code, body = call(t, "POST", base+"/v1/done", `{"request_id":"`+strings.Repeat(" ", smallBodyLimit)+`"}`)
	require.Equal(t, http.StatusRequestEntityTooLarge, code, "%s", body)
	// Counted once the answer is written, which the client may see first.
	require.Eventually(t, func() bool { return answered(s, "/v1/done", http.StatusRequestEntityTooLarge) == 1.0 }, 10*time.Second, time.Millisecond)
}

func TestServeAnswers503WithRetryAfterBeyondTheRequestsInFlight(t *testing.T) {
	s, base := startServe(t, "--max-inflight-requests", "1")
	require.Equal(t, 2*bodyLimit(DefaultMaxTokens), s.cfg.MaxBodyMemory, "by default two bodies of --max-tokens, at least")
	// A request at work holds the one slot.
	s.lim.slots <- struct{}{}
	for _, path := range []string{"/v1/score", "/v1/pick"} {
		resp, err := http.Post(base+path, "application/json", strings.NewReader(`{"model":"m","tokens":[1]}`))
		require.NoError(t, err)
		msg, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "%s", msg)
		require.Equal(t, "1", resp.Header.Get("Retry-After"))
		require.JSONEq(t, `{"error":"overloaded: 1 requests in flight (--max-inflight-requests), retry later"}`, string(msg))
		require.Equal(t, 1.0, rejected(s, path, rejectOverload))
		// Counted once the answer is written, which the client may see first.
		require.Eventually(t, func() bool { return answered(s, path, http.StatusServiceUnavailable) == 1.0 }, 10*time.Second, time.Millisecond)
	}
	// Health checks and releases are not held back by the limit.
	code, _ := call(t, "GET", base+"/healthz", nil)
	require.Equal(t, http.StatusOK, code)
	code, _ = call(t, "POST", base+"/v1/done", map[string]any{"request_id": "r"})
	require.Equal(t, http.StatusOK, code)

	<-s.lim.slots
	code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": []uint32{1}})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Eventually(t, func() bool { return s.lim.bodyBytes.Load() == 0 }, 10*time.Second, time.Millisecond,
		"a body's bytes are released with its answer")
}

// slowBody posts to url a body whose first part is sent at once and whose
// rest waits for finish; the answer's status arrives on the channel.
func slowBody(t *testing.T, url, first string) (finish func(rest string), status <-chan int) {
	t.Helper()
	pr, pw := io.Pipe()
	ch := make(chan int, 1)
	go func() {
		resp, err := http.Post(url, "application/json", pr)
		if err != nil {
			ch <- 0
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		ch <- resp.StatusCode
	}()
	// A body the server refuses before it has all of first (past
	// --max-body-memory) fails this write: its status says so.
	_, _ = pw.Write([]byte(first))
	return func(rest string) {
		_, _ = pw.Write([]byte(rest))
		_ = pw.Close()
	}, ch
}

func TestServeSlowBodiesHoldNoSlotAFastClientNeeds(t *testing.T) {
	// One slot, and eight clients sending their bodies slowly (slowloris):
	// before, each held a slot from before its body was read, and a
	// normal client got 503 on 50-100% of its requests.
	s, base := startServe(t, "--max-inflight-requests", "1", "--request-timeout", "25s")
	var finishes []func(string)
	var statuses []<-chan int
	for range 8 {
		finish, status := slowBody(t, base+"/v1/score", `{"model":"m",`)
		finishes, statuses = append(finishes, finish), append(statuses, status)
	}
	require.Eventually(t, func() bool { return s.lim.bodyBytes.Load() >= 8*int64(len(`{"model":"m",`)) }, 10*time.Second, 5*time.Millisecond)
	for range 20 {
		code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": []uint32{1}})
		require.Equal(t, http.StatusOK, code, "%s", body)
	}
	require.Zero(t, rejected(s, "/v1/score", rejectOverload))
	for i, finish := range finishes {
		// One at a time: the slot is released just after the answer.
		require.Eventually(t, func() bool { return len(s.lim.slots) == 0 }, 10*time.Second, time.Millisecond)
		finish(`"tokens":[1]}`)
		require.Equal(t, http.StatusOK, <-statuses[i])
	}
	require.Eventually(t, func() bool { return s.lim.bodyBytes.Load() == 0 }, 10*time.Second, 5*time.Millisecond)
}

func TestServeBoundsTheBodiesBeingReadByMaxBodyMemory(t *testing.T) {
	// Two bodies of 1 MiB sent so far (chunked, their length unknown) fit
	// in 3 MiB, counted as the buffers grown for them; a third does not.
	s, base := startServe(t, "--max-tokens", "1000", "--max-body-memory", "3MiB", "--request-timeout", "25s")
	chunk := `{"model":"m","tokens_b64":"` + strings.Repeat("A", 1<<20) // 1 MiB sent, the body not done
	var finishes []func(string)
	var statuses []<-chan int
	for range 2 {
		finish, status := slowBody(t, base+"/v1/score", chunk)
		finishes, statuses = append(finishes, finish), append(statuses, status)
	}
	require.Eventually(t, func() bool { return s.lim.bodyBytes.Load() >= 2<<20 }, 10*time.Second, 5*time.Millisecond)
	// A third does not fit beside them: 503, as an overload.
	finish, status := slowBody(t, base+"/v1/score", chunk)
	finish("")
	require.Equal(t, http.StatusServiceUnavailable, <-status)
	require.Equal(t, 1.0, rejected(s, "/v1/score", rejectOverload))
	require.LessOrEqual(t, s.lim.bodyBytes.Load(), int64(3<<20))
	for i, finish := range finishes {
		finish(`"}`)
		require.NotZero(t, <-statuses[i])
	}
	require.Eventually(t, func() bool { return s.lim.bodyBytes.Load() == 0 }, 10*time.Second, 5*time.Millisecond)
	code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": []uint32{1}})
	require.Equal(t, http.StatusOK, code, "%s", body)
}

func TestServeAnswers503AtTheRequestTimeout(t *testing.T) {
	// Blocks of one token: each of the prompt's 262,144 blocks hashes its
	// LoRA name and 16 multimodal identifiers, 68 KiB a block, 17 GiB of
	// SHA-256 in all: many seconds of work however fast the machine.
	s, base := startServe(t, "--request-timeout", "1s", "--block-size", "1")
	t.Run("a body that stalls", func(t *testing.T) {
		pr, pw := io.Pipe()
		defer pw.Close()
		go func() { _, _ = pw.Write([]byte(`{"model":"m","tokens":[1,2`)) }()
		start := time.Now()
		resp, err := http.Post(base+"/v1/score", "application/json", pr)
		require.NoError(t, err)
		msg, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "%s", msg)
		require.Equal(t, "1", resp.Header.Get("Retry-After"))
		require.Contains(t, string(msg), "request timeout: not answered within 1s (--request-timeout)")
		require.Less(t, time.Since(start), 5*time.Second)
	})
	t.Run("hashing that takes too long", func(t *testing.T) {
		var mm []map[string]any
		for i := range 16 {
			mm = append(mm, map[string]any{"id": strings.Repeat(strconv.Itoa(i%10), MaxFieldBytes), "offset": 0, "length": 1 << 18})
		}
		body := map[string]any{"model": "m", "tokens": make([]uint32, 1<<18), "lora_name": strings.Repeat("l", MaxFieldBytes), "mm_items": mm}
		for _, path := range []string{"/v1/score", "/v1/pick"} {
			if path == "/v1/pick" {
				body["destination"] = "p:1"
			}
			data, err := json.Marshal(body)
			require.NoError(t, err)
			start := time.Now()
			code, msg := call(t, "POST", base+path, string(data))
			require.Less(t, time.Since(start), 5*time.Second)
			require.Equal(t, http.StatusServiceUnavailable, code, "%s", msg)
			require.Contains(t, string(msg), "request timeout")
			require.Contains(t, string(msg), "hashing: stopped after")
		}
	})
	require.Equal(t, 2.0, rejected(s, "/v1/score", rejectTimeout))
	// Counted once the answer is written, which the client may see first.
	require.Eventually(t, func() bool { return answered(s, "/v1/score", http.StatusServiceUnavailable) == 2.0 }, 10*time.Second, time.Millisecond)
	require.Equal(t, 1.0, rejected(s, "/v1/pick", rejectTimeout))
	require.Zero(t, answered(s, "/v1/score", http.StatusOK))
}

// undeliverable is a ResponseWriter whose answers never reach the
// client, as when it hung up or the write deadline passed.
type undeliverable struct{ *httptest.ResponseRecorder }

func (undeliverable) FlushError() error { return errors.New("write: broken pipe") }

func TestServeCountsAnswersTheClientNeverGotAsAborted(t *testing.T) {
	s, _ := startServe(t)
	h := s.instrument("/v1/score", s.handleScore)
	h(undeliverable{httptest.NewRecorder()}, httptest.NewRequest(http.MethodPost, "/v1/score", strings.NewReader(`{"model":"m","tokens":[1]}`)))
	h(undeliverable{httptest.NewRecorder()}, httptest.NewRequest(http.MethodPost, "/v1/score", strings.NewReader(`{}`)))
	require.Equal(t, 1.0, counterValue(s, "kvsource_http_aborted_total", "code", "200", "path", "/v1/score"))
	require.Equal(t, 1.0, counterValue(s, "kvsource_http_aborted_total", "code", "400", "path", "/v1/score"))
	require.Zero(t, answered(s, "/v1/score", http.StatusOK))
	require.Zero(t, answered(s, "/v1/score", http.StatusBadRequest))
}

// A client that hangs up cancels its request: counted as such, not as the
// server's 500.
func TestServeClassifiesAClientThatHungUpApartFromFailures(t *testing.T) {
	var s Service
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r := httptest.NewRequest(http.MethodPost, "/v1/score", nil).WithContext(ctx)
	code, reason := s.classify(r, fmt.Errorf("picker: hashing: stopped: %w", context.Canceled))
	require.Equal(t, statusClientClosed, code)
	require.Equal(t, rejectCanceled, reason)
	code, _ = s.classify(httptest.NewRequest(http.MethodPost, "/v1/score", nil), errors.New("boom"))
	require.Equal(t, http.StatusInternalServerError, code)
}

func TestServeCountsBadRequestsAndLogsAFewOfThem(t *testing.T) {
	var logs syncLog
	s, base := startServeWith(t, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})))

	// The series are there before the first refusal, for alerts.
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Contains(t, string(metrics), `kvsource_http_rejected_total{path="/v1/pick",reason="bad_request"} 0`)
	require.Contains(t, string(metrics), `kvsource_http_aborted_total{code="200",path="/v1/pick"} 0`)

	start := time.Now()
	const n = 300
	for range n {
		code, _ := call(t, "POST", base+"/v1/pick", "x")
		require.Equal(t, http.StatusBadRequest, code)
	}
	elapsed := time.Since(start)
	require.Eventually(t, func() bool { return rejected(s, "/v1/pick", rejectBadRequest) == n }, 10*time.Second, time.Millisecond)
	lines := strings.Count(logs.String(), `msg="kvsource serve: bad request"`)
	t.Logf("%d lines for %d bad requests in %v", lines, n, elapsed)
	require.Positive(t, lines)
	require.LessOrEqual(t, lines, int(elapsed/time.Second)+1)
	// The next line a second later says how many were left out.
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(logs.String(), "not_logged_before="); time.Sleep(50 * time.Millisecond) {
		require.True(t, time.Now().Before(deadline), "no line counted the ones left out: %s", logs.String())
		code, _ := call(t, "POST", base+"/v1/pick", "x")
		require.Equal(t, http.StatusBadRequest, code)
	}
}

func TestServeKeepsPullsForDoneWithoutTheirKeysAndWithinItsBudget(t *testing.T) {
	// A long prompt: 1,024 blocks to pull, 8 KiB of missing keys a pick.
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0", "--kept-pulls-memory", "1KiB")
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 1024*16)
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	newServeFeeder(t, s).store("127.0.0.1:8002", "m", "CPU", keys)

	perPull := keptPullBytes("r-0")
	kept := 0
	for i := range 20 {
		code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens,
			"destination": "10.0.0.1:8000", "request_id": fmt.Sprintf("r-%d", i)})
		require.Equal(t, http.StatusOK, code, "%s", body)
		require.Contains(t, string(body), `"reason":"pull"`, "a pull is answered whether or not it is kept")
		if s.pulls.m.Size() > kept {
			kept++
		}
	}
	require.Less(t, perPull, int64(400), "a kept pull costs its bookkeeping, not its keys")
	require.Equal(t, int(1024/perPull), kept, "kept up to the budget")
	require.LessOrEqual(t, s.pulls.bytes.Load(), int64(1024))
	require.Equal(t, float64(20-kept), counterValue(s, "kvsource_kept_pulls_dropped_total"))
	for _, p := range s.pulls.m.All() {
		require.Nil(t, p.d.Missing)
	}
	// The kept ones are released by /v1/done, the others only by the TTL.
	_, body := call(t, "POST", base+"/v1/done", map[string]any{"request_id": "r-0"})
	require.JSONEq(t, `{"released":true}`, string(body))
	_, body = call(t, "POST", base+"/v1/done", map[string]any{"request_id": "r-19"})
	require.JSONEq(t, `{"released":false}`, string(body))
	require.Equal(t, int64(kept-1)*perPull, s.pulls.bytes.Load())
}
