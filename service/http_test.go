package service

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// connClosedWithin reports whether the server closes conn within d;
// what it sends before closing is read and discarded.
func connClosedWithin(t *testing.T, conn net.Conn, d time.Duration) bool {
	t.Helper()
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(d)))
	_, err := io.Copy(io.Discard, conn)
	return !errors.Is(err, os.ErrDeadlineExceeded)
}

func TestServeClosesConnectionsThatStallOrIdle(t *testing.T) {
	cases := []struct {
		name string
		args []string
		// send writes to the connection before the wait.
		send string
		// keepAlive means one full request is answered first.
		keepAlive bool
	}{
		{"a body that stops mid-way", []string{"--http-read-timeout", "300ms"},
			"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":", false},
		{"an idle keep-alive connection", []string{"--http-idle-timeout", "300ms"},
			"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, base := startServe(t, tc.args...)
			conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
			require.NoError(t, err)
			defer conn.Close()
			_, err = io.WriteString(conn, tc.send)
			require.NoError(t, err)
			if tc.keepAlive {
				resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
				require.NoError(t, err)
				require.Equal(t, http.StatusOK, resp.StatusCode)
				require.False(t, resp.Close)
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			require.True(t, connClosedWithin(t, conn, 5*time.Second), "the connection is still open")
		})
	}
}

func TestServeHTTPTimeoutsHaveDefaultsAreAppliedAndMustBePositive(t *testing.T) {
	for _, flag := range []string{"--http-read-timeout", "--http-write-timeout", "--http-idle-timeout"} {
		_, err := parseFlags([]string{flag, "0s"}, io.Discard)
		require.ErrorContains(t, err, flag)
	}
	cfg, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{30 * time.Second, 30 * time.Second, 2 * time.Minute},
		[]time.Duration{cfg.ReadTimeout, cfg.WriteTimeout, cfg.IdleTimeout})
	s, _ := startServe(t, "--http-read-timeout", "5s", "--http-write-timeout", "7s", "--http-idle-timeout", "9s")
	require.Equal(t, []time.Duration{5 * time.Second, 7 * time.Second, 9 * time.Second},
		[]time.Duration{s.http.ReadTimeout, s.http.WriteTimeout, s.http.IdleTimeout})
}

func TestServeClosesTheConnectionAfterAnOversizeBody(t *testing.T) {
	_, base := startServe(t)
	body := strings.Repeat(" ", int(bodyLimit(DefaultMaxTokens))) + `{"model":"m","tokens":[1]}`
	// A reader hides the length, so the body is read up to the limit.
	resp, err := http.Post(base+"/v1/score", "application/json", io.MultiReader(strings.NewReader(body)))
	require.NoError(t, err)
	defer resp.Body.Close()
	msg, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode, "%s", msg)
	require.Contains(t, string(msg), "too large")
	require.True(t, resp.Close, "the server keeps the connection open after an oversize body")
}

// lockedBuffer is a log sink safe for concurrent writers.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func TestServeShutdownStopsWaitingForAStuckSubscriberAndStillSaves(t *testing.T) {
	snapshot := filepath.Join(t.TempDir(), "index.snap")
	cfg, err := parseFlags([]string{"--http", "127.0.0.1:0", "--snapshot", snapshot}, io.Discard)
	require.NoError(t, err)
	var logs lockedBuffer
	s, err := newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(&logs, nil)))
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	// A subscriber that never reports back.
	s.subDone = make(chan error)

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.Shutdown(ctx) }()
	select {
	case err = <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Shutdown still waits for the subscriber")
	}
	require.ErrorContains(t, err, "subscriber did not stop")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Contains(t, logs.String(), "the event subscriber did not stop in time")
	require.FileExists(t, snapshot)
}

// healthzOn sends GET /healthz on conn, keeping it alive, and returns the
// status, or 0 when the connection was closed.
func healthzOn(t *testing.T, conn net.Conn) int {
	t.Helper()
	_, err := io.WriteString(conn, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
	if err != nil {
		return 0
	}
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

func TestServeBoundsItsConnectionsClosingIdleOnesFirst(t *testing.T) {
	s, base := startServe(t, "--http-max-connections", "4")
	addr := strings.TrimPrefix(base, "http://")
	dial := func() net.Conn {
		conn, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	// Four idle keep-alive connections fill the bound.
	var idle []net.Conn
	for range 4 {
		c := dial()
		require.Equal(t, http.StatusOK, healthzOn(t, c))
		idle = append(idle, c)
	}
	require.Eventually(t, func() bool { return s.conns.idle.Load() == 4 }, 10*time.Second, time.Millisecond)
	// A fifth is served, and the idle ones are closed to make room.
	fifth := dial()
	require.Equal(t, http.StatusOK, healthzOn(t, fifth))
	for _, c := range idle {
		require.True(t, connClosedWithin(t, c, 10*time.Second), "an idle connection stayed open past the bound")
	}
	require.NoError(t, fifth.Close())
	require.Eventually(t, func() bool { return s.conns.open.Load() == 0 }, 10*time.Second, time.Millisecond)

	// Connections that are not idle (opened, nothing sent) are not closed
	// for a newcomer: past the bound it is refused, and counted.
	for range 4 {
		dial()
	}
	require.Eventually(t, func() bool { return s.conns.open.Load() >= 4 }, 10*time.Second, time.Millisecond)
	refused := dial()
	require.True(t, connClosedWithin(t, refused, 10*time.Second), "a connection past the bound was kept")
	require.Equal(t, 1.0, counterValue(s, "kvsource_http_connections_refused_total"))
}
