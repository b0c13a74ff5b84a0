package service

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

func startServeNATS(t *testing.T) string {
	t.Helper()
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	require.NoError(t, err)
	srv.Start()
	require.True(t, srv.ReadyForConnections(10*time.Second))
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	return srv.ClientURL()
}

func TestServeReplicaAnswersAsTheRelayDoes(t *testing.T) {
	url := startServeNATS(t)
	port := testenv.FreePort(t)
	pub, err := zmq.NewPublisher(zmq.PublisherConfig{Bind: fmt.Sprintf("tcp://*:%d", port), Topic: "kv@10.0.0.1:8000@m"})
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })

	relay, relayURL := startServe(t, "--nats", url, "--role", "relay", "--nats-name", "relay",
		"--events-connect", fmt.Sprintf("10.0.0.1:8000=tcp://127.0.0.1:%d", port))
	_, replicaURL := startServe(t, "--nats", url, "--role", "replica", "--nats-name", "replica")

	h, err := hashing.New(hashing.Config{Algo: hashing.SHA256, BlockSize: hashing.DefaultBlockSize})
	require.NoError(t, err)
	tokens := make([]uint32, 4*hashing.DefaultBlockSize)
	for i := range tokens {
		tokens[i] = uint32(i + 7)
	}
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	score := func(base string) (resp ScoreResponse) {
		code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": tokens})
		require.Equal(t, http.StatusOK, code, string(body))
		require.NoError(t, json.Unmarshal(body, &resp))
		return resp
	}
	// The engine goes on publishing, as one does; the last batch stores
	// the prompt's blocks, in the CPU tier pulls are served from.
	require.Eventually(t, func() bool {
		_, err := pub.Publish(&events.Batch{DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: keys, BlockSize: hashing.DefaultBlockSize, Medium: "CPU"}}})
		require.NoError(t, err)
		r := score(replicaURL)
		return len(r.Pods) == 1 && r.Pods[0].MatchedBlocks == len(keys)
	}, 20*time.Second, 50*time.Millisecond)
	require.Equal(t, score(relayURL), score(replicaURL))
	require.True(t, relay.nats.relay.Stats().Leader)

	code, body := call(t, "GET", replicaURL+"/healthz", nil)
	require.Equal(t, http.StatusOK, code, string(body))
	code, body = call(t, "GET", replicaURL+"/v1/pods", nil)
	require.Equal(t, http.StatusOK, code)
	var pods struct {
		Pods    []Pod `json:"pods"`
		Replica struct {
			Ready      bool   `json:"ready"`
			AppliedSeq uint64 `json:"applied_seq"`
		} `json:"replica"`
	}
	require.NoError(t, json.Unmarshal(body, &pods))
	require.True(t, pods.Replica.Ready)
	require.NotZero(t, pods.Replica.AppliedSeq)
	require.Len(t, pods.Pods, 1)
	// Its sequence numbers and counters are those it applied from the
	// stream, the relay's own.
	h0 := index.Holder{Pod: "10.0.0.1:8000"}
	require.Eventually(t, func() bool {
		want := podsByHolder(t, relayURL)[h0].LastSeq
		return want != 0 && podsByHolder(t, replicaURL)[h0].LastSeq == want
	}, 10*time.Second, 10*time.Millisecond, "the replica's last_seq is not the relay's")
	require.Contains(t, podsByHolder(t, replicaURL)[h0].Counters, "gaps")
	code, body = call(t, "GET", replicaURL+"/metrics", nil)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, string(body), "kvsource_replica_lag_seconds")

	// The replica hears no engine: it pulls from holders the relay has
	// live, and stops when the relay sees the engine go.
	pick := func() PickResponse {
		code, body := call(t, "POST", replicaURL+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": "10.0.0.9:8000"})
		require.Equal(t, http.StatusOK, code, string(body))
		var d PickResponse
		require.NoError(t, json.Unmarshal(body, &d))
		return d
	}
	require.Eventually(t, func() bool { return pick().Reason == "pull" }, 10*time.Second, 20*time.Millisecond, "the relay's table never reached the replica")
	code, body = call(t, "GET", replicaURL+"/v1/pods", nil)
	require.Equal(t, http.StatusOK, code)
	require.NoError(t, json.Unmarshal(body, &pods))
	require.Equal(t, "live", pods.Pods[0].State)
	_, metrics := call(t, "GET", replicaURL+"/metrics", nil)
	require.Equal(t, "1", metricValue(metrics, "kvsource_sources_table_holders"))
	require.Equal(t, "0", metricValue(metrics, "kvsource_sources_tables_malformed_total"))
	_, metrics = call(t, "GET", relayURL+"/metrics", nil)
	require.NotEqual(t, "0", metricValue(metrics, "kvsource_sources_tables_written_total"))
	require.NoError(t, pub.Close())
	closed := time.Now()
	require.Eventually(t, func() bool {
		d := pick()
		return d.Reason == "no_live_source" && d.SkippedState == "disconnected"
	}, 5*time.Second, 20*time.Millisecond, "the replica still pulls from an engine that went away")
	t.Logf("the replica stopped pulling %v after the engine went away", time.Since(closed).Round(time.Millisecond))
	code, body = call(t, "GET", replicaURL+"/v1/pods", nil)
	require.Equal(t, http.StatusOK, code)
	require.NoError(t, json.Unmarshal(body, &pods))
	require.Equal(t, "disconnected", pods.Pods[0].State)

	// A fresh, empty engine on the dead one's address (a container
	// restart) inherits nothing on the replica either: no pull source
	// before it publishes, and its first batch (a sequence from 0) clears
	// the dead one's blocks.
	pub, err = zmq.NewPublisher(zmq.PublisherConfig{Bind: fmt.Sprintf("tcp://*:%d", port), Topic: "kv@10.0.0.1:8000@m"})
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })
	require.Eventually(t, func() bool { return podsByHolder(t, replicaURL)[h0].State == "reconnected" }, 10*time.Second, 10*time.Millisecond,
		"the replica never saw the relay's holder reconnect")
	require.NotEqual(t, "pull", pick().Reason, "the replica pulled from a restarted engine that has not published")
	other := []uint64{keys[0] + 1}
	require.Eventually(t, func() bool {
		_, err := pub.Publish(&events.Batch{DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: other, BlockSize: hashing.DefaultBlockSize, Medium: "CPU"}}})
		require.NoError(t, err)
		return podsByHolder(t, replicaURL)[h0].State == "live"
	}, 10*time.Second, 50*time.Millisecond)
	d := pick()
	require.NotEqual(t, "pull", d.Reason, "the restarted engine's first batch cleared the dead one's blocks")
	for _, p := range score(replicaURL).Pods {
		require.Zero(t, p.MatchedBlocks)
	}
}

func TestServeRejectsNATSFlagsThatCannotWork(t *testing.T) {
	for _, args := range [][]string{
		{"--role", "replica"},
		{"--nats", "nats://127.0.0.1:4222", "--role", "both"},
		{"--nats", "nats://127.0.0.1:4222", "--role", "replica", "--events-bind", "tcp://*:5557"},
		{"--nats", "nats://127.0.0.1:4222", "--role", "replica", "--snapshot", "x.snap"},
	} {
		_, err := parseFlags(args, io.Discard)
		require.Error(t, err, "%q", args)
	}
}

func TestServeStartUpOnAnUnreachableNATSStopsWithItsContextAndSaysWhy(t *testing.T) {
	url := fmt.Sprintf("nats://127.0.0.1:%d", testenv.FreePort(t)) // nothing listens
	cfg, err := parseFlags([]string{"--http", "127.0.0.1:0", "--nats", url, "--role", "replica"}, io.Discard)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	_, err = newWithLogger(ctx, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.Error(t, err)
	require.Less(t, time.Since(start), 10*time.Second, "start-up waited out its own 30 s instead of the context")
	require.ErrorContains(t, err, "not connected")
	require.ErrorContains(t, err, "connection refused")
}

func TestServeNATSURLsAreRedactedAndProbedAsTheClientReadsThem(t *testing.T) {
	require.Equal(t, "nats://u:xxxxx@10.0.0.1:4222,10.0.0.2:4222", redactNATS("nats://u:secret@10.0.0.1:4222, 10.0.0.2:4222"))
	require.Equal(t, "nats://xxxxx@h:4222", redactNATS("nats://s3cr3t-token@h:4222"))
	require.Equal(t, "nats://xxxxx@h:4222", redactNATS("nats://u:p%zz@h:4222"))
	require.Equal(t, "xxxxx@h:4222", redactNATS("u:p%zz@h:4222"))
	port := testenv.FreePort(t) // nothing listens
	for _, u := range []string{fmt.Sprintf("127.0.0.1:%d", port), fmt.Sprintf("nats://127.0.0.1:%d,nats://10.0.0.9:4222", port)} {
		require.Contains(t, natsDialError(t.Context(), u), fmt.Sprintf("dial tcp 127.0.0.1:%d: connect: connection refused", port), u)
	}
}

func TestServeNATSFlagsAreCheckedForTheRole(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--role", "relay"}, "--role needs --nats"},
		{[]string{"--nats", "nats://127.0.0.1:4222", "--role", "leader"}, "--role must be relay or replica"},
		{[]string{"--nats", "nats://127.0.0.1:4222", "--role", "replica", "--events-bind", "tcp://*:5557"}, "a replica reads the stream"},
		{[]string{"--nats", "nats://127.0.0.1:4222", "--role", "replica", "--snapshot", "x"}, "--snapshot is for standalone and relay"},
		{[]string{"--nats", "nats://127.0.0.1:4222", "--role", "relay", "--nats-models", "m"}, "a replica's flags"},
		{[]string{"--nats", "nats://127.0.0.1:4222", "--role", "relay", "--nats-max-lag", "1s"}, "a replica's flags"},
		{[]string{"--nats", "http://127.0.0.1:4222", "--role", "relay"}, "want nats://HOST:PORT"},
		{[]string{"--nats", "nats://u:secret@127.0.0.1:4222,nats://", "--role", "relay"}, `--nats "nats://"`},
	} {
		_, err := parseFlags(tc.args, io.Discard)
		require.ErrorContains(t, err, tc.want, "%q", tc.args)
		require.NotContains(t, err.Error(), "secret")
	}
	for _, args := range [][]string{
		{"--nats", "nats://127.0.0.1:4222", "--role", "relay", "--nats-replicas", "3"},
		{"--nats", "127.0.0.1:4222,tls://nats-1.svc:4222", "--role", "replica", "--nats-models", "m", "--nats-max-lag", "5s"},
		{"--nats", "nats://[::1]:4222, ws://h:8080,", "--role", "relay"},
	} {
		_, err := parseFlags(args, io.Discard)
		require.NoError(t, err, "%q", args)
	}
}

func TestServeRelayIsUnhealthyWhileDisconnectedFromNATS(t *testing.T) {
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	require.NoError(t, err)
	srv.Start()
	require.True(t, srv.ReadyForConnections(10*time.Second))
	_, base := startServe(t, "--nats", srv.ClientURL(), "--role", "relay")
	code, body := call(t, "GET", base+"/healthz", nil)
	require.Equal(t, http.StatusOK, code, "%s", body)

	srv.Shutdown()
	srv.WaitForShutdown()
	require.Eventually(t, func() bool {
		code, body := call(t, "GET", base+"/healthz", nil)
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "relay disconnected from NATS")
	}, 10*time.Second, 20*time.Millisecond)
}

func TestServeReportsADeadNATSServerWithinSecondsAndLogsEachRetry(t *testing.T) {
	url := fmt.Sprintf("nats://127.0.0.1:%d", testenv.FreePort(t)) // nothing listens
	cfg, err := parseFlags([]string{"--nats", url, "--role", "relay"}, io.Discard)
	require.NoError(t, err)
	var logs lockedBuffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := newWithLogger(ctx, cfg, slog.New(slog.NewTextHandler(&logs, nil)))
		done <- err
	}()
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "NATS not reachable yet") },
		5*time.Second, 10*time.Millisecond, "no report of the dead server within seconds:\n%s", logs.String())
	require.Less(t, time.Since(start), 4*time.Second)
	require.Contains(t, logs.String(), "connection refused", "the report says why")
	require.Eventually(t, func() bool { return strings.Count(logs.String(), "NATS connection attempt failed, retrying") >= 2 },
		10*time.Second, 10*time.Millisecond, "retries are not logged:\n%s", logs.String())
	cancel()
	require.ErrorContains(t, <-done, "not connected")
}

// fakeNATSServer answers one NATS handshake as a server of version would,
// and then PINGs with PONGs, for the version check.
func fakeNATSServer(t *testing.T, version string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				fmt.Fprintf(conn, "INFO {\"server_id\":\"fake\",\"version\":%q,\"proto\":1,\"max_payload\":1048576,\"headers\":true}\r\n", version)
				r := bufio.NewReader(conn)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if strings.HasPrefix(line, "PING") {
						_, _ = io.WriteString(conn, "PONG\r\n")
					}
				}
			}()
		}
	}()
	return "nats://" + ln.Addr().String()
}

func TestServeRefusesANATSServerOlderThan211SayingWhatItNeeds(t *testing.T) {
	url := fakeNATSServer(t, "2.9.10") // Debian 12's nats-server
	cfg, err := parseFlags([]string{"--nats", url, "--role", "relay"}, io.Discard)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = newWithLogger(ctx, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.ErrorIs(t, err, ErrNATSServerTooOld)
	require.ErrorContains(t, err, "nats-server 2.9.10 is older than 2.11")
	require.ErrorContains(t, err, "go tool nats-server -js")
}

func TestNATSVersionCheck(t *testing.T) {
	for _, tc := range []struct {
		version string
		ok      bool
	}{
		{"2.9.10", false}, {"2.10.24", false}, {"1.4.1", false}, {"", false}, {"x.y", false},
		{"2.11.0", true}, {"2.11.0-RC.1", true}, {"v2.15.2", true}, {"3.0", true},
	} {
		err := checkNATSVersion(tc.version, "nats://h:4222")
		if tc.ok {
			require.NoError(t, err, tc.version)
		} else {
			require.ErrorIs(t, err, ErrNATSServerTooOld, tc.version)
		}
	}
}

func TestServeAuthenticatesToNATSAndStopsAtOnceOnRefusedCredentials(t *testing.T) {
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true,
		Username: "kv", Password: "s3cret"})
	require.NoError(t, err)
	srv.Start()
	require.True(t, srv.ReadyForConnections(10*time.Second))
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	url := srv.ClientURL()

	t.Setenv("KVSOURCE_NATS_PASSWORD", "s3cret")
	relay, _ := startServe(t, "--nats", url, "--role", "relay", "--nats-user", "kv")
	require.NotNil(t, relay.nats.relay)

	pw := filepath.Join(t.TempDir(), "pw")
	require.NoError(t, os.WriteFile(pw, []byte("wrong\n"), 0o600))
	cfg, err := parseFlags([]string{"--nats", url, "--role", "relay", "--nats-user", "kv", "--nats-password-file", pw}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, "wrong", cfg.NATS.Conn.Password, "the file's trailing newline is not the password's")
	start := time.Now()
	_, err = newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.ErrorContains(t, err, "refuses the credentials")
	require.Less(t, time.Since(start), 10*time.Second, "a refusal waited for the set-up timeout")
	require.NotContains(t, err.Error(), "wrong", "the password is not in the error")
}

// startServeNATSWithRoles starts a NATS server with users "relay",
// "replica" and "snap" holding exactly natsstream's permissions for their
// role, and returns its URL and the flags that log in as each.
func startServeNATSWithRoles(t *testing.T) (url string, login func(user string) []string) {
	t.Helper()
	var cfg natsstream.Config
	var users []*server.User
	dir := t.TempDir()
	for name, role := range map[string]natsstream.Role{"relay": natsstream.RoleRelay, "replica": natsstream.RoleReplica, "snap": natsstream.RoleSnapshotter} {
		p := cfg.Permissions(role)
		users = append(users, &server.User{Username: name, Password: name + "-pw", Permissions: &server.Permissions{
			Publish: &server.SubjectPermission{Allow: p.Publish}, Subscribe: &server.SubjectPermission{Allow: p.Subscribe}}})
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(name+"-pw\n"), 0o600))
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true,
		Users: users})
	require.NoError(t, err)
	srv.Start()
	require.True(t, srv.ReadyForConnections(10*time.Second))
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	return srv.ClientURL(), func(user string) []string {
		return []string{"--nats-user", user, "--nats-password-file", filepath.Join(dir, user)}
	}
}

// A serve replica's NATS credentials cannot delete the snapshots the
// snapshotting replica stored: the next replica still starts from them.
func TestServeReplicaCredentialsCannotDeleteTheSharedSnapshots(t *testing.T) {
	url, login := startServeNATSWithRoles(t)
	relay, _ := startServe(t, append([]string{"--nats", url, "--role", "relay", "--events-bind", "tcp://127.0.0.1:0"}, login("relay")...)...)
	feed := newServeFeeder(t, relay)
	h := index.Holder{Pod: "127.0.0.1:8002"}
	feed.store(h.Pod, "m", "CPU", []uint64{1, 2})
	snap, _ := startServe(t, append([]string{"--nats", url, "--role", "replica", "--nats-bind", "--nats-snapshot-interval", "50ms"}, login("snap")...)...)
	var st natsstream.ReplicaStatus
	snapshots := func(n uint64) func() bool {
		return func() bool { st = snap.nats.replica.Status(); return st.Snapshots >= n }
	}
	require.Eventually(t, snapshots(1), 20*time.Second, 10*time.Millisecond, "%+v", &st)
	feed.store(h.Pod, "m", "CPU", []uint64{3})
	// The second snapshot purges the stream up to the first.
	require.Eventually(t, snapshots(2), 20*time.Second, 10*time.Millisecond, "%+v", &st)

	nc, err := nats.Connect(url, nats.UserInfo("replica", "replica-pw"))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = js.UpdateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: natsstream.DefaultStream + "_SNAPSHOTS", TTL: time.Second})
	require.Error(t, err, "a replica's credentials gave the snapshot store a max_age")

	replica, replicaURL := startServe(t, append([]string{"--nats", url, "--role", "replica", "--nats-bind", "--nats-snapshot-interval", "0"}, login("replica")...)...)
	require.Positive(t, replica.nats.replica.Status().SnapshotSeq, "the replica started without the shared snapshot")
	require.Eventually(t, func() bool { return podsByHolder(t, replicaURL)[h].Blocks["CPU"] == 3 }, 10*time.Second, 10*time.Millisecond)
}

// With --keys content, a replica indexes the stream under the content
// keys its requests hash to, as the relay does: both score a prompt whose
// engine keys no router reproduces alike.
func TestServeReplicaWithContentKeysScoresAsTheRelayDoes(t *testing.T) {
	url := startServeNATS(t)
	port := testenv.FreePort(t)
	pub, err := zmq.NewPublisher(zmq.PublisherConfig{Bind: fmt.Sprintf("tcp://*:%d", port), Topic: "kv@10.0.0.1:8000@m"})
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })
	_, relayURL := startServe(t, "--nats", url, "--role", "relay", "--keys", "content",
		"--events-connect", fmt.Sprintf("10.0.0.1:8000=tcp://127.0.0.1:%d", port))
	_, replicaURL := startServe(t, "--nats", url, "--role", "replica", "--keys", "content")

	tokens := make([]uint32, 4*hashing.DefaultBlockSize)
	for i := range tokens {
		tokens[i] = uint32(i + 7)
	}
	score := func(base string) (resp ScoreResponse) {
		code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": tokens})
		require.Equal(t, http.StatusOK, code, string(body))
		require.NoError(t, json.Unmarshal(body, &resp))
		return resp
	}
	// Keys of an engine hashing with a random seed.
	engineKeys := []uint64{0xe1, 0xe2, 0xe3, 0xe4}
	require.Eventually(t, func() bool {
		_, err := pub.Publish(&events.Batch{DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockStored,
			BlockHashes: engineKeys, TokenIDs: tokens, BlockSize: hashing.DefaultBlockSize, Medium: "GPU"}}})
		require.NoError(t, err)
		r := score(relayURL)
		return len(r.Pods) == 1 && r.Pods[0].MatchedBlocks == len(engineKeys)
	}, 20*time.Second, 50*time.Millisecond, "the relay never indexed the prompt")
	var r ScoreResponse
	require.Eventually(t, func() bool { r = score(replicaURL); return len(r.Pods) == 1 }, 10*time.Second, 10*time.Millisecond,
		"the replica never scored the prompt's pod: %+v", &r)
	require.Equal(t, score(relayURL), r)
}
