package service

import (
	"encoding/json"
	"fmt"
	"net/http"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
)

// liveHeap is the heap that survives collection: two, so that pooled
// buffers, dropped at the first, are gone too.
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// TestServeKeptPullsOfAMillionTokensCostWhatTheGaugeSays keeps pulls of a
// million tokens (65,536 blocks, 512 KiB of missing keys each) for
// /v1/done: each must cost about what kvsource_kept_pulls_bytes counts for
// it, not its keys.
func TestServeKeptPullsOfAMillionTokensCostWhatTheGaugeSays(t *testing.T) {
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0")
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 1<<20)
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	newServeFeeder(t, s).store("127.0.0.1:8002", "m", "CPU", keys)
	tok, err := json.Marshal(tokens)
	require.NoError(t, err)
	pick := func(id string) {
		t.Helper()
		body := fmt.Sprintf(`{"model":"m","destination":"10.0.0.1:8000","request_id":%q,"tokens":%s}`, id, tok)
		code, answer := call(t, "POST", base+"/v1/pick", body)
		require.Equal(t, http.StatusOK, code, "%.200s", answer)
		require.Contains(t, string(answer), `"reason":"pull"`)
		require.Contains(t, string(answer), `"source_blocks":65536`)
	}
	// A first pick and its release warm the hash cache and the pools.
	pick("warm")
	_, answer := call(t, "POST", base+"/v1/done", map[string]any{"request_id": "warm"})
	require.JSONEq(t, `{"released":true}`, string(answer))

	const pulls = 8
	for i := range pulls {
		pick(fmt.Sprintf("r-%02d", i))
	}
	require.Equal(t, pulls, s.pulls.m.Size())
	gauge := counterValue(s, "kvsource_kept_pulls_bytes")
	require.Equal(t, float64(pulls)*float64(keptPullBytes("r-00")), gauge)
	kept := liveHeap()
	for i := range pulls {
		_, answer := call(t, "POST", base+"/v1/done", map[string]any{"request_id": fmt.Sprintf("r-%02d", i)})
		require.JSONEq(t, `{"released":true}`, string(answer))
	}
	require.Zero(t, s.pulls.bytes.Load())
	perPull := (int64(kept) - int64(liveHeap())) / pulls
	t.Logf("%d kept pulls: %d bytes each on the heap, %.0f each by kvsource_kept_pulls_bytes", pulls, perPull, gauge/pulls)
	// Far under the 512 KiB of keys a pull; the slack is for what the
	// test's own HTTP client and the service's goroutines leave live.
	require.Less(t, perPull, int64(16<<10), "a kept pull keeps its missing keys alive")
}
