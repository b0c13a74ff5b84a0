package render_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/render"
)

// endlessTokens answers a chat render whose token_ids never end (up to
// 64 MiB of them), and reports the bytes it wrote once the client hung up.
func endlessTokens(t *testing.T) (*httptest.Server, <-chan int64) {
	wrote := make(chan int64, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
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
	}))
	t.Cleanup(srv.Close)
	return srv, wrote
}

func TestAnAnswerIsReadNoFurtherThanMaxTokensAllows(t *testing.T) {
	// Before, the answer was read whole (up to the 16 MiB limit, into a
	// buffer grown by doubling) and its tokens parsed before any token
	// bound was checked.
	srv, wrote := endlessTokens(t)
	c := newClient(t, render.Config{URL: srv.URL, MaxTokens: 1000})
	_, err := c.Chat(context.Background(), []byte(`{"messages":[{"role":"user","content":"hi"}]}`))
	require.ErrorIs(t, err, render.ErrBadRequest)
	require.ErrorIs(t, err, render.ErrTooManyTokens)
	require.ErrorContains(t, err, "more than 1000")
	require.Equal(t, "bad_request", render.Kind(err))
	select {
	case n := <-wrote:
		// What the sockets' buffers took before the client hung up: far
		// from the 64 MiB the backend had to send.
		require.Less(t, n, int64(16<<20))
	case <-time.After(30 * time.Second):
		t.Fatal("the backend is still writing: the client did not stop reading")
	}
}

func TestRenderChargedIsToldOfTheAnswersMemoryBeforeItIsTaken(t *testing.T) {
	f := newFakeVLLM(t, "m")
	text := strings.Repeat("x", 50_000)
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + text + `"}]}`)
	c := newClient(t, render.Config{URL: f.srv.URL})
	var charged atomic.Int64
	rs, err := c.RenderCharged(context.Background(), body, func(n int64) error { charged.Add(n); return nil })
	require.NoError(t, err)
	tokens := int64(len(rs[0].Request.Tokens))
	require.Equal(t, int64(len(text)+4), tokens)
	// The ids (4 bytes each, doubled as they arrive) and the read window.
	require.GreaterOrEqual(t, charged.Load(), 4*tokens)
	require.LessOrEqual(t, charged.Load(), 16*tokens+64<<10)

	full := errors.New("budget spent")
	charged.Store(0)
	_, err = c.RenderCharged(context.Background(), body, func(n int64) error {
		if charged.Add(n) > 100<<10 {
			return full
		}
		return nil
	})
	require.ErrorIs(t, err, render.ErrUnavailable)
	require.ErrorIs(t, err, full)
	require.ErrorContains(t, err, "no memory for the answer")
}

func TestKwargsDataIsSkippedAsTheAnswerStreamsPastNeverHeld(t *testing.T) {
	// vLLM sends every image's processed tensors whatever the body says:
	// about 33 MiB for one of 1024x1024. Before, that answer was over the
	// fixed 16 MiB limit, a 502, and would have been buffered whole.
	url := "https://example.com/1024x1024.png"
	tokens := append(append([]uint32{tokBOS, tokUser}, textTokens("Describe it.")...), make([]uint32, imageTokens)...)
	tokens = append(tokens, tokEnd, tokGenPrompt)
	ids, err := json.Marshal(tokens)
	require.NoError(t, err)
	offset := 2 + len("Describe it.")
	answer := []byte(`{"request_id":"chatcmpl-1","features":{"kwargs_data":{"image":["` + strings.Repeat("QUFB", (33<<20)/4) +
		`"]},"mm_hashes":{"image":["` + imageHash(url) + `"]},"mm_placeholders":{"image":[{"offset":` + fmt.Sprint(offset) +
		`,"length":` + fmt.Sprint(imageTokens) + `}]},"mm_metadata":{"image":[{"shape":[3,1024,1024]}]}},"token_ids":` + string(ids) +
		`,"model":"m","sampling_params":{"max_tokens":16}}`)
	f := newFakeVLLM(t, "m")
	f.handle = func(w http.ResponseWriter, _ *http.Request, _ []byte) bool {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(answer)
		return true
	}
	body := []byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"Describe it."},{"type":"image_url","image_url":{"url":"` + url + `"}}]}]}`)
	c := newClient(t, render.Config{URL: f.srv.URL})
	var charged atomic.Int64
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	rs, err := c.RenderCharged(context.Background(), body, func(n int64) error { charged.Add(n); return nil })
	runtime.ReadMemStats(&after)
	require.NoError(t, err)
	require.Equal(t, tokens, rs[0].Request.Tokens)
	require.Equal(t, []hashing.MMItem{{ID: imageHash(url), Offset: offset, Length: imageTokens}}, rs[0].Request.MM)
	require.Less(t, charged.Load(), int64(1<<20), "what the client keeps of a 33 MiB answer")
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(4<<20), "allocated while rendering a 33 MiB answer")

	// The bound on bytes read is the client's, and still applies.
	small := newClient(t, render.Config{URL: f.srv.URL, MaxResponseBytes: 16 << 20})
	_, err = small.Chat(context.Background(), body)
	require.ErrorIs(t, err, render.ErrBadResponse)
	require.ErrorContains(t, err, "exceeds Config.MaxResponseBytes")
}

func TestAnAnthropicMessagesBodyIsRenderedByTheMessagesEndpoint(t *testing.T) {
	// Before, a body with a top-level "system" went to the chat endpoint,
	// which dropped its system prompt: other tokens, silently.
	f := newFakeVLLM(t, "m")
	body := []byte(`{"model":"m","max_tokens":64,"system":"Be brief.","messages":[{"role":"user","content":"hi"}]}`)
	want := append([]uint32{tokBOS, tokSystem}, textTokens("Be brief.")...)
	want = append(append(append(want, tokEnd, tokUser), textTokens("hi")...), tokEnd, tokGenPrompt)
	c := newClient(t, render.Config{URL: f.srv.URL})
	rs, err := c.Render(context.Background(), body)
	require.NoError(t, err)
	require.Equal(t, want, rs[0].Request.Tokens)
	r, err := c.Messages(context.Background(), body)
	require.NoError(t, err)
	require.Equal(t, want, r.Request.Tokens)
	require.Equal(t, []string{render.MessagesPath, render.MessagesPath}, f.paths)

	_, err = c.Chat(context.Background(), body)
	require.ErrorIs(t, err, render.ErrBadRequest)
	require.ErrorContains(t, err, `top-level "system": an Anthropic Messages body`)
	require.Len(t, f.paths, 2, "refused before the backend")

	// A vLLM without the endpoint says so, rather than rendering it wrong.
	old := newFakeVLLM(t, "m")
	old.handle = func(w http.ResponseWriter, r *http.Request, _ []byte) bool {
		if r.URL.Path != render.MessagesPath {
			return false
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		_, _ = fmt.Fprint(w, `{"detail":"Not Found"}`)
		return true
	}
	_, err = newClient(t, render.Config{URL: old.srv.URL}).Render(context.Background(), body)
	require.ErrorIs(t, err, render.ErrBadRequest)
	require.ErrorContains(t, err, "the backend has no /v1/messages/render")
}
