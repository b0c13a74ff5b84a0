package service

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/internal/testenv"
)

// binaryService is a running kvsource serve process.
type binaryService struct {
	cmd    *exec.Cmd
	base   string // http://HOST:PORT
	stderr *syncBuffer
	done   chan error
}

// syncBuffer collects a process's stderr while the test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// waitLog waits until the process has logged text.
func (b *binaryService) waitLog(t testing.TB, text string) {
	t.Helper()
	require.Eventually(t, func() bool { return strings.Contains(b.stderr.String(), text) }, 10*time.Second, 10*time.Millisecond,
		"no %q in stderr:\n%s", text, b.stderr.String())
}

// buildServeBinary builds the kvsource command into a temporary directory.
func buildServeBinary(t testing.TB) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	}
	bin := filepath.Join(t.TempDir(), "kvsource")
	out, err := exec.Command(goTool, "build", "-o", bin, "github.com/kvsource/kvsource/cmd/kvsource").CombinedOutput()
	require.NoError(t, err, "go build:\n%s", out)
	return bin
}

func startServeBinary(t testing.TB, bin string, args ...string) *binaryService {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"serve", "--http", "127.0.0.1:0"}, args...)...)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	b := &binaryService{cmd: cmd, stderr: &syncBuffer{}, done: make(chan error, 1)}
	cmd.Stderr = b.stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-b.done
		}
		if t.Failed() {
			t.Logf("kvsource serve %v stderr:\n%s", args, b.stderr.String())
		}
	})
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "kvsource serve: listening on "); ok {
				addr <- a
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
		b.done <- cmd.Wait()
	}()
	select {
	case b.base = <-addr:
	case <-time.After(10 * time.Second):
		t.Fatalf("kvsource serve did not report its address; stderr:\n%s", b.stderr.String())
	}
	return b
}

// stop sends SIGTERM and requires a clean exit.
func (b *binaryService) stop(t testing.TB) {
	t.Helper()
	require.NoError(t, b.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-b.done:
		require.NoError(t, err, "stderr:\n%s", b.stderr.String())
	case <-time.After(15 * time.Second):
		t.Fatalf("kvsource serve did not exit on SIGTERM; stderr:\n%s", b.stderr.String())
	}
}

func TestServeBinaryServesEventsAndStopsOnSIGTERM(t *testing.T) {
	bin := buildServeBinary(t)
	const pod, model = "127.0.0.1:8007", "m"
	eng := newServeBinaryEngine(t, pod, model, 1)
	tokens := eng.tokens
	srv := startServeBinary(t, bin, eng.args...)
	eng.storePrompt(srv.base)

	code, body := call(t, "POST", srv.base+"/v1/pick", map[string]any{
		"model": model, "tokens": tokens, "destination": "127.0.0.1:8008", "request_id": "r"})
	require.Equal(t, http.StatusOK, code, "%s", body)
	var d PickResponse
	require.NoError(t, json.Unmarshal(body, &d))
	require.Equal(t, "pull", string(d.Reason))
	require.Equal(t, pod, *d.Source)
	require.Equal(t, 6, d.SourceBlocks)
	srv.stop(t)
	srv.waitLog(t, "shutting down")
}

func TestServeBinaryKeepsItsIndexAcrossRestarts(t *testing.T) {
	bin := buildServeBinary(t)
	dir := t.TempDir()
	snapshot := filepath.Join(dir, "index.snap")
	const pod, model = "127.0.0.1:8007", "m"
	// One engine across both service runs: its sequence numbers go on.
	eng := newServeBinaryEngine(t, pod, model, 3)
	args := append(eng.args, "--snapshot", snapshot)
	tokens, keys := eng.tokens, eng.keys
	publishUntil := eng.publishUntil

	first := startServeBinary(t, bin, args...)
	first.waitLog(t, "no snapshot yet")
	st := eng.storePrompt(first.base)
	first.stop(t)
	first.waitLog(t, "snapshot saved")

	// The restarted service answers from the snapshot before any event.
	second := startServeBinary(t, bin, args...)
	second.waitLog(t, "snapshot loaded")
	pick := func(base string) PickResponse {
		code, body := call(t, "POST", base+"/v1/pick", map[string]any{
			"model": model, "tokens": tokens, "destination": "127.0.0.1:8008", "request_id": "r"})
		require.Equal(t, http.StatusOK, code, "%s", body)
		var d PickResponse
		require.NoError(t, json.Unmarshal(body, &d))
		return d
	}
	// Known only from the snapshot, the holder scores but serves no pull
	// until its engine is heard from again.
	d := pick(second.base)
	require.Equal(t, "no_live_source", string(d.Reason))
	require.Nil(t, d.Source)
	require.Equal(t, 1, d.SkippedSources)
	require.Equal(t, "stale", d.SkippedState)
	restored, ok := eng.podState(second.base)
	require.True(t, ok)
	require.Equal(t, "stale", restored.State)
	require.Equal(t, map[string]int{"GPU": 8, "CPU": 6}, restored.Blocks)

	// The engine's next batches follow on the saved sequence number; any
	// the restarted subscriber missed are replayed, none is a restart.
	st2 := publishUntil(second.base, &events.Batch{Events: []events.Event{
		{Type: events.EventBlockRemoved, BlockHashes: keys[4:6], Medium: "CPU"},
	}}, func(p Pod) bool { return p.Blocks["CPU"] == 4 })
	require.Greater(t, st2.LastSeq, st.LastSeq)
	require.Equal(t, 8, st2.Blocks["GPU"])
	require.Equal(t, "live", st2.State)
	d = pick(second.base)
	require.Equal(t, "pull", string(d.Reason))
	require.Equal(t, pod, *d.Source)
	require.Equal(t, 4, d.SourceBlocks)
	second.stop(t)

	// A damaged snapshot stops start-up with a clear error.
	require.NoError(t, os.WriteFile(snapshot, []byte("KVSIDX\r\n garbage"), 0o600))
	out, err := exec.Command(bin, "serve", "--http", "127.0.0.1:0", "--snapshot", snapshot).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "bad snapshot")
}

// binaryEngine is one engine publishing into a built serve binary's
// --events-bind, with a replay socket, and the 8-block prompt it caches.
type binaryEngine struct {
	t      *testing.T
	pub    *zmq.Publisher
	args   []string // the binary's --events-bind and --events-replay
	bind   int      // the --events-bind port
	tokens []uint32
	keys   []uint64
	// pod, when set, is the pod podState reads among others.
	pod string
}

// newServeBinaryEngine starts the engine; the prompt's token i is mul*i.
func newServeBinaryEngine(t *testing.T, pod, model string, mul uint32) *binaryEngine {
	t.Helper()
	bindPort, replayPort := testenv.FreePort(t), testenv.FreePort(t)
	tokens, keys := binaryPrompt(t, mul)
	pub, err := zmq.NewPublisher(zmq.PublisherConfig{
		Connect: fmt.Sprintf("tcp://127.0.0.1:%d", bindPort), ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replayPort),
		Topic: "kv@" + pod + "@" + model})
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })
	return &binaryEngine{t: t, pub: pub, bind: bindPort, tokens: tokens, keys: keys, args: []string{
		"--events-bind", fmt.Sprintf("tcp://127.0.0.1:%d", bindPort),
		"--events-replay", fmt.Sprintf("%s=tcp://127.0.0.1:%d", pod, replayPort)}}
}

// binaryPrompt is an 8-block prompt whose token i is mul*i, and its
// block keys under vLLM's default hashing.
func binaryPrompt(t testing.TB, mul uint32) ([]uint32, []uint64) {
	t.Helper()
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 8*16)
	for i := range tokens {
		tokens[i] = mul * uint32(i)
	}
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	return tokens, keys
}

// podState is the engine's pod in /v1/pods: e.pod, or the service's only pod.
func (e *binaryEngine) podState(base string) (Pod, bool) {
	var resp struct{ Pods []Pod }
	code, body := call(e.t, "GET", base+"/v1/pods", nil)
	if code != http.StatusOK || json.Unmarshal(body, &resp) != nil {
		return Pod{}, false
	}
	if e.pod == "" {
		if len(resp.Pods) != 1 {
			return Pod{}, false
		}
		return resp.Pods[0], true
	}
	for _, p := range resp.Pods {
		if p.Pod == e.pod {
			return p, true
		}
	}
	return Pod{}, false
}

// storePrompt publishes that the engine holds its prompt, every block on
// GPU and the first 6 on CPU, until the service shows the pod live with
// them, and returns the pod's state then.
func (e *binaryEngine) storePrompt(base string) Pod {
	e.t.Helper()
	return e.publishUntil(base, &events.Batch{Events: []events.Event{
		{Type: events.EventBlockStored, BlockHashes: e.keys, TokenIDs: e.tokens, BlockSize: 16, Medium: "GPU"},
		{Type: events.EventBlockStored, BlockHashes: e.keys[:6], TokenIDs: e.tokens[:6*16], BlockSize: 16, Medium: "CPU"},
	}}, func(p Pod) bool { return p.Blocks["GPU"] == 8 && p.Blocks["CPU"] == 6 && p.State == "live" })
}

// publishUntil publishes b, again every 300ms (a connecting publisher's
// first messages are lost), until the pod's state satisfies done.
func (e *binaryEngine) publishUntil(base string, b *events.Batch, done func(Pod) bool) Pod {
	var sent time.Time
	var st Pod
	require.Eventually(e.t, func() bool {
		var ok bool
		if st, ok = e.podState(base); ok && done(st) {
			return true
		}
		if time.Since(sent) > 300*time.Millisecond {
			_, err := e.pub.Publish(b)
			require.NoError(e.t, err)
			sent = time.Now()
		}
		return false
	}, 15*time.Second, 20*time.Millisecond)
	return st
}
