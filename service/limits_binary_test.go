package service

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// rssPeak returns the peak resident set of process pid, in bytes
// (VmHWM).
func rssPeak(t *testing.T, pid int) int64 {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if os.IsNotExist(err) {
		t.Skip("no /proc on this system")
	}
	require.NoError(t, err)
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc/PID/status")
	return 0
}

// tokensBody is a /v1/pick body of n tokens, each written as
// "4294967295," so it is as long as n tokens can make it, with a LoRA name
// of lora bytes.
func tokensBody(n, lora int) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, `{"model":"m","destination":"127.0.0.1:8008","lora_name":%q,"tokens":[`, strings.Repeat("l", lora))
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString("4294967295")
	}
	b.WriteString("]}")
	return b.Bytes()
}

type attackResult struct {
	code    int
	err     error
	elapsed time.Duration
}

// attack posts body to url from n clients at once; chunked hides the
// body's length.
func attack(url string, body []byte, n int, chunked bool) []attackResult {
	out := make([]attackResult, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			start := time.Now()
			var r io.Reader = bytes.NewReader(body)
			if chunked {
				r = io.MultiReader(r)
			}
			resp, err := http.Post(url, "application/json", r)
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				out[i].code = resp.StatusCode
			}
			out[i].err, out[i].elapsed = err, time.Since(start)
		})
	}
	wg.Wait()
	return out
}

// TestServeBinaryBoundsTheIssuesOversizeAndOverloadAttacks replays issue
// 12's attacks on the built binary with its default limits: a 4 MiB
// lora_name with 64K tokens (45.6 s of a core before) and 16 concurrent
// 16 MiB bodies (1.97 GiB peak RSS, every client EOF before), then 16
// concurrent prompts at the limits. Every client gets a 4xx or 503 (or a
// 200) within the request timeout, and the peak RSS stays bounded.
func TestServeBinaryBoundsTheIssuesOversizeAndOverloadAttacks(t *testing.T) {
	if testing.Short() {
		t.Skip("posts about 400 MiB to the service")
	}
	bin := buildServeBinary(t)
	srv := startServeBinary(t, bin, "--max-inflight-requests", "4")
	url := srv.base + "/v1/pick"
	deadline := DefaultRequestTimeout + 2*time.Second
	report := func(name string, res []attackResult, allowed ...int) {
		t.Helper()
		codes := map[int]int{}
		var slowest time.Duration
		for _, r := range res {
			require.NoError(t, r.err, "%s: a client got no answer", name)
			require.Contains(t, allowed, r.code, name)
			require.Less(t, r.elapsed, deadline, name)
			codes[r.code]++
			slowest = max(slowest, r.elapsed)
		}
		t.Logf("%s: codes %v, slowest answer %v, peak RSS so far %d MiB", name, codes, slowest.Round(time.Millisecond), rssPeak(t, srv.cmd.Process.Pid)>>20)
	}

	report("4 MiB lora_name x 64K tokens", attack(url, tokensBody(64<<10, 4<<20), 1, false), http.StatusBadRequest)

	// 16 MiB of tokens, and the same padded with blanks after a small
	// object, which must not pass for trailing data.
	big := tokensBody(16<<20/11, 0)
	padded := bytes.Repeat([]byte(" "), 16<<20)
	copy(padded, tokensBody(1<<10, 0))
	report("16 x 16 MiB bodies, length declared", attack(url, big, 16, false), http.StatusRequestEntityTooLarge, http.StatusServiceUnavailable)
	report("16 x 16 MiB bodies, chunked", attack(url, big, 16, true), http.StatusRequestEntityTooLarge, http.StatusServiceUnavailable)
	report("16 x 16 MiB bodies, blanks after the object, chunked", attack(url, padded, 16, true), http.StatusRequestEntityTooLarge, http.StatusServiceUnavailable)

	// The largest prompt the limits admit: --max-tokens tokens, each as
	// long as a token can be, and a LoRA name of the longest allowed,
	// hashed into each of its 65,536 blocks.
	atLimit := tokensBody(DefaultMaxTokens, MaxFieldBytes)
	report("16 x prompts at the limits", attack(url, atLimit, 16, false), http.StatusOK, http.StatusServiceUnavailable)

	peak := rssPeak(t, srv.cmd.Process.Pid)
	require.Less(t, peak, int64(512<<20), "peak RSS")
	code, body := call(t, "GET", srv.base+"/metrics", nil)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, string(body), `kvsource_http_rejected_total{path="/v1/pick",reason="field_too_long"} 1`)
	require.Contains(t, string(body), `kvsource_http_rejected_total{path="/v1/pick",reason="body_too_large"}`)
	require.Contains(t, string(body), `kvsource_http_rejected_total{path="/v1/pick",reason="overload"}`)
	srv.stop(t)
}
