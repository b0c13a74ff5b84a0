package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/hashing"
)

// serveBinary is a running kvsource serve process.
type serveBinary struct {
	cmd    *exec.Cmd
	base   string // http://HOST:PORT
	stderr *strings.Builder
	done   chan error
}

// buildServeBinary builds the kvsource command into a temporary directory.
func buildServeBinary(t *testing.T) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	}
	bin := filepath.Join(t.TempDir(), "kvsource")
	out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build:\n%s", out)
	return bin
}

func startServeBinary(t *testing.T, bin string, args ...string) *serveBinary {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"serve", "--http", "127.0.0.1:0"}, args...)...)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	b := &serveBinary{cmd: cmd, stderr: &strings.Builder{}, done: make(chan error, 1)}
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
func (b *serveBinary) stop(t *testing.T) {
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
	bindPort := serveFreePort(t)
	const pod, model = "10.0.0.7:8000", "m"

	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 8*16)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)

	srv := startServeBinary(t, bin, "--events-bind", fmt.Sprintf("tcp://127.0.0.1:%d", bindPort))
	pub, err := events.NewPublisher(events.PublisherConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", bindPort), Topic: "kv@" + pod + "@" + model})
	require.NoError(t, err)
	defer pub.Close()
	batch := &events.Batch{Events: []events.Event{
		{Type: events.EventBlockStored, BlockHashes: keys, TokenIDs: tokens, BlockSize: 16, Medium: "GPU"},
		{Type: events.EventBlockStored, BlockHashes: keys[:6], TokenIDs: tokens[:6*16], BlockSize: 16, Medium: "CPU"},
	}}
	// A PUB socket drops what it sends before the subscription reaches it,
	// and on a loaded machine that can take a while: publish (idempotent
	// stores) until the service shows the blocks.
	var sent time.Time
	require.Eventually(t, func() bool {
		var resp struct{ Pods []servePodJSON }
		code, body := serveCall(t, "GET", srv.base+"/v1/pods", nil)
		if code == http.StatusOK && json.Unmarshal(body, &resp) == nil && len(resp.Pods) == 1 &&
			resp.Pods[0].Blocks["GPU"] == 8 && resp.Pods[0].Blocks["CPU"] == 6 {
			return true
		}
		if time.Since(sent) > 300*time.Millisecond {
			_, err := pub.Publish(batch)
			require.NoError(t, err)
			sent = time.Now()
		}
		return false
	}, 15*time.Second, 20*time.Millisecond)

	code, body := serveCall(t, "POST", srv.base+"/v1/pick", map[string]any{
		"model": model, "tokens": tokens, "destination": "10.0.0.8:8000", "request_id": "r"})
	require.Equal(t, http.StatusOK, code, "%s", body)
	var d servePickResponse
	require.NoError(t, json.Unmarshal(body, &d))
	require.Equal(t, "pull", string(d.Reason))
	require.Equal(t, pod, *d.Source)
	require.Equal(t, 6, d.SourceBlocks)
	srv.stop(t)
	require.Contains(t, srv.stderr.String(), "shutting down")
}
