package natsstream

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

// startRoleServer starts a server with users "relay", "replica" and
// "snap" that have exactly the permissions of RoleRelay, RoleReplica and
// RoleSnapshotter under cfg, and returns how to connect as one of them.
func startRoleServer(t *testing.T, cfg Config) (connect func(name string) (jetstream.JetStream, *violations)) {
	t.Helper()
	user := func(name string, role Role) *server.User {
		p := cfg.Permissions(role)
		return &server.User{Username: name, Password: name + "-pw", Permissions: &server.Permissions{
			Publish: &server.SubjectPermission{Allow: p.Publish}, Subscribe: &server.SubjectPermission{Allow: p.Subscribe}}}
	}
	url := startServer(t, &server.Options{JetStream: true, StoreDir: t.TempDir(),
		Users: []*server.User{user("relay", RoleRelay), user("replica", RoleReplica), user("snap", RoleSnapshotter)}})
	return func(name string) (jetstream.JetStream, *violations) {
		v := &violations{}
		opts, err := ConnConfig{User: name, Password: name + "-pw"}.Options()
		require.NoError(t, err)
		nc, err := nats.Connect(url, append(opts, nats.ErrorHandler(v.handler))...)
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		return js, v
	}
}

// A fleet runs under users that have exactly the permissions each role
// lists: relays publish, replicas consume, load and store snapshots
// without a single permission violation, and a replica's credentials can
// neither publish a batch nor change the stream. (Package picker/natsfleet
// checks the sources table and the shared pulls under the same roles.)
func TestFleetRunsUnderEachRolesPermissionsAndReplicasCannotPublish(t *testing.T) {
	var cfg Config
	connect := startRoleServer(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	rjs, rv := connect("relay")
	relay, err := NewRelay(ctx, RelayConfig{Config: cfg, JetStream: rjs, Name: "relay", LeaseTTL: time.Second, Retain: 10 * time.Second})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = relay.Run(ctx) })
	waitLeader(t, relay)

	bound := cfg
	bound.Bind = true
	pjs, pv := connect("replica")
	replica := openReplica(t, pjs, ReplicaConfig{Config: bound, Name: "replica"})

	sjs, sv := connect("snap")
	snap := openReplica(t, sjs, ReplicaConfig{Config: bound, Name: "snap", SnapshotInterval: time.Hour})

	for seq := range uint64(3) {
		relay.Tap(events.TapBatch{Model: "m", Pod: "10.0.0.1:8000", Seq: seq, Payload: storeBatch(seq+1, 1)})
	}
	require.NoError(t, relay.Flush(ctx))
	waitApplied(t, 3, replica, snap)
	require.Equal(t, 3, replica.Index().HolderBlocks("m", index.Holder{Pod: "10.0.0.1:8000"})["GPU"])
	require.NoError(t, snap.Snapshot(ctx))
	relay.Tap(events.TapBatch{Model: "m", Pod: "10.0.0.1:8000", Seq: 3, Payload: storeBatch(4, 1)})
	require.NoError(t, relay.Flush(ctx))
	waitApplied(t, 4, snap)
	require.NoError(t, snap.Snapshot(ctx), "the second snapshot purges what the first covered")
	// A new replica starts from it.
	warm := openReplica(t, pjs, ReplicaConfig{Config: bound, Name: "warm"})
	require.NoError(t, warm.WaitReady(ctx))
	require.Equal(t, 4, warm.Index().HolderBlocks("m", index.Holder{Pod: "10.0.0.1:8000"})["GPU"])

	require.Empty(t, rv.list(), "the relay's permissions are enough")
	require.Empty(t, pv.list(), "the replica's permissions are enough")
	require.Empty(t, sv.list(), "the snapshotter's permissions are enough")

	// What a replica's credentials cannot do.
	short, cancelShort := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancelShort()
	_, err = pjs.PublishMsg(short, garbageMsg(cfg, "10.6.6.6:8000", "0", storeBatch(1<<30, 1)))
	require.Error(t, err, "a replica publishes a batch")
	short3, cancelShort3 := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancelShort3()
	_, err = pjs.UpdateStream(short3, jetstream.StreamConfig{Name: DefaultStream, Subjects: []string{"evil.>"}})
	require.Error(t, err, "a replica changes the stream")
	require.NotEmpty(t, pv.list())
	for _, e := range pv.list() {
		require.Contains(t, e, "Permissions Violation")
	}
	require.Equal(t, uint64(4), streamLastOf(t, rjs), "nothing the replica tried is on the stream")
}

// A replica's credentials cannot change the snapshot store, so cannot
// give it a max_age that deletes every shard's snapshots; a replica opens
// the store without them, cold while no snapshotter has created it, and
// warm from the snapshotter's snapshot once there is one.
func TestAReplicasCredentialsCannotDeleteTheSharedSnapshots(t *testing.T) {
	cfg := Config{Bind: true}
	connect := startRoleServer(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rjs, _ := connect("relay")
	relay, err := NewRelay(ctx, RelayConfig{JetStream: rjs, Name: "relay", LeaseTTL: time.Second, Retain: 10 * time.Second})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = relay.Run(ctx) })
	waitLeader(t, relay)
	h := index.Holder{Pod: "10.0.0.1:8000"}
	for seq := range uint64(2) {
		relay.Tap(events.TapBatch{Model: "m", Pod: h.Pod, Seq: seq, Payload: storeBatch(seq+1, 1)})
	}
	require.NoError(t, relay.Flush(ctx))

	pjs, pv := connect("replica")
	cold := openReplica(t, pjs, ReplicaConfig{Config: cfg, Name: "cold"})
	waitApplied(t, 2, cold)
	require.Equal(t, 2, cold.Index().HolderBlocks("m", h)["GPU"], "a replica starts before any snapshot store")

	sjs, sv := connect("snap")
	snap := openReplica(t, sjs, ReplicaConfig{Config: cfg, Name: "snap", SnapshotInterval: time.Hour})
	waitApplied(t, 2, snap)
	require.NoError(t, snap.Snapshot(ctx))
	relay.Tap(events.TapBatch{Model: "m", Pod: h.Pod, Seq: 2, Payload: storeBatch(3, 1)})
	require.NoError(t, relay.Flush(ctx))
	waitApplied(t, 3, snap)
	require.NoError(t, snap.Snapshot(ctx), "the second snapshot purges what the first covered")

	short, cancelShort := context.WithTimeout(ctx, 2*time.Second)
	defer cancelShort()
	_, err = pjs.UpdateObjectStore(short, jetstream.ObjectStoreConfig{Bucket: DefaultStream + "_SNAPSHOTS", TTL: time.Second})
	require.Error(t, err, "a replica gives the snapshot store a max_age")
	_, err = pjs.UpdateStream(short, jetstream.StreamConfig{Name: "OBJ_" + DefaultStream + "_SNAPSHOTS",
		Subjects: []string{"$O." + DefaultStream + "_SNAPSHOTS.C.>", "$O." + DefaultStream + "_SNAPSHOTS.M.>"}, MaxAge: time.Second})
	require.Error(t, err, "a replica updates the snapshot store's stream")
	require.Error(t, pjs.DeleteObjectStore(short, DefaultStream+"_SNAPSHOTS"), "a replica deletes the snapshot store")
	for _, e := range pv.list() {
		require.Contains(t, e, "Permissions Violation")
	}
	violated := len(pv.list())

	// The snapshots are all there for the next replica, which opens the
	// store without a single permission violation.
	warm := openReplica(t, pjs, ReplicaConfig{Config: cfg, Name: "warm"})
	require.Equal(t, uint64(3), warm.Status().SnapshotSeq, "the next replica starts from the snapshot")
	require.NoError(t, warm.WaitReady(ctx))
	require.Equal(t, 3, warm.Index().HolderBlocks("m", h)["GPU"])
	require.Len(t, pv.list(), violated, "the replicas' own permissions are enough")
	require.Empty(t, sv.list(), "the snapshotter's permissions are enough")
}

func streamLastOf(t *testing.T, js jetstream.JetStream) uint64 {
	t.Helper()
	s, err := js.Stream(context.Background(), DefaultStream)
	require.NoError(t, err)
	info, err := s.Info(context.Background())
	require.NoError(t, err)
	return info.State.LastSeq
}
