package render

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// benchAnswer is a chat render's answer of n tokens with vLLM's other
// members, ids spread like a real vocabulary's (1 to 6 digits).
func benchAnswer(n int) []byte {
	var b strings.Builder
	b.WriteString(`{"request_id":"chatcmpl-1","token_ids":[`)
	x := uint32(12345)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		x = x*1664525 + 1013904223
		fmt.Fprint(&b, x%151936)
	}
	b.WriteString(`],"features":null,"sampling_params":{"n":1,"temperature":0.7,"max_tokens":256},"model":"m","cache_salt":null,"priority":0}`)
	return []byte(b.String())
}

// BenchmarkParseAnswer compares the parser (encoding/json for the
// structure, scanTokens for token_ids) with encoding/json decoding
// token_ids into a []uint32 itself, in one binary.
func BenchmarkParseAnswer(b *testing.B) {
	for _, n := range []int{1024, 32768} {
		data := benchAnswer(n)
		b.Run(fmt.Sprintf("tokens=%d/scanner", n), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := parseAnswer(data, false); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/token")
		})
		b.Run(fmt.Sprintf("tokens=%d/encoding-json", n), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				var v struct {
					TokenIDs []uint32      `json:"token_ids"`
					Features *wireFeatures `json:"features"`
					Model    *string       `json:"model"`
				}
				if err := json.Unmarshal(data, &v); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/token")
		})
	}
}

// benchChatBody is a chat body with a 1 MiB base64 image, the case the
// scanner exists for.
func benchChatBody() []byte {
	img := base64.StdEncoding.EncodeToString(make([]byte, 768<<10))
	return []byte(`{"model":"vl","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":[` +
		`{"type":"text","text":"Describe the picture."},{"type":"image_url","image_url":{"url":"data:image/png;base64,` + img + `"}}]}],` +
		`"max_tokens":128,"temperature":0.2,"cache_salt":"tenant-7"}`)
}

// BenchmarkBody compares reading and rewriting a body with the scanner
// against decoding it into a map and marshalling it back, as a client that
// stamped the model with encoding/json would.
func BenchmarkBody(b *testing.B) {
	body := benchChatBody()
	b.Run("scanner", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			info, err := scanBody(body)
			if err != nil || !info.parts {
				b.Fatal(err)
			}
			_ = rewrite(body, &info, "vl", true)
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			var m map[string]json.RawMessage
			if err := json.Unmarshal(body, &m); err != nil {
				b.Fatal(err)
			}
			m["model"] = json.RawMessage(`"vl"`)
			m["return_mm_kwargs"] = json.RawMessage(`false`)
			if _, err := json.Marshal(m); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkRender measures a whole render over loopback HTTP/1.1 against a
// backend that answers at once (so it is the client's and the transport's
// cost, not vLLM's), and a render answered from the cache.
func BenchmarkRender(b *testing.B) {
	answer := benchAnswer(4096)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = r.Body.Read(make([]byte, 512))
		_, _ = w.Write(answer)
	}))
	defer srv.Close()
	body := []byte(`{"messages":[{"role":"user","content":"Hello there, how are you today?"}]}`)
	for _, cached := range []bool{false, true} {
		b.Run(fmt.Sprintf("cached=%v", cached), func(b *testing.B) {
			cfg := Config{URL: srv.URL, Model: "m", Logger: slog.New(slog.DiscardHandler)}
			if cached {
				cfg.CacheBytes = 1 << 20
			}
			c, err := New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.Chat(context.Background(), body); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/render")
		})
	}
}
