package service

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
)

// renderFake is a vLLM render endpoint as ../shared/spec/vllm.md §6 gives
// it: /v1/chat/completions/render answers one GenerateRequest, token_ids
// and, for images, features.mm_hashes and mm_placeholders per modality
// (and kwargs_data, the tensors, which vLLM always sends);
// /v1/completions/render an array of them; /v1/messages/render an
// Anthropic body, its top-level system prompt first as a system message. Its template: BOS 1, a role
// token (user 2, assistant 3, system 4), each text byte plus 100, end 5,
// generation prompt 6; an image is 48 tokens 7 hashed as the SHA-256 of
// its URL. answer, when set, answers instead.
type renderFake struct {
	srv    *httptest.Server
	calls  atomic.Int64
	answer atomic.Pointer[func(w http.ResponseWriter) bool]
}

func newRenderFake(t *testing.T) *renderFake {
	f := &renderFake{}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.calls.Add(1)
		if answer := f.answer.Load(); answer != nil && (*answer)(w) {
			return
		}
		var req struct {
			Model    string  `json:"model"`
			Prompt   string  `json:"prompt"`
			Salt     any     `json:"cache_salt"`
			System   *string `json:"system"`
			Messages []struct {
				Role    string          `json:"role"`
				Content json.RawMessage `json:"content"`
			} `json:"messages"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			vllmError(w, http.StatusBadRequest, err.Error())
			return
		}
		tokens := []uint32{1}
		hashes, places := []string{}, []map[string]int{}
		text := func(s string) {
			for i := range len(s) {
				tokens = append(tokens, uint32(s[i])+100)
			}
		}
		switch r.URL.Path {
		case "/v1/completions/render":
			text(req.Prompt)
			writeRenderJSON(w, []any{generateRequest(req.Model, tokens, nil, nil, req.Salt)})
			return
		case "/v1/chat/completions/render":
		case "/v1/messages/render":
			if req.System != nil {
				tokens = append(tokens, 4)
				text(*req.System)
				tokens = append(tokens, 5)
			}
		default:
			http.NotFound(w, r)
			return
		}
		for _, m := range req.Messages {
			tokens = append(tokens, map[string]uint32{"user": 2, "assistant": 3, "system": 4}[m.Role])
			var s string
			var parts []struct {
				Type     string `json:"type"`
				Text     string `json:"text"`
				ImageURL struct {
					URL string `json:"url"`
				} `json:"image_url"`
			}
			if json.Unmarshal(m.Content, &s) == nil {
				text(s)
			} else if err := json.Unmarshal(m.Content, &parts); err == nil {
				for _, p := range parts {
					if p.Type == "text" {
						text(p.Text)
						continue
					}
					sum := sha256.Sum256([]byte(p.ImageURL.URL))
					hashes = append(hashes, hex.EncodeToString(sum[:]))
					places = append(places, map[string]int{"offset": len(tokens), "length": 48})
					for range 48 {
						tokens = append(tokens, 7)
					}
				}
			}
			tokens = append(tokens, 5)
		}
		tokens = append(tokens, 6)
		writeRenderJSON(w, generateRequest(req.Model, tokens, hashes, places, req.Salt))
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func generateRequest(model string, tokens []uint32, hashes []string, places []map[string]int, salt any) map[string]any {
	g := map[string]any{"request_id": "chatcmpl-0", "token_ids": tokens, "features": nil, "model": model,
		"sampling_params": map[string]any{"max_tokens": 16}, "stream": false, "cache_salt": salt, "priority": 0}
	if len(hashes) > 0 {
		tensors := make([]string, len(hashes))
		for i := range tensors {
			tensors[i] = "QUFB" // an item's processed tensor, in base64
		}
		g["features"] = map[string]any{"mm_hashes": map[string]any{"image": hashes},
			"mm_placeholders": map[string]any{"image": places}, "kwargs_data": map[string]any{"image": tensors}, "mm_metadata": nil}
	}
	return g
}

func writeRenderJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

func vllmError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "type": "BadRequestError", "code": code}})
}

// chatTokens are the fake's tokens of a one-message chat of text.
func chatTokens(text string) []uint32 {
	out := []uint32{1, 2}
	for i := range len(text) {
		out = append(out, uint32(text[i])+100)
	}
	return append(out, 5, 6)
}

func TestServeRendersAChatBodyAndScoresItAsItsTokens(t *testing.T) {
	fake := newRenderFake(t)
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0", "--render-url", fake.srv.URL)
	text := strings.Repeat("You are a helpful assistant. ", 6) // 4+ blocks of 16
	tokens := chatTokens(text)
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(keys), 4)
	newServeFeeder(t, s).store("127.0.0.1:8002", "m", "GPU", keys)
	chat := map[string]any{"model": "m", "messages": []map[string]any{{"role": "user", "content": text}}, "temperature": 0.2}

	_, byTokens := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": tokens})
	code, inRequest := call(t, "POST", base+"/v1/score", map[string]any{"request": chat})
	require.Equal(t, http.StatusOK, code, "%s", inRequest)
	require.JSONEq(t, string(byTokens), string(inRequest))
	require.Contains(t, string(inRequest), fmt.Sprintf(`"matched_blocks":%d`, len(keys)))
	code, whole := call(t, "POST", base+"/v1/score", chat)
	require.Equal(t, http.StatusOK, code, "%s", whole)
	require.JSONEq(t, string(byTokens), string(whole), "an OpenAI body itself scores as its tokens")

	// A pick takes it beside its destination.
	_, pickTokens := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": "10.0.0.1:8000", "request_id": "a"})
	code, pickReq := call(t, "POST", base+"/v1/pick", map[string]any{"request": chat, "destination": "10.0.0.1:8000", "request_id": "a"})
	require.Equal(t, http.StatusOK, code, "%s", pickReq)
	require.JSONEq(t, string(pickTokens), string(pickReq))
	code, body := call(t, "POST", base+"/v1/pick", chat)
	require.Equal(t, http.StatusBadRequest, code)
	require.Contains(t, string(body), `beside \"destination\"`)

	// Tokens, when given, win: the backend is not asked.
	calls := fake.calls.Load()
	_, both := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": tokens, "request": map[string]any{"model": "m", "prompt": "other"}})
	require.JSONEq(t, string(byTokens), string(both))
	require.Equal(t, calls, fake.calls.Load())
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Contains(t, string(metrics), `kvsource_render_seconds_count{endpoint="chat",result="ok"}`)
}

func TestServeRendersImagesAtTheirPlaceholdersAsVLLMKeysThem(t *testing.T) {
	fake := newRenderFake(t)
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0", "--render-url", fake.srv.URL)
	url := "https://example.com/cat.png"
	chat := map[string]any{"model": "m", "cache_salt": "tenant-1", "messages": []map[string]any{{"role": "user", "content": []map[string]any{
		{"type": "text", "text": "What is in this picture, in detail?"},
		{"type": "image_url", "image_url": map[string]any{"url": url}},
	}}}}
	// What the engine hashes: its tokens with the image's hash at its
	// placeholder, and the salt.
	tokens := append([]uint32{1, 2}, chatTokens("What is in this picture, in detail?")[2:37]...)
	offset := len(tokens)
	for range 48 {
		tokens = append(tokens, 7)
	}
	tokens = append(tokens, 5, 6)
	sum := sha256.Sum256([]byte(url))
	engine := map[string]any{"model": "m", "tokens": tokens, "cache_salt": "tenant-1",
		"mm_items": []map[string]any{{"id": hex.EncodeToString(sum[:]), "offset": offset, "length": 48}}}
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens, CacheSalt: "tenant-1",
		MM: []hashing.MMItem{{ID: hex.EncodeToString(sum[:]), Offset: offset, Length: 48}}})
	require.NoError(t, err)
	newServeFeeder(t, s).store("127.0.0.1:8002", "m", "GPU", keys)

	_, want := call(t, "POST", base+"/v1/score", engine)
	require.Contains(t, string(want), fmt.Sprintf(`"matched_blocks":%d`, len(keys)))
	code, got := call(t, "POST", base+"/v1/score", map[string]any{"request": chat})
	require.Equal(t, http.StatusOK, code, "%s", got)
	require.JSONEq(t, string(want), string(got))
	// Another image is another prompt from its placeholder on.
	chat["messages"].([]map[string]any)[0]["content"].([]map[string]any)[1]["image_url"] = map[string]any{"url": "https://example.com/dog.png"}
	_, other := call(t, "POST", base+"/v1/score", map[string]any{"request": chat})
	require.Contains(t, string(other), fmt.Sprintf(`"matched_blocks":%d`, offset/16))
}

func TestServeAnswersRenderFailuresClearlyNeverWithAZeroScore(t *testing.T) {
	down := httptest.NewServer(http.NotFoundHandler())
	downURL := down.URL
	down.Close() // nothing listens there now
	chat := map[string]any{"request": map[string]any{"model": "m", "messages": []map[string]any{{"role": "user", "content": "hi"}}}}

	_, base := startServe(t)
	code, body := call(t, "POST", base+"/v1/score", chat)
	require.Equal(t, http.StatusBadRequest, code)
	require.Contains(t, string(body), "--render-url")

	s, base := startServe(t, "--render-url", downURL)
	resp, err := http.Post(base+"/v1/score", "application/json", strings.NewReader(`{"request":{"model":"m","messages":[{"role":"user","content":"hi"}]}}`))
	require.NoError(t, err)
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "%s", msg)
	require.Equal(t, "1", resp.Header.Get("Retry-After"))
	require.Contains(t, string(msg), "render backend unavailable (--render-url)")
	require.Equal(t, 1.0, rejected(s, "/v1/score", rejectRenderUnavailable))

	fake := newRenderFake(t)
	s, base = startServe(t, "--render-url", fake.srv.URL)
	for _, tc := range []struct {
		name   string
		answer func(w http.ResponseWriter)
		code   int
		reason string
		want   string
	}{
		{"vLLM refuses the body", func(w http.ResponseWriter) { vllmError(w, http.StatusBadRequest, "messages: Field required") },
			http.StatusBadRequest, rejectBadRequest, "messages: Field required"},
		{"vLLM is overloaded", func(w http.ResponseWriter) { vllmError(w, http.StatusServiceUnavailable, "busy") },
			http.StatusServiceUnavailable, rejectRenderUnavailable, "render backend unavailable"},
		{"the answer is not vLLM's", func(w http.ResponseWriter) { writeRenderJSON(w, map[string]any{"token_ids": "nope"}) },
			http.StatusBadGateway, rejectRenderBadResponse, "render backend gave a bad answer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			answer := func(w http.ResponseWriter) bool { tc.answer(w); return true }
			fake.answer.Store(&answer)
			before := rejected(s, "/v1/score", tc.reason)
			code, body := call(t, "POST", base+"/v1/score", chat)
			require.Equal(t, tc.code, code, "%s", body)
			require.Contains(t, string(body), tc.want)
			require.Equal(t, before+1, rejected(s, "/v1/score", tc.reason))
		})
	}
}
