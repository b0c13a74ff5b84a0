package natsfleet

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/internal/testenv"
)

const waitLong = 30 * time.Second

// natsEnv is one in-process NATS server with JetStream, its storage in a
// test's temporary directory.
type natsEnv struct{ url string }

func startNATS(t testing.TB) *natsEnv {
	t.Helper()
	return &natsEnv{url: startServer(t, &server.Options{JetStream: true, StoreDir: t.TempDir()})}
}

// startServer starts a server with opts on a free port until the test
// ends and returns its URL.
func startServer(t testing.TB, opts *server.Options) string {
	t.Helper()
	opts.Host, opts.Port, opts.NoLog, opts.NoSigs = "127.0.0.1", testenv.FreePort(t), true, true
	srv, err := server.NewServer(opts)
	require.NoError(t, err)
	srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	require.True(t, srv.ReadyForConnections(10*time.Second), "nats server not ready")
	return fmt.Sprintf("nats://127.0.0.1:%d", opts.Port)
}

// connect returns a JetStream client, closed when the test ends.
func (e *natsEnv) connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(e.url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return nc, js
}

// runUntilCleanup runs f on a goroutine until the test ends.
func runUntilCleanup(t testing.TB, f func(ctx context.Context)) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

// startLeadingRelay runs a relay on js until the test ends and waits
// until it holds the lease.
func startLeadingRelay(t *testing.T, js jetstream.JetStream) *natsstream.Relay {
	t.Helper()
	relay, err := natsstream.NewRelay(context.Background(), natsstream.RelayConfig{JetStream: js, Name: "relay", LeaseTTL: time.Second, Retain: 10 * time.Second})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = relay.Run(ctx) })
	waitLeader(t, relay)
	return relay
}

func waitLeader(t *testing.T, r *natsstream.Relay) {
	t.Helper()
	require.Eventually(t, func() bool { return r.Stats().Leader }, waitLong, 10*time.Millisecond)
}
