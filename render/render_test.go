package render_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log/slog"

	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/render"
)

func newClient(t *testing.T, cfg render.Config) *render.Client {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	c, err := render.New(cfg)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

func imageHash(url string) string {
	sum := sha256.Sum256([]byte(url))
	return hex.EncodeToString(sum[:])
}

func TestChatRendersTheEnginesTokensWithTheModelStampedIn(t *testing.T) {
	f := newFakeVLLM(t, "base")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "base"})
	body := `{"model":"my-lora","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],"x_unknown":{"kept":[1,2.5,null,true]},"cache_salt":"s\u00e9l"}`
	r, err := c.Chat(context.Background(), []byte(body))
	require.NoError(t, err)

	want := append(append([]uint32{tokBOS, tokUser}, textTokens("hi")...), tokEnd, tokGenPrompt)
	require.Equal(t, want, r.Request.Tokens)
	require.Equal(t, "base", r.Model)
	require.Equal(t, "my-lora", r.BodyModel)
	require.Equal(t, "sél", r.Request.CacheSalt)
	require.Empty(t, r.Request.MM)
	require.Empty(t, r.Request.LoRAName)

	sent := f.lastBody()
	require.Equal(t, "base", sent["model"])
	require.Equal(t, false, sent["return_mm_kwargs"])
	require.Equal(t, map[string]any{"kept": []any{1.0, 2.5, nil, true}}, sent["x_unknown"])
	require.Len(t, sent["tools"], 1)
	require.Equal(t, "sél", sent["cache_salt"])
}

func TestABodyWithoutAModelGetsTheStampedOne(t *testing.T) {
	f := newFakeVLLM(t, "base")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "base"})
	for _, body := range []string{`{"prompt":"abc"}`, ` { "prompt" : "abc" } `} {
		rs, err := c.Completions(context.Background(), []byte(body))
		require.NoError(t, err)
		require.Len(t, rs, 1)
		require.Equal(t, "base", rs[0].Model)
		require.Empty(t, rs[0].BodyModel)
		require.Equal(t, "base", f.lastBody()["model"])
	}
}

func TestWithoutConfigModelTheBodysModelIsForwarded(t *testing.T) {
	f := newFakeVLLM(t, "base")
	c := newClient(t, render.Config{URL: f.srv.URL})
	rs, err := c.Completions(context.Background(), []byte(`{"model":"base","prompt":["ab","cde"]}`))
	require.NoError(t, err)
	require.Len(t, rs, 2)
	require.Equal(t, append([]uint32{tokBOS}, textTokens("ab")...), rs[0].Request.Tokens)
	require.Equal(t, append([]uint32{tokBOS}, textTokens("cde")...), rs[1].Request.Tokens)
	require.Equal(t, "base", rs[1].Model)

	_, err = c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
	require.ErrorIs(t, err, render.ErrBadRequest, "the fake, as a render-only server, needs a model")
}

func TestChatWithImagesGivesTheItemsAtTheirPlaceholders(t *testing.T) {
	f := newFakeVLLM(t, "vl")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "vl"})
	body := `{"messages":[{"role":"user","content":[{"type":"text","text":"look"},` +
		`{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"text","text":"and"},` +
		`{"type":"image_url","image_url":{"url":"https://example.test/b.png"}}]}]}`
	r, err := c.Chat(context.Background(), []byte(body))
	require.NoError(t, err)
	first := 2 + len("look")
	second := first + imageTokens + len("and")
	require.Equal(t, []hashing.MMItem{
		{ID: imageHash("data:image/png;base64,AAAA"), Offset: first, Length: imageTokens},
		{ID: imageHash("https://example.test/b.png"), Offset: second, Length: imageTokens},
	}, r.Request.MM)
	require.Len(t, r.Request.Tokens, second+imageTokens+2)
	require.Equal(t, false, f.lastBody()["return_mm_kwargs"])
}

func TestKeepMMKwargsSendsTheBodyWithoutTheSplice(t *testing.T) {
	f := newFakeVLLM(t, "vl")
	c := newClient(t, render.Config{URL: f.srv.URL, KeepMMKwargs: true})
	body := `{"model":"vl","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}`
	r, err := c.Chat(context.Background(), []byte(body))
	require.NoError(t, err, "the answer's kwargs_data is skipped")
	require.Len(t, r.Request.MM, 1)
	f.mu.Lock()
	sent := string(f.bodies[0])
	f.mu.Unlock()
	require.Equal(t, body, sent, "no model to stamp and no splice: the body goes as it came")
}

func TestRenderTellsChatFromCompletionsBodies(t *testing.T) {
	f := newFakeVLLM(t, "m")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m"})
	rs, err := c.Render(context.Background(), []byte(`{"messages":[{"role":"system","content":"x"}]}`))
	require.NoError(t, err)
	require.Equal(t, []uint32{tokBOS, tokSystem, 'x' + textTokenShift, tokEnd, tokGenPrompt}, rs[0].Request.Tokens)
	rs, err = c.Render(context.Background(), []byte(`{"prompt":"x"}`))
	require.NoError(t, err)
	require.Equal(t, []uint32{tokBOS, 'x' + textTokenShift}, rs[0].Request.Tokens)
	_, err = c.Render(context.Background(), []byte(`{"prompt":"x","messages":[]}`))
	require.ErrorIs(t, err, render.ErrBadRequest)
}

func TestTheSaltComesFromTheBodyWhenTheAnswerHasNone(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte(`[{"token_ids":[1,2,3]}]`)) // a renderer that gives only token_ids
	}))
	t.Cleanup(srv.Close)
	c := newClient(t, render.Config{URL: srv.URL})
	rs, err := c.Completions(context.Background(), []byte(`{"model":"m","prompt":"x","cache_salt":"tenant-7"}`))
	require.NoError(t, err)
	require.Equal(t, "tenant-7", rs[0].Request.CacheSalt)
	require.Equal(t, "m", rs[0].Model)
}

// answer is a backend that gives one fixed answer to every render.
func answer(t *testing.T, status int, body string) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestErrorAnswersSayWhichBackendFailedAndWhy(t *testing.T) {
	for _, tc := range []struct {
		name    string
		status  int
		body    string
		want    error
		kind    string
		message string
	}{
		{"400 with vLLM's error JSON", 400, `{"error":{"message":"messages.0.content: Input should be a valid string","type":"BadRequestError","param":null,"code":400}}`,
			render.ErrBadRequest, "bad_request", "status 400 BadRequestError: messages.0.content: Input should be a valid string"},
		{"404 in the older flat shape", 404, `{"object":"error","message":"The model ` + "`x`" + ` does not exist.","type":"NotFoundError","param":null,"code":404}`,
			render.ErrBadRequest, "bad_request", "status 404 NotFoundError: The model `x` does not exist."},
		{"501", 501, `{"error":{"message":"Beam search is not supported","type":"NotImplementedError","code":501}}`,
			render.ErrBadRequest, "bad_request", "status 501 NotImplementedError"},
		{"500", 500, `{"error":{"message":"boom","type":"InternalServerError","code":500}}`,
			render.ErrUnavailable, "unavailable", "status 500 InternalServerError: boom"},
		{"503 from a proxy in HTML", 503, `<html><body>no healthy upstream</body></html>`,
			render.ErrUnavailable, "unavailable", "status 503: <html><body>no healthy upstream</body></html>"},
		{"429", 429, `{"error":{"message":"slow down","type":"TooManyRequests","code":429}}`,
			render.ErrUnavailable, "unavailable", "status 429"},
		{"401", 401, `{"error":"Unauthorized"}`, render.ErrBadRequest, "bad_request", `status 401: {"error":"Unauthorized"}`},
		{"a huge error page is cut", 502, strings.Repeat("x", 100_000), render.ErrUnavailable, "unavailable", strings.Repeat("x", 512) + "..."},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := answer(t, tc.status, tc.body)
			c := newClient(t, render.Config{URL: srv.URL})
			_, err := c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
			require.ErrorIs(t, err, tc.want)
			require.Equal(t, tc.kind, render.Kind(err))
			var re *render.Error
			require.ErrorAs(t, err, &re)
			require.Equal(t, tc.status, re.Status)
			require.Equal(t, srv.URL+render.CompletionsPath, re.Endpoint)
			require.Contains(t, err.Error(), "render: POST "+srv.URL+render.CompletionsPath+": ")
			require.Contains(t, err.Error(), tc.message)
			require.Less(t, len(err.Error()), 1024)
		})
	}
}

func TestBadAnswersAreErrBadResponse(t *testing.T) {
	for _, tc := range []struct {
		name, chat, completions, why string
	}{
		{"malformed JSON", `{"token_ids":[1,2`, `[{"token_ids":[1,2]`, "unterminated"},
		{"malformed JSON in another member", `{"token_ids":[1],"sampling_params":{"n":1,}}`, `[{"token_ids":[1],"x":tru}]`, "offset"},
		{"a token with a leading zero", `{"token_ids":[01]}`, `[{"token_ids":[1,00]}]`, "no non-negative integer"},
		{"trailing data", `{"token_ids":[1]} x`, `[{"token_ids":[1]}],`, "data after"},
		{"not JSON", `<html>`, `<html>`, "want a JSON"},
		{"empty", ``, ``, "empty body"},
		{"the other endpoint's shape", `[{"token_ids":[1]}]`, `{"token_ids":[1]}`, "want a JSON"},
		{"null", `null`, `null`, "got null"},
		{"no prompt", `{"token_ids":[]}`, `[]`, "token_ids is empty|no rendered prompt"},
		{"token ids as strings", `{"token_ids":["1"]}`, `[{"token_ids":["1"]}]`, "no non-negative integer"},
		{"a negative token", `{"token_ids":[1,-2]}`, `[{"token_ids":[-2]}]`, "negative"},
		{"a fractional token", `{"token_ids":[1.5]}`, `[{"token_ids":[1e3]}]`, "no non-negative integer"},
		{"a token past uint32", `{"token_ids":[4294967296]}`, `[{"token_ids":[99999999999999999999]}]`, "uint32"},
		{"token_ids an object", `{"token_ids":{"a":1}}`, `[{"token_ids":"abc"}]`, "want an array"},
		{"no tokens", `{"token_ids":[]}`, `[{"token_ids":null}]`, "token_ids"},
		{"missing token_ids", `{"model":"m"}`, `[{}]`, "no token_ids"},
		{"features of the wrong type", `{"token_ids":[1],"features":[1]}`, `[{"token_ids":[1],"features":"x"}]`, "features: want an object"},
		{"modalities disagree", `{"token_ids":[1,2],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"audio":[{"offset":0,"length":1}]}}}`,
			`[{"token_ids":[1,2],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{}}}]`, "modalit"},
		{"counts disagree", `{"token_ids":[1,2],"features":{"mm_hashes":{"image":["a","b"]},"mm_placeholders":{"image":[{"offset":0,"length":1}]}}}`,
			`[{"token_ids":[1,2],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[]}}}]`, "hashes for"},
		{"a placeholder past the prompt", `{"token_ids":[1,2],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[{"offset":1,"length":2}]}}}`,
			`[{"token_ids":[1,2],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[{"offset":-1,"length":1}]}}}]`, "outside"},
		{"an empty placeholder", `{"token_ids":[1,2],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[{"offset":0,"length":0}]}}}`,
			`[{"token_ids":[1,2],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[{"offset":0}]}}}]`, "placeholder"},
		{"overlapping placeholders", `{"token_ids":[1,2,3],"features":{"mm_hashes":{"image":["a"],"audio":["b"]},"mm_placeholders":{"image":[{"offset":0,"length":2}],"audio":[{"offset":1,"length":2}]}}}`,
			`[{"token_ids":[1,2,3],"features":{"mm_hashes":{"image":["a","b"]},"mm_placeholders":{"image":[{"offset":0,"length":3},{"offset":2,"length":1}]}}}]`, "overlap"},
		{"an empty hash", `{"token_ids":[1],"features":{"mm_hashes":{"image":[""]},"mm_placeholders":{"image":[{"offset":0,"length":1}]}}}`,
			`[{"token_ids":[1],"features":{"mm_hashes":{"image":[""]},"mm_placeholders":{"image":[{"offset":0,"length":1}]}}}]`, "empty hash"},
		{"a placeholder offset past int64", `{"token_ids":[1],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[{"offset":1e30,"length":1}]}}}`,
			`[{"token_ids":[1],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[{"offset":0,"length":"1"}]}}}]`, "cannot unmarshal"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, ep := range []struct {
				path, answer string
			}{{render.ChatPath, tc.chat}, {render.CompletionsPath, tc.completions}} {
				srv := answer(t, 200, ep.answer)
				c := newClient(t, render.Config{URL: srv.URL})
				var err error
				if ep.path == render.ChatPath {
					_, err = c.Chat(context.Background(), []byte(`{"messages":[]}`))
				} else {
					_, err = c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
				}
				require.ErrorIs(t, err, render.ErrBadResponse, ep.path)
				require.Equal(t, "bad_response", render.Kind(err))
				why := tc.why
				if a, b, ok := strings.Cut(why, "|"); ok {
					why = map[bool]string{true: a, false: b}[ep.path == render.ChatPath]
				}
				require.ErrorContains(t, err, why, ep.path)
				require.ErrorContains(t, err, srv.URL+ep.path)
			}
		})
	}
}

func TestAnHugeAnswerIsCutAtMaxResponseBytes(t *testing.T) {
	const limit = 64 << 10
	var wrote atomic.Int64
	for _, chunked := range []bool{false, true} {
		t.Run(fmt.Sprintf("chunked=%v", chunked), func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				chunk := []byte(strings.Repeat("1234567,", 1024))
				if !chunked {
					w.Header().Set("Content-Length", fmt.Sprint(len(`[{"token_ids":[`)+len(chunk)*4096))
				}
				_, _ = w.Write([]byte(`[{"token_ids":[`))
				for range 4096 { // 32 MiB at most, stopped by the client closing
					n, err := w.Write(chunk)
					wrote.Add(int64(n))
					if err != nil {
						return
					}
					if chunked {
						w.(http.Flusher).Flush()
					}
				}
			}))
			t.Cleanup(srv.Close)
			c := newClient(t, render.Config{URL: srv.URL, MaxResponseBytes: limit})
			_, err := c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
			require.ErrorIs(t, err, render.ErrBadResponse)
			require.ErrorContains(t, err, "exceeds Config.MaxResponseBytes (65536)")
		})
	}
}

func TestATimeoutIsErrUnavailableAndACanceledCallerIsNot(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan struct{}, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		// The server notices a dropped connection only once the body is read.
		_, _ = io.Copy(io.Discard, r.Body)
		arrived <- struct{}{}
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) }) // before srv.Close, which waits for the handlers

	c := newClient(t, render.Config{URL: srv.URL, Timeout: 50 * time.Millisecond})
	_, err := c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
	require.ErrorIs(t, err, render.ErrUnavailable)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "no answer within 50ms (Config.Timeout)")
	var re *render.Error
	require.ErrorAs(t, err, &re)
	require.Equal(t, 50*time.Millisecond, re.Timeout, "the client's own timeout, for a service to name")
	<-arrived

	c = newClient(t, render.Config{URL: srv.URL})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := c.Completions(ctx, []byte(`{"prompt":"x"}`))
		done <- err
	}()
	<-arrived
	cancel()
	err = <-done
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, render.ErrUnavailable)
	require.Equal(t, "canceled", render.Kind(err))
	require.ErrorAs(t, err, &re)
	require.Zero(t, re.Timeout)
	require.Equal(t, uint64(1), c.Stats().Canceled)
}

func TestAMultimodalChatGetsTheLongerTimeout(t *testing.T) {
	var mu sync.Mutex
	var got []time.Duration
	rt := roundTripper(func(r *http.Request) (*http.Response, error) {
		d, ok := r.Context().Deadline()
		require.True(t, ok)
		mu.Lock()
		got = append(got, time.Until(d))
		mu.Unlock()
		body := `{"token_ids":[1]}`
		if r.URL.Path == render.CompletionsPath {
			body = "[" + body + "]"
		}
		return &http.Response{StatusCode: 200, Body: ioNopCloser(body), Header: http.Header{}, Request: r}, nil
	})
	c := newClient(t, render.Config{URL: "http://render.test", Transport: rt, Timeout: 2 * time.Second, MMTimeout: 20 * time.Second})
	ctx := context.Background()
	_, err := c.Completions(ctx, []byte(`{"prompt":"x"}`))
	require.NoError(t, err)
	_, err = c.Chat(ctx, []byte(`{"messages":[{"role":"user","content":"plain"}]}`))
	require.NoError(t, err)
	_, err = c.Chat(ctx, []byte(`{"messages":[{"role":"user","content":"a"},{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}`))
	require.NoError(t, err)
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err = c.Chat(short, []byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"t"}]}]}`))
	require.NoError(t, err)

	require.Len(t, got, 4)
	for i, want := range []time.Duration{2 * time.Second, 2 * time.Second, 20 * time.Second, time.Second} {
		require.InDelta(t, want.Seconds(), got[i].Seconds(), 0.5, "render %d", i)
	}
}

func TestABackendThatIsDownIsErrUnavailable(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close()
	c := newClient(t, render.Config{URL: url})
	_, err := c.Chat(context.Background(), []byte(`{"messages":[]}`))
	require.ErrorIs(t, err, render.ErrUnavailable)
	require.ErrorContains(t, err, "render: POST "+url+render.ChatPath+": ")
	require.ErrorContains(t, err, "connection refused")
	require.Equal(t, uint64(1), c.Stats().Unavailable)
}

func TestBodiesTheClientRefusesNeverReachTheBackend(t *testing.T) {
	f := newFakeVLLM(t, "m")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m", MaxBodyBytes: 1 << 10})
	for _, tc := range []struct{ name, body, why string }{
		{"empty", ``, "empty body"},
		{"an array", `[{"prompt":"x"}]`, "want a JSON object, got an array"},
		{"malformed", `{"prompt":"x"`, "unterminated object"},
		{"trailing data", `{"prompt":"x"} {}`, "data after the JSON object"},
		{"a model that is no string", `{"model":7,"prompt":"x"}`, "model: want a string, got a number"},
		{"a salt that is no string", `{"cache_salt":["x"],"prompt":"x"}`, "cache_salt: want a string, got an array"},
		{"an invalid escape", `{"prompt":"\x"}`, "invalid escape"},
		{"too large", `{"prompt":"` + strings.Repeat("a", 2<<10) + `"}`, "exceeds the 1024-byte limit"},
		{"too deep", `{"prompt":` + strings.Repeat("[", 600) + strings.Repeat("]", 600) + `}`, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Render(context.Background(), []byte(tc.body))
			require.ErrorIs(t, err, render.ErrBadRequest)
			require.ErrorContains(t, err, tc.why)
		})
	}
	require.Zero(t, f.count())
}

func TestRendersShareOneKeepAliveHTTP11Connection(t *testing.T) {
	f := newFakeVLLM(t, "m")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m"})
	for range 20 {
		_, err := c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
		require.NoError(t, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	require.Len(t, f.remotes, 1, "one connection for sequential renders")
	for _, p := range f.protos {
		require.Equal(t, "HTTP/1.1", p)
	}
}

func TestWarmRetriesUntilTheBackendAnswers(t *testing.T) {
	f := newFakeVLLM(t, "m")
	var failures atomic.Int32
	failures.Store(3)
	f.handle = func(w http.ResponseWriter, _ *http.Request, _ []byte) bool {
		if failures.Add(-1) >= 0 {
			vllmErrorAnswer(w, http.StatusServiceUnavailable, "ServiceUnavailable", "loading")
			return true
		}
		return false
	}
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m", WarmInterval: time.Millisecond})
	require.NoError(t, c.Warm(context.Background()))
	require.Equal(t, 4, f.count())
	require.Equal(t, "m", f.lastBody()["model"])
}

func TestWarmStopsAtOnceWhenTheBackendRefuses(t *testing.T) {
	f := newFakeVLLM(t, "served")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "other", WarmInterval: time.Hour})
	err := c.Warm(context.Background())
	require.ErrorIs(t, err, render.ErrBadRequest)
	require.ErrorContains(t, err, "The model `other` does not exist.")
	require.Equal(t, 1, f.count())
}

func TestWarmGivesUpWhenItsContextEnds(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close()
	c := newClient(t, render.Config{URL: url, WarmInterval: time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := c.Warm(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorIs(t, err, render.ErrUnavailable, "the last failure is kept")
	require.ErrorContains(t, err, "warm-up of "+url)
}

func TestWarmOpensWarmConnsConnections(t *testing.T) {
	const conns = 4
	f := newFakeVLLM(t, "m")
	var n atomic.Int32
	all := make(chan struct{})
	f.handle = func(w http.ResponseWriter, r *http.Request, _ []byte) bool {
		// The first render checks the backend; the next ones are
		// concurrent, so each needs a connection of its own: hold them
		// until all have arrived.
		if k := n.Add(1); k > 1 {
			if k == conns+1 {
				close(all)
			}
			select {
			case <-all:
			case <-r.Context().Done():
			}
		}
		return false
	}
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m", WarmConns: conns})
	require.NoError(t, c.Warm(context.Background()))
	f.mu.Lock()
	require.Len(t, f.remotes, conns, "the check's connection is reused by one of the concurrent renders")
	f.mu.Unlock()
	for range 3 * conns {
		_, err := c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
		require.NoError(t, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	require.Len(t, f.remotes, conns, "later renders reuse the warm pool")
}

func TestTheCacheAnswersARepeatedBody(t *testing.T) {
	f := newFakeVLLM(t, "m")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m", CacheBytes: 1 << 20})
	body := []byte(`{"messages":[{"role":"user","content":"hello"}]}`)
	a, err := c.Chat(context.Background(), body)
	require.NoError(t, err)
	b, err := c.Chat(context.Background(), body)
	require.NoError(t, err)
	require.Equal(t, a, b)
	require.Equal(t, 1, f.count())

	_, err = c.Chat(context.Background(), []byte(`{"messages":[{"role":"user","content":"hellO"}]}`))
	require.NoError(t, err)
	_, err = c.Completions(context.Background(), []byte(`{"messages":[{"role":"user","content":"hello"}]}`))
	require.Error(t, err, "the same body to the other endpoint is another render")
	require.Equal(t, 3, f.count())
	s := c.Stats()
	require.Equal(t, uint64(1), s.CacheHits)
	require.Equal(t, uint64(2), s.Renders)
	require.Equal(t, int64(2), s.CacheEntries)
}

func TestTheCacheStaysWithinItsBytes(t *testing.T) {
	f := newFakeVLLM(t, "m")
	const bound = 64 << 10
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m", CacheBytes: bound})
	prompt := strings.Repeat("p", 500) // about 2 KiB of tokens a render
	for i := range 500 {
		_, err := c.Completions(context.Background(), fmt.Appendf(nil, `{"prompt":"%s%d"}`, prompt, i))
		require.NoError(t, err)
		require.LessOrEqual(t, c.Stats().CacheBytes, int64(bound))
	}
	s := c.Stats()
	require.Positive(t, s.CacheEvictions)
	require.Greater(t, s.CacheBytes, int64(bound/2), "the bound is used, not just respected")

	_, err := c.Completions(context.Background(), fmt.Appendf(nil, `{"prompt":"%s"}`, strings.Repeat("q", 8<<10)))
	require.NoError(t, err)
	require.Equal(t, uint64(1), c.Stats().CacheTooLarge, "a render larger than a shard's share is not kept")
}

func TestErrorsAreNotCached(t *testing.T) {
	f := newFakeVLLM(t, "m")
	var fail atomic.Bool
	fail.Store(true)
	f.handle = func(w http.ResponseWriter, _ *http.Request, _ []byte) bool {
		if fail.Load() {
			vllmErrorAnswer(w, 503, "ServiceUnavailable", "x")
			return true
		}
		return false
	}
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m", CacheBytes: 1 << 20})
	_, err := c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
	require.ErrorIs(t, err, render.ErrUnavailable)
	fail.Store(false)
	_, err = c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
	require.NoError(t, err)
}

func TestObserveSeesEveryRender(t *testing.T) {
	f := newFakeVLLM(t, "m")
	var mu sync.Mutex
	var obs []render.Observation
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m", CacheBytes: 1 << 20, Observe: func(o render.Observation) {
		mu.Lock()
		obs = append(obs, o)
		mu.Unlock()
	}})
	ctx := context.Background()
	_, err := c.Completions(ctx, []byte(`{"prompt":["ab","c"]}`))
	require.NoError(t, err)
	_, err = c.Completions(ctx, []byte(`{"prompt":["ab","c"]}`))
	require.NoError(t, err)
	_, err = c.Chat(ctx, []byte(`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}`))
	require.NoError(t, err)
	_, err = c.Chat(ctx, []byte(`{"messages":[{"role":"nobody","content":"x"}]}`))
	require.Error(t, err)

	require.Len(t, obs, 4)
	require.Equal(t, render.Observation{Endpoint: "completions", Duration: obs[0].Duration, Prompts: 2, Tokens: 5}, obs[0])
	require.True(t, obs[1].Cached)
	require.True(t, obs[2].Multimodal)
	require.Equal(t, "bad_request", render.Kind(obs[3].Err))
	require.Positive(t, obs[0].Duration)
}

func TestNewRefusesABadConfig(t *testing.T) {
	for _, cfg := range []render.Config{
		{URL: "localhost:8000"},
		{URL: "ftp://host"},
		{URL: "http://"},
		{URL: "http://h/?q=1"},
		{URL: "http://user:secret@h:8000"},
		{URL: "http://h", Timeout: -1},
		{URL: "http://h", CacheBytes: -1},
	} {
		_, err := render.New(cfg)
		require.Error(t, err, "%+v", cfg)
		require.NotContains(t, err.Error(), "secret")
	}
	c, err := render.New(render.Config{})
	require.NoError(t, err)
	require.Equal(t, render.DefaultURL, c.URL())
	c, err = render.New(render.Config{URL: "http://h:1/prefix/"})
	require.NoError(t, err)
	_ = c
}

func TestAPathPrefixIsKept(t *testing.T) {
	var got string
	rt := roundTripper(func(r *http.Request) (*http.Response, error) {
		got = r.URL.String()
		return &http.Response{StatusCode: 200, Body: ioNopCloser(`{"token_ids":[1]}`), Header: http.Header{}, Request: r}, nil
	})
	c := newClient(t, render.Config{URL: "http://gw.test/tenant-a/", Transport: rt})
	_, err := c.Chat(context.Background(), []byte(`{"messages":[]}`))
	require.NoError(t, err)
	require.Equal(t, "http://gw.test/tenant-a/v1/chat/completions/render", got)
}

func TestHeaderIsSentWithEveryRender(t *testing.T) {
	var auth []string
	rt := roundTripper(func(r *http.Request) (*http.Response, error) {
		auth = append(auth, r.Header.Get("Authorization"))
		require.Equal(t, "application/json", r.Header.Get("Content-Type"))
		return &http.Response{StatusCode: 200, Body: ioNopCloser(`{"token_ids":[1]}`), Header: http.Header{}, Request: r}, nil
	})
	h := http.Header{"Authorization": {"Bearer k"}}
	c := newClient(t, render.Config{Transport: rt, Header: h})
	h.Set("Authorization", "changed after New")
	for range 2 {
		_, err := c.Chat(context.Background(), []byte(`{"messages":[]}`))
		require.NoError(t, err)
	}
	require.Equal(t, []string{"Bearer k", "Bearer k"}, auth)
}

func TestConcurrentRendersAreSafe(t *testing.T) {
	f := newFakeVLLM(t, "m")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "m", CacheBytes: 32 << 10})
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 8 {
		wg.Go(func() {
			for i := range 40 {
				body := fmt.Appendf(nil, `{"messages":[{"role":"user","content":"m%d"}]}`, (g*7+i)%23)
				r, err := c.Chat(context.Background(), body)
				if err != nil {
					errs <- err
					return
				}
				if want := len(fmt.Sprintf("m%d", (g*7+i)%23)) + 4; len(r.Request.Tokens) != want {
					errs <- fmt.Errorf("got %d tokens, want %d", len(r.Request.Tokens), want)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	s := c.Stats()
	require.Equal(t, uint64(8*40), s.Renders+s.CacheHits)
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

type nopCloser struct{ *strings.Reader }

func (nopCloser) Close() error { return nil }

func ioNopCloser(s string) nopCloser { return nopCloser{strings.NewReader(s)} }

func TestFailuresAreLoggedAtMostOnceASecondPerKind(t *testing.T) {
	srv := answer(t, 503, `{"error":{"message":"down","type":"ServiceUnavailable","code":503}}`)
	var buf bytes.Buffer
	c := newClient(t, render.Config{URL: srv.URL, Logger: slog.New(slog.NewTextHandler(&buf, nil))})
	for range 5 {
		_, err := c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
		require.ErrorIs(t, err, render.ErrUnavailable)
		_, err = c.Completions(context.Background(), []byte(`[]`))
		require.ErrorIs(t, err, render.ErrBadRequest)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Len(t, lines, 2, buf.String())
	require.Contains(t, lines[0], "kind=unavailable")
	require.Contains(t, lines[0], "backend="+srv.URL)
	require.Contains(t, lines[1], "kind=bad_request")
	s := c.Stats()
	require.Equal(t, uint64(5), s.Unavailable)
	require.Equal(t, uint64(5), s.BadRequest)
}

func TestWithLoRAKeysEveryBlockAndTheTowerConnectorsItems(t *testing.T) {
	r := render.Rendered{Request: hashing.Request{Tokens: []uint32{1, 2, 3}, CacheSalt: "s",
		MM: []hashing.MMItem{{ID: "abc", Offset: 1, Length: 2}}}}
	req := r.WithLoRA("sql-lora", false)
	require.Equal(t, "sql-lora", req.LoRAName)
	require.Equal(t, "abc", req.MM[0].ID)
	req = r.WithLoRA("sql-lora", true)
	require.Equal(t, []hashing.MMItem{{ID: "sql-lora:abc", Offset: 1, Length: 2}}, req.MM)
	require.Equal(t, "s", req.CacheSalt)
	require.Equal(t, "abc", r.Request.MM[0].ID, "the Rendered, maybe the cache's, is not modified")
	require.Empty(t, r.Request.LoRAName)
	require.Equal(t, r.Request, r.WithLoRA("", true))
}

func TestACachedRenderKeepsEachBodysOwnModel(t *testing.T) {
	f := newFakeVLLM(t, "base")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "base", CacheBytes: 1 << 20})
	a, err := c.Chat(context.Background(), []byte(`{"model":"lora-a","messages":[{"role":"user","content":"x"}]}`))
	require.NoError(t, err)
	b, err := c.Chat(context.Background(), []byte(`{"model":"lora-b","messages":[{"role":"user","content":"x"}]}`))
	require.NoError(t, err)
	require.Equal(t, 1, f.count(), "both bodies send the same stamped body")
	require.Equal(t, "lora-a", a.BodyModel)
	require.Equal(t, "lora-b", b.BodyModel)
	require.Equal(t, a.Request, b.Request)
}

// TestARenderOnAConnectionTheBackendDroppedIsRetried covers the race of
// keep-alive: vLLM's server closes a connection idle for 5 s
// (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a render sent on it just then gets no
// answer. A render has no side effect, so the transport may send it again
// on a new connection.
func TestARenderOnAConnectionTheBackendDroppedIsRetried(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		seen[r.RemoteAddr]++
		n := seen[r.RemoteAddr]
		mu.Unlock()
		if n == 2 { // the second render on a connection: drop it unanswered
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				_ = conn.Close()
			}
			return
		}
		_, _ = w.Write([]byte(`[{"token_ids":[1]}]`))
	}))
	t.Cleanup(srv.Close)
	c := newClient(t, render.Config{URL: srv.URL})
	for range 3 {
		_, err := c.Completions(context.Background(), []byte(`{"prompt":"x"}`))
		require.NoError(t, err)
	}
	mu.Lock()
	defer mu.Unlock()
	// The second and third renders were each dropped on a reused
	// connection and sent again on a new one.
	require.Len(t, seen, 3)
}
