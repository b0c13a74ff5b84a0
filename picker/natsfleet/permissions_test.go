package natsfleet

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/index"
)

// violations collects a connection's asynchronous errors: permission
// violations among them.
type violations struct {
	mu   sync.Mutex
	errs []string
}

func (v *violations) handler(_ *nats.Conn, _ *nats.Subscription, err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.errs = append(v.errs, err.Error())
}

func (v *violations) list() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]string(nil), v.errs...)
}

// startRoleServer starts a server with users "relay" and "replica" that
// have exactly the permissions of natsstream.RoleRelay and RoleReplica
// under cfg, and returns how to connect as one of them.
func startRoleServer(t *testing.T, cfg natsstream.Config) (connect func(name string) (jetstream.JetStream, *violations)) {
	t.Helper()
	user := func(name string, role natsstream.Role) *server.User {
		p := cfg.Permissions(role)
		return &server.User{Username: name, Password: name + "-pw", Permissions: &server.Permissions{
			Publish: &server.SubjectPermission{Allow: p.Publish}, Subscribe: &server.SubjectPermission{Allow: p.Subscribe}}}
	}
	url := startServer(t, &server.Options{JetStream: true, StoreDir: t.TempDir(),
		Users: []*server.User{user("relay", natsstream.RoleRelay), user("replica", natsstream.RoleReplica)}})
	return func(name string) (jetstream.JetStream, *violations) {
		v := &violations{}
		opts, err := natsstream.ConnConfig{User: name, Password: name + "-pw"}.Options()
		require.NoError(t, err)
		nc, err := nats.Connect(url, append(opts, nats.ErrorHandler(v.handler))...)
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		return js, v
	}
}

// Pulls and the sources table run under users that have exactly the
// permissions each role lists: the relay writes the table, a replica
// watches it and shares pulls without a single permission violation, and
// a replica's credentials cannot write a table.
func TestPullsAndSourcesRunUnderEachRolesPermissionsAndReplicasCannotWriteATable(t *testing.T) {
	var cfg natsstream.Config
	connect := startRoleServer(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	rjs, rv := connect("relay")
	relay := startLeadingRelay(t, rjs)
	rsrc, err := NewSources(ctx, SourcesConfig{Config: cfg, JetStream: rjs, Interval: 100 * time.Millisecond, Relay: relay})
	require.NoError(t, err)
	st := &fakeStatus{}
	st.set(events.HolderStatus{Pod: "10.0.0.1:8000", State: events.StateLive})
	runUntilCleanup(t, func(ctx context.Context) { _ = rsrc.Publish(ctx, st.get, relay.Leader) })

	bound := cfg
	bound.Bind = true
	pjs, pv := connect("replica")
	psrc, err := NewSources(ctx, SourcesConfig{Config: bound, JetStream: pjs, Interval: 100 * time.Millisecond})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = psrc.Watch(ctx) })
	pulls, err := NewPulls(ctx, PullsConfig{Config: bound, JetStream: pjs, Name: "replica"})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = pulls.Run(ctx) })

	require.Eventually(t, func() bool { _, ok := psrc.Source(index.Holder{Pod: "10.0.0.1:8000"}); return ok }, waitLong, 10*time.Millisecond)
	pulls.Started(index.Holder{Pod: "10.0.0.1:8000"})
	require.Eventually(t, func() bool { return pulls.Stats().Started == 1 }, waitLong, 10*time.Millisecond)
	require.Empty(t, rv.list(), "the relay's permissions are enough")
	require.Empty(t, pv.list(), "the replica's permissions are enough")

	// What a replica's credentials cannot do.
	kv, err := pjs.KeyValue(ctx, natsstream.DefaultStream+"_SOURCES")
	require.NoError(t, err, "a replica reads the sources bucket")
	short, cancelShort := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancelShort()
	_, err = kv.Put(short, sourcesKey, appendSourcesTable(nil, relay.Owner(), []events.HolderStatus{{Pod: "10.6.6.6:8000", State: events.StateLive}}))
	require.Error(t, err, "a replica writes a sources table")
	require.NotEmpty(t, pv.list())
	for _, e := range pv.list() {
		require.Contains(t, e, "Permissions Violation")
	}
	_, ok := psrc.Source(index.Holder{Pod: "10.6.6.6:8000"})
	require.False(t, ok)
}
