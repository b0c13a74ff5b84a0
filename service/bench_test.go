package service

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// benchFleet returns a service without a hash cache (its answers then
// cost what the SDK's uncached Pick costs, plus the request path) and the
// fleet of picker's benchFleet for a prompt of n tokens with the same
// tokens: the destination holds a quarter of the prompt on GPU, 63 peers
// CPU prefixes of various lengths (every fourth the whole prompt) and GPU
// copies of half of those. The pick body names the first eight peers as
// candidates.
func benchFleet(tb testing.TB, n int, args ...string) (*Service, []byte, []uint32) {
	// The fleet publishes its blocks as engines do, so that its holders
	// are live pull sources; its made-up 10.1.x.y names need the sender
	// check off.
	cfg, err := parseFlags(append([]string{"--http", "127.0.0.1:0", "--hash-cache-bytes", "0",
		"--events-bind", "tcp://127.0.0.1:0", "--events-no-sender-check", "--events-max-pods-per-sender", "128"}, args...), io.Discard)
	require.NoError(tb, err)
	s, err := newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(tb, err)
	require.NoError(tb, s.Start(context.Background()))
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(tb, s.Shutdown(ctx))
	})
	feed := newServeFeeder(tb, s)
	tokens := make([]uint32, n)
	for i := range tokens {
		tokens[i] = uint32(i*2654435761) % 150000
	}
	keys, err := s.hasher.BlockKeys(nil, hashingRequest(tokens))
	require.NoError(tb, err)
	nb := len(keys)
	const holders = 64
	feed.store("127.0.0.1:8001", "m", "GPU", keys[:nb/4])
	var cands []map[string]any
	for i := 1; i < holders; i++ {
		peer := index.Holder{Pod: fmt.Sprintf("10.1.%d.%d:8000", i/256, i%256)}
		cpu := nb
		if i%4 != 0 {
			cpu = nb * (holders - i) / holders
		}
		feed.store(peer.Pod, "m", "CPU", keys[:cpu])
		feed.store(peer.Pod, "m", "GPU", keys[:cpu/2])
		if len(cands) < 8 {
			cands = append(cands, map[string]any{"pod": peer.Pod, "dp_rank": 0, "waiting": i % 5})
		}
	}
	body, err := json.Marshal(map[string]any{"model": "m", "tokens": tokens, "request_id": "bench-1",
		"destination": "127.0.0.1:8001", "candidates": cands})
	require.NoError(tb, err)
	return s, body, tokens
}

// discardWriter is a ResponseWriter that keeps nothing but its header
// map, so that the benchmark measures the handler rather than a recorder.
// It flushes, as the server's writer does: the handler counts an answer it
// cannot flush as aborted.
type discardWriter struct {
	h    http.Header
	code int
	n    int
}

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) WriteHeader(code int)        { w.code = code }
func (w *discardWriter) Write(p []byte) (int, error) { w.n += len(p); return len(p), nil }
func (w *discardWriter) Flush()                      {}

// BenchmarkServe runs the service's handler (mux, limits, metrics, decode,
// hash, pick, encode; no network) on a 20,000-token JSON /v1/pick body over
// a 64-holder fleet. Each iteration also runs the SDK's Pick with hashing
// on the same request right after: x-sdk, the ratio of the two times, is
// BenchmarkServe/pick-20k over BenchmarkPick/hashing-20k measured under the
// same load.
func BenchmarkServe(b *testing.B) {
	for _, bc := range []struct {
		name string
		b64  bool
	}{{"pick-20k", false}, {"pick-20k-b64", true}} {
		b.Run(bc.name, func(b *testing.B) {
			s, body, tokens := benchFleet(b, 20000)
			if bc.b64 {
				var m map[string]any
				require.NoError(b, json.Unmarshal(body, &m))
				delete(m, "tokens")
				m["tokens_b64"] = tokensB64(tokens)
				var err error
				body, err = json.Marshal(m)
				require.NoError(b, err)
			}
			h := s.http.Handler
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/pick", bytes.NewReader(body)))
			require.Equal(b, http.StatusOK, rec.Code, "%s", rec.Body)
			require.Contains(b, rec.Body.String(), `"reason":"pull"`)

			var preq picker.Request
			preq.ID, preq.Model, preq.Destination = "bench-1", "m", index.Holder{Pod: "127.0.0.1:8001"}
			preq.Prompt = hashingRequest(tokens)
			for i := 1; i <= 8; i++ {
				preq.Candidates = append(preq.Candidates, picker.Candidate{Holder: index.Holder{Pod: fmt.Sprintf("10.1.0.%d:8000", i)}, Waiting: i % 5})
			}
			rd := bytes.NewReader(body)
			req := httptest.NewRequest(http.MethodPost, "/v1/pick", rd)
			w := &discardWriter{h: http.Header{}}
			var handler, sdk time.Duration
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				rd.Reset(body)
				req.Body = io.NopCloser(rd)
				clear(w.h)
				w.code = 0
				t0 := time.Now()
				h.ServeHTTP(w, req)
				t1 := time.Now()
				d, err := s.pk.Pick(preq)
				sdk += time.Since(t1)
				handler += t1.Sub(t0)
				if w.code != http.StatusOK || err != nil || d.Reason != picker.ReasonPull {
					b.Fatal(w.code, err, d.Reason)
				}
				d.Done()
			}
			b.ReportMetric(float64(handler.Nanoseconds())/float64(b.N), "ns/request")
			b.ReportMetric(float64(sdk.Nanoseconds())/float64(b.N), "ns/sdk-pick")
			b.ReportMetric(float64(handler)/float64(sdk), "x-sdk")
		})
	}
}

func hashingRequest(tokens []uint32) hashing.Request { return hashing.Request{Tokens: tokens} }
