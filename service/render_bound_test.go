package service

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
)

// heldAnswer answers renders with tokens ids and then waits for release
// before it ends the answer, so that the service holds the answers being
// read; it reports each answer it started on arrived.
func heldAnswer(fake *renderFake, tokens int, release <-chan struct{}, arrived chan<- struct{}) {
	ids := []byte(strings.Repeat("151935,", tokens-1) + "7")
	answer := func(w http.ResponseWriter) bool {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"request_id":"chatcmpl-0","token_ids":[`))
		_, _ = w.Write(ids)
		w.(http.Flusher).Flush()
		arrived <- struct{}{}
		<-release
		_, _ = w.Write([]byte(`],"model":"m","features":null}`))
		return true
	}
	fake.answer.Store(&answer)
}

func TestServeCountsRenderAnswersInMaxBodyMemory(t *testing.T) {
	// Before, render answers were read beside --max-body-memory, not in it:
	// 8 slots of large answers peaked at 297-373 MiB against a 220 MiB
	// bound. Each answer here holds 90,000 token ids (charged as the array
	// that holds them doubles, to the 100,000 of --max-tokens: 923,264
	// bytes) and a 32 KiB read window: four fit in 4.5 MiB, a fifth does
	// not.
	fake := newRenderFake(t)
	s, base := startServe(t, "--render-url", fake.srv.URL, "--max-tokens", "100000", "--max-body-memory", "4.5MiB",
		"--max-inflight-requests", "16", "--request-timeout", "20s")
	release := make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // before the fake's Close, which waits for its answers
	arrived := make(chan struct{}, 16)
	heldAnswer(fake, 90_000, release, arrived)
	chat := `{"request":{"model":"m","messages":[{"role":"user","content":"hi"}]}}`
	type answer struct {
		code int
		body string
	}
	answers := make(chan answer, 5)
	for range 5 {
		go func() {
			code, body := call(t, "POST", base+"/v1/score", chat)
			answers <- answer{code, string(body)}
		}()
	}
	// Four answers fit, held by the backend before their end; the one
	// that does not is refused as an overload, read no further than the
	// budget allowed.
	a := <-answers
	require.Equal(t, http.StatusServiceUnavailable, a.code, a.body)
	require.Contains(t, a.body, "--max-body-memory")
	require.Equal(t, 1.0, rejected(s, "/v1/score", rejectOverload))
	require.Zero(t, rejected(s, "/v1/score", rejectRenderUnavailable))
	require.Eventually(t, func() bool { return s.lim.bodyBytes.Load() >= 4*4*90_000 }, 10*time.Second, 5*time.Millisecond,
		"the answers being read count against --max-body-memory")
	require.LessOrEqual(t, s.lim.bodyBytes.Load(), int64(4.5*(1<<20)))

	free()
	for range 4 {
		a := <-answers
		require.Equal(t, http.StatusOK, a.code, a.body)
	}
	require.Eventually(t, func() bool { return s.lim.bodyBytes.Load() == 0 }, 10*time.Second, 5*time.Millisecond)
}

func TestServeReadsARenderAnswerNoFurtherThanMaxTokens(t *testing.T) {
	// Before, the answer was read to its 16 MiB limit (a 502) whatever
	// --max-tokens allowed, its tokens parsed before they were counted.
	fake := newRenderFake(t)
	s, base := startServe(t, "--render-url", fake.srv.URL, "--max-tokens", "1000")
	wrote := make(chan int64, 2) // the warm-up's answer and the request's
	answer := func(w http.ResponseWriter) bool {
		w.Header().Set("Content-Type", "application/json")
		n, _ := w.Write([]byte(`{"token_ids":[`))
		total := int64(n)
		chunk := []byte(strings.Repeat("151935,", 4096))
		for range (64 << 20) / len(chunk) {
			n, err := w.Write(chunk)
			total += int64(n)
			if err != nil {
				break
			}
			w.(http.Flusher).Flush()
		}
		wrote <- total
		return true
	}
	fake.answer.Store(&answer)
	code, body := call(t, "POST", base+"/v1/score", map[string]any{"request": map[string]any{"model": "m", "messages": []map[string]any{{"role": "user", "content": "hi"}}}})
	require.Equal(t, http.StatusRequestEntityTooLarge, code, "%s", body)
	require.Contains(t, string(body), `renders to more than 1000 tokens (--max-tokens)`)
	require.Equal(t, 1.0, rejected(s, "/v1/score", rejectTokens))
	for range cap(wrote) {
		select {
		case n := <-wrote:
			require.Less(t, n, int64(16<<20), "the answer was read on past --max-tokens")
		case <-time.After(30 * time.Second):
			t.Fatal("the backend is still writing: the service did not stop reading")
		}
	}
}

func TestServeScoresAnImageWhoseAnswerCarriesItsTensors(t *testing.T) {
	// vLLM always sends the processed tensors: a 1024x1024 image's answer
	// is about 33 MiB. Before, any answer over a fixed 16 MiB was a 502.
	fake := newRenderFake(t)
	tensor := strings.Repeat("QUFB", (20<<20)/4)
	url := "https://example.com/1024x1024.png"
	tokens := append([]uint32{1, 2}, make([]uint32, 48)...)
	tokens = append(tokens, 5, 6)
	ids, err := json.Marshal(tokens)
	require.NoError(t, err)
	answer := []byte(`{"token_ids":` + string(ids) + `,"model":"m","features":{"mm_hashes":{"image":["` + strings.Repeat("a", 64) +
		`"]},"mm_placeholders":{"image":[{"offset":2,"length":48}]},"kwargs_data":{"image":["` + tensor + `"]},"mm_metadata":null}}`)
	write := func(w http.ResponseWriter) bool {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(answer)
		return true
	}
	fake.answer.Store(&write)
	chat := map[string]any{"request": map[string]any{"model": "m", "messages": []map[string]any{{"role": "user", "content": []map[string]any{
		{"type": "image_url", "image_url": map[string]any{"url": url}}}}}}}
	_, base := startServe(t, "--render-url", fake.srv.URL)
	code, body := call(t, "POST", base+"/v1/score", chat)
	require.Equal(t, http.StatusOK, code, "%s", body)

	// The bound on bytes read is --render-max-response-bytes.
	s, base := startServe(t, "--render-url", fake.srv.URL, "--render-max-response-bytes", "1MiB")
	code, body = call(t, "POST", base+"/v1/score", chat)
	require.Equal(t, http.StatusBadGateway, code, "%s", body)
	require.Contains(t, string(body), "exceeds Config.MaxResponseBytes (1048576)")
	require.Equal(t, 1.0, rejected(s, "/v1/score", rejectRenderBadResponse))
	_, err = parseFlags([]string{"--render-max-response-bytes", "-1"}, &bytes.Buffer{})
	require.Error(t, err)
}

func TestServeRendersAnAnthropicMessagesBodyWithItsSystemPrompt(t *testing.T) {
	// Before, it went to the chat endpoint, which dropped its top-level
	// system prompt: other tokens, silently.
	fake := newRenderFake(t)
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0", "--render-url", fake.srv.URL)
	system := strings.Repeat("You are a terse assistant. ", 4)
	tokens := []uint32{1, 4}
	for i := range len(system) {
		tokens = append(tokens, uint32(system[i])+100)
	}
	tokens = append(tokens, 5)
	tokens = append(tokens, chatTokens("hi")[1:]...)
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	newServeFeeder(t, s).store("127.0.0.1:8002", "m", "GPU", keys)
	messages := map[string]any{"model": "m", "max_tokens": 64, "system": system, "messages": []map[string]any{{"role": "user", "content": "hi"}}}
	code, body := call(t, "POST", base+"/v1/score", map[string]any{"request": messages})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Contains(t, string(body), fmt.Sprintf(`"matched_blocks":%d`, len(keys)))
	code, body = call(t, "POST", base+"/v1/score", messages)
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Contains(t, string(body), fmt.Sprintf(`"matched_blocks":%d`, len(keys)), "a messages body itself")
}

func TestServeNamesTheRenderBackendAndFlagWhoseDeadlinePassed(t *testing.T) {
	// Before, a render that timed out was answered as a --request-timeout
	// and counted as reason=timeout, not render_unavailable.
	fake := newRenderFake(t)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	hang := func(http.ResponseWriter) bool { <-release; return true }
	fake.answer.Store(&hang)
	text := map[string]any{"request": map[string]any{"model": "m", "messages": []map[string]any{{"role": "user", "content": "hi"}}}}
	image := map[string]any{"request": map[string]any{"model": "m", "messages": []map[string]any{{"role": "user", "content": []map[string]any{
		{"type": "image_url", "image_url": map[string]any{"url": "https://example.com/a.png"}}}}}}}
	for _, tc := range []struct {
		name string
		args []string
		body map[string]any
		want string
	}{
		{"--render-timeout", []string{"--render-timeout", "100ms", "--request-timeout", "10s"}, text, "within 100ms (--render-timeout)"},
		{"--render-mm-timeout", []string{"--render-mm-timeout", "150ms", "--request-timeout", "10s"}, image, "within 150ms (--render-mm-timeout)"},
		{"--request-timeout", []string{"--render-timeout", "10s", "--request-timeout", "200ms"}, text, "within what was left of --request-timeout (200ms)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, base := startServe(t, append([]string{"--render-url", fake.srv.URL}, tc.args...)...)
			data, err := json.Marshal(tc.body)
			require.NoError(t, err)
			resp, err := http.Post(base+"/v1/score", "application/json", bytes.NewReader(data))
			require.NoError(t, err)
			var e ErrorResponse
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&e))
			resp.Body.Close()
			require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, e.Error)
			require.Equal(t, "1", resp.Header.Get("Retry-After"))
			require.Contains(t, e.Error, "render backend unavailable (--render-url): no answer from "+fake.srv.URL+" "+tc.want)
			require.Equal(t, 1.0, rejected(s, "/v1/score", rejectRenderUnavailable))
			require.Zero(t, rejected(s, "/v1/score", rejectTimeout))
		})
	}
}
