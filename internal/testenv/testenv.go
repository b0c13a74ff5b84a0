// Package testenv finds what kvsource's tests share with the world outside
// their package: the repository root, its testdata (a copy of the conformance
// data and the vLLM publisher model of the read-only ../shared folder beside
// a checkout), Debian's Python with pyzmq and msgpack, and free loopback
// ports.
//
// It is for tests only.
package testenv

import (
	"bytes"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
)

// RepoRoot returns the directory holding go.mod, walking up from the test's
// working directory.
func RepoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("testenv: no go.mod above the test's directory")
		}
		dir = parent
	}
}

// Data returns a path under the repository's testdata folder, which holds
// the repository's copy of the conformance data and the interop scripts of
// ../shared (the read-only folder beside a developer's checkout), so that
// the tests run from a plain clone. TestDataEqualsShared keeps the copy equal
// to ../shared wherever that is present.
func Data(t testing.TB, elem ...string) string {
	t.Helper()
	return filepath.Join(append([]string{RepoRoot(t), "testdata"}, elem...)...)
}

// SharedDir is ../shared beside the checkout, and whether it is there.
func SharedDir(t testing.TB) (string, bool) {
	t.Helper()
	dir := filepath.Join(RepoRoot(t), "..", "shared")
	st, err := os.Stat(dir)
	return dir, err == nil && st.IsDir()
}

// MooncakeTraceEnv names a Mooncake conversation trace to use instead of
// the one in ../shared/traces.
const MooncakeTraceEnv = "KVSOURCE_MOONCAKE_TRACE"

// MooncakeTrace returns the path of the Mooncake FAST'25 conversation trace:
// $KVSOURCE_MOONCAKE_TRACE, or ../shared/traces beside the checkout. The
// trace is not part of the repository (it is 12,031 requests of someone
// else's data), so without it the test is skipped, saying where it looked.
func MooncakeTrace(t testing.TB) string {
	t.Helper()
	path := os.Getenv(MooncakeTraceEnv)
	if path == "" {
		shared, _ := SharedDir(t)
		path = filepath.Join(shared, "traces", "mooncake_conversation_trace.jsonl")
	}
	if _, err := os.Stat(path); err != nil {
		t.Skipf("no Mooncake trace (set %s): %v", MooncakeTraceEnv, err)
	}
	return path
}

// PythonPath is Debian's interpreter, the one python3-zmq and
// python3-msgpack install for.
const PythonPath = "/usr/bin/python3"

var pythonErr = sync.OnceValue(func() error {
	return exec.Command(PythonPath, "-c", "import zmq, msgpack").Run()
})

// Python returns PythonPath once it can import zmq and msgpack. Without them
// the test is skipped on a developer's machine (make deps installs them) and
// fails in CI (CI set), where a skipped interop test would pass unseen.
func Python(t testing.TB) string {
	t.Helper()
	if err := pythonErr(); err != nil {
		msg := PythonPath + " cannot import zmq and msgpack (run make deps): "
		if os.Getenv("CI") != "" {
			t.Fatalf("%s%v", msg, err)
		}
		t.Skipf("%s%v", msg, err)
	}
	return PythonPath
}

// FreePortPair returns two consecutive TCP ports on 127.0.0.1 that were
// free a moment ago, for a pod whose data-parallel rank r listens on its
// rank-0 port plus r.
func FreePortPair(t testing.TB) (int, int) {
	t.Helper()
	p := freePorts(t, 2)
	return p, p + 1
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	return freePorts(t, 1)
}

// freePorts returns the first of n consecutive free ports (see claimPort).
func freePorts(t testing.TB, n int) int {
	t.Helper()
	for range 100 {
		if p, ok := claimPort(n); ok {
			return p
		}
	}
	t.Fatalf("testenv: no %d consecutive free ports", n)
	return 0
}

// Test ports come from below Linux's ephemeral range (32768-60999 by
// default, net.ipv4.ip_local_port_range). A port the kernel chose for a
// listen on port 0 could be taken, between the check and the test's bind,
// by the kernel again: as the local port of any outgoing connection, of
// which the tests make many. A port below the range it never hands out.
const (
	portLow  = 20000
	portHigh = 32768
)

var (
	portMu      sync.Mutex
	portClaimed = map[int]bool{}
)

// claimPort picks n consecutive ports at random that no earlier call of
// this process returned and that each take a listener, and reports
// whether it found them. The random start keeps test binaries running at
// the same time apart.
func claimPort(n int) (int, bool) {
	portMu.Lock()
	defer portMu.Unlock()
	p := portLow + rand.IntN(portHigh-portLow-n+1)
	for i := range n {
		if portClaimed[p+i] {
			return 0, false
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p+i))
		if err != nil {
			return 0, false
		}
		l.Close()
	}
	for i := range n {
		portClaimed[p+i] = true
	}
	return p, true
}

// SyncBuffer is a bytes.Buffer safe for a logger writing and a test
// reading it at the same time.
type SyncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TextLogger is a text slog.Logger writing to w.
func TextLogger(w io.Writer) *slog.Logger { return slog.New(slog.NewTextHandler(w, nil)) }
