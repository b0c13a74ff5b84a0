package render_test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// The fake's vocabulary: a chat template of role markers around each
// message, a generation prompt, and each byte of text one token (its value
// plus 100). An image is imageTokens placeholder tokens.
const (
	tokBOS         = 1
	tokUser        = 2
	tokAssistant   = 3
	tokSystem      = 4
	tokEnd         = 5
	tokGenPrompt   = 6
	tokImage       = 7
	imageTokens    = 40
	textTokenShift = 100
)

// fakeVLLM speaks vLLM's render endpoints as vllm/entrypoints/serve/render
// and token_in_token_out/protocol.py give them: the completions endpoint
// answers an array of GenerateRequests, the chat and messages endpoints
// one; features carry mm_hashes and mm_placeholders per modality, and
// kwargs_data (the tensors, 4 KiB of base64 an item) whatever the body
// says, as vLLM's render requests have no field to leave them out;
// cache_salt and model are echoed. The messages endpoint renders an
// Anthropic body's top-level system prompt first, as a system message.
// Errors are vLLM's ErrorResponse JSON.
type fakeVLLM struct {
	t   *testing.T
	srv *httptest.Server

	mu       sync.Mutex
	bodies   [][]byte // every body received, in order
	remotes  map[string]int
	requests int
	protos   []string

	// requireModel answers 404 to a body without the served model, as a
	// render-only server does.
	served string
	// handle, when set, answers instead of the template.
	handle func(w http.ResponseWriter, r *http.Request, body []byte) bool
	paths  []string // every path posted to, in order
}

func newFakeVLLM(t *testing.T, served string) *fakeVLLM {
	f := &fakeVLLM{t: t, served: served, remotes: map[string]int{}}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeVLLM) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return
	}
	f.mu.Lock()
	f.bodies = append(f.bodies, body)
	f.remotes[r.RemoteAddr]++
	f.requests++
	f.protos = append(f.protos, r.Proto)
	f.paths = append(f.paths, r.URL.Path)
	handle := f.handle
	f.mu.Unlock()
	if handle != nil && handle(w, r, body) {
		return
	}
	var req map[string]any
	if err := json.Unmarshal(body, &req); err != nil {
		vllmErrorAnswer(w, http.StatusBadRequest, "BadRequestError", "invalid JSON: "+err.Error())
		return
	}
	model, _ := req["model"].(string)
	if model != f.served {
		vllmErrorAnswer(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", model))
		return
	}
	switch r.URL.Path {
	case "/v1/chat/completions/render", "/v1/messages/render":
		msgs, ok := req["messages"].([]any)
		if !ok {
			vllmErrorAnswer(w, http.StatusBadRequest, "BadRequestError", "messages: Field required")
			return
		}
		if sys, ok := req["system"]; ok && r.URL.Path == "/v1/messages/render" {
			msgs = append([]any{map[string]any{"role": "system", "content": sys}}, msgs...)
		}
		tokens, feats, err := chatTemplate(msgs, req["add_generation_prompt"] != false)
		if err != nil {
			vllmErrorAnswer(w, http.StatusBadRequest, "BadRequestError", err.Error())
			return
		}
		writeJSON(w, generateRequest(model, tokens, feats, req["cache_salt"]))
	case "/v1/completions/render":
		var prompts []string
		switch p := req["prompt"].(type) {
		case string:
			prompts = []string{p}
		case []any:
			for _, e := range p {
				s, _ := e.(string)
				prompts = append(prompts, s)
			}
		default:
			vllmErrorAnswer(w, http.StatusBadRequest, "BadRequestError", "prompt: Field required")
			return
		}
		var out []any
		for _, p := range prompts {
			out = append(out, generateRequest(model, append([]uint32{tokBOS}, textTokens(p)...), nil, req["cache_salt"]))
		}
		writeJSON(w, out)
	default:
		http.NotFound(w, r)
	}
}

type features struct {
	hashes       map[string][]string
	placeholders map[string][]map[string]int
}

// chatTemplate renders messages the fake's way; images and audio are
// items whose hash is the SHA-256 of their URL or data.
func chatTemplate(msgs []any, genPrompt bool) ([]uint32, *features, error) {
	tokens := []uint32{tokBOS}
	var feats *features
	for i, m := range msgs {
		msg, ok := m.(map[string]any)
		if !ok {
			return nil, nil, fmt.Errorf("messages[%d]: not an object", i)
		}
		switch msg["role"] {
		case "user":
			tokens = append(tokens, tokUser)
		case "assistant":
			tokens = append(tokens, tokAssistant)
		case "system":
			tokens = append(tokens, tokSystem)
		default:
			return nil, nil, fmt.Errorf("messages[%d]: unknown role %v", i, msg["role"])
		}
		switch c := msg["content"].(type) {
		case string:
			tokens = append(tokens, textTokens(c)...)
		case []any:
			for _, p := range c {
				part, _ := p.(map[string]any)
				switch part["type"] {
				case "text":
					s, _ := part["text"].(string)
					tokens = append(tokens, textTokens(s)...)
				case "image_url":
					iu, _ := part["image_url"].(map[string]any)
					u, _ := iu["url"].(string)
					if feats == nil {
						feats = &features{hashes: map[string][]string{}, placeholders: map[string][]map[string]int{}}
					}
					sum := sha256.Sum256([]byte(u))
					feats.hashes["image"] = append(feats.hashes["image"], hex.EncodeToString(sum[:]))
					feats.placeholders["image"] = append(feats.placeholders["image"], map[string]int{"offset": len(tokens), "length": imageTokens})
					for range imageTokens {
						tokens = append(tokens, tokImage)
					}
				default:
					return nil, nil, fmt.Errorf("unknown part type %v", part["type"])
				}
			}
		default:
			return nil, nil, fmt.Errorf("messages[%d]: content must be a string or a list of parts", i)
		}
		tokens = append(tokens, tokEnd)
	}
	if genPrompt {
		tokens = append(tokens, tokGenPrompt)
	}
	return tokens, feats, nil
}

func textTokens(s string) []uint32 {
	out := make([]uint32, len(s))
	for i := range len(s) {
		out[i] = uint32(s[i]) + textTokenShift
	}
	return out
}

// generateRequest is vLLM's GenerateRequest as its render endpoints
// serialise it, sampling_params and all.
func generateRequest(model string, tokens []uint32, feats *features, salt any) map[string]any {
	g := map[string]any{
		"request_id": "chatcmpl-0123456789abcdef",
		"token_ids":  tokens,
		"features":   nil,
		"sampling_params": map[string]any{
			"n": 1, "temperature": 1.0, "max_tokens": 16, "stop": []string{}, "detokenize": true,
		},
		"model":          model,
		"stream":         false,
		"stream_options": nil,
		"cache_salt":     salt,
		"priority":       0,
		"token_offsets":  nil,
	}
	if feats != nil {
		data := map[string][]string{}
		for m, hs := range feats.hashes {
			for range hs {
				data[m] = append(data[m], strings.Repeat("QUFB", 1024)) // a tensor's base64
			}
		}
		g["features"] = map[string]any{"mm_hashes": feats.hashes, "mm_placeholders": feats.placeholders, "kwargs_data": data, "mm_metadata": nil}
	}
	return g
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// vllmErrorAnswer is vLLM's ErrorResponse of 2025 on.
func vllmErrorAnswer(w http.ResponseWriter, status int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": status}})
}

func (f *fakeVLLM) lastBody() map[string]any {
	f.t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	require.NotEmpty(f.t, f.bodies)
	var m map[string]any
	require.NoError(f.t, json.Unmarshal(f.bodies[len(f.bodies)-1], &m))
	return m
}

func (f *fakeVLLM) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests
}
