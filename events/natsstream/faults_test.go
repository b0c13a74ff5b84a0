package natsstream

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/index"
)

// relayNode is one relay process: its subscriber of the engines (whose
// index is the single-node reference), its NATS connection and the relay.
type relayNode struct {
	relay *Relay
	sub   *zmq.Subscriber
	ref   *index.Index
	kill  func()
}

func startRelay(t *testing.T, env *natsEnv, name string, engines ...*engine) *relayNode {
	t.Helper()
	nc, js := env.connect(t)
	relay, err := NewRelay(context.Background(), RelayConfig{JetStream: js, Name: name, LeaseTTL: 2 * time.Second, Retain: 10 * time.Second})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(ctx) }()
	ref := index.New(index.Config{})
	sub, err := zmq.NewSubscriber(zmq.SubscriberConfig{Events: events.Config{Sink: ref, Tap: relay.Tap, Workers: 2}})
	require.NoError(t, err)
	for _, e := range engines {
		require.NoError(t, sub.AddPod(e.pod, e.pubEP, e.replayEP))
	}
	subDone := make(chan struct{})
	go func() { defer close(subDone); _ = sub.Run(ctx) }()
	n := &relayNode{relay: relay, sub: sub, ref: ref}
	// A crash: the connection drops without the lease's release.
	n.kill = func() {
		nc.Close()
		cancel()
		<-done
		<-subDone
	}
	t.Cleanup(func() { cancel(); <-done; <-subDone })
	for _, e := range engines {
		e.hello(t, sub)
	}
	return n
}

func waitLeader(t *testing.T, r *Relay) {
	t.Helper()
	require.Eventually(t, func() bool { return r.Stats().Leader }, waitLong, 10*time.Millisecond)
}

// settle waits until node's subscriber applied and the stream holds each
// engine's last batch, and every replica applied the stream.
func settle(t *testing.T, js jetstream.JetStream, node *relayNode, last []uint64, engines []*engine, rs ...*Replica) {
	t.Helper()
	for i, e := range engines {
		waitSeq(t, node.sub, index.Holder{Pod: e.pod}, last[i])
		waitStream(t, js, e, last[i])
	}
	waitApplied(t, streamLast(t, js), rs...)
}

func requireSameView(t *testing.T, want *index.Index, models []string, rs ...*Replica) {
	t.Helper()
	v := viewOf(want, models...)
	require.NotEmpty(t, v.Hits)
	for _, r := range rs {
		require.Equal(t, v, viewOf(r.Index(), models...), "replica %s", r.cfg.Name)
	}
}

func publishAll(t *testing.T, engines []*engine, n int) []uint64 {
	var last []uint64
	for _, e := range engines {
		last = append(last, e.publish(t, n))
	}
	return last
}

func TestWarmStartFromSnapshotAfterReplayBuffersRotated(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	engines := []*engine{
		newEngine(t, "10.0.1.1:8000", "m", 11, true, nil),
		newEngine(t, "10.0.1.2:8000", "m", 12, true, nil),
	}
	node := startRelay(t, env, "relay", engines...)
	waitLeader(t, node.relay)
	first := openReplica(t, js, ReplicaConfig{Name: "first", SnapshotInterval: 100 * time.Millisecond, SnapshotLeaseTTL: 2 * time.Second})

	// Far more batches than the engines' replay buffers hold (10,000 by
	// default is not the point; what a new replica needs is gone from
	// the engines either way once the stream is purged).
	publishAll(t, engines, 150)
	require.Eventually(t, func() bool { return first.Status().Snapshots >= 1 }, waitLong, 10*time.Millisecond)
	last := publishAll(t, engines, 150)
	settle(t, js, node, last, engines, first)
	// A second snapshot purges what the first one covered.
	s, err := js.Stream(context.Background(), DefaultStream)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		info, err := s.Info(context.Background())
		return err == nil && info.State.FirstSeq > 1 && first.Status().Snapshots >= 2
	}, waitLong, 10*time.Millisecond, "the stream was never purged")

	late := openReplica(t, js, ReplicaConfig{Name: "late"})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, late.WaitReady(ctx))
	require.NotZero(t, late.Status().SnapshotSeq, "the late replica started from a snapshot")
	waitApplied(t, streamLast(t, js), late)
	requireSameView(t, node.ref, []string{"m"}, first, late)
}

func TestReplicaKilledAndRestartedCatchesUp(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	engines := []*engine{newEngine(t, "10.0.2.1:8000", "m", 21, true, nil), newEngine(t, "10.0.2.2:8000", "m", 22, true, nil)}
	node := startRelay(t, env, "relay", engines...)
	waitLeader(t, node.relay)
	keeper := openReplica(t, js, ReplicaConfig{Name: "keeper", SnapshotInterval: 100 * time.Millisecond})

	// The victim runs on its own connection, which a kill drops.
	nc, vjs := env.connect(t)
	victim, err := Open(context.Background(), ReplicaConfig{JetStream: vjs, Name: "victim", TempDir: t.TempDir()})
	require.NoError(t, err)
	vctx, vcancel := context.WithCancel(context.Background())
	vdone := make(chan struct{})
	go func() { defer close(vdone); _ = victim.Run(vctx) }()
	publishAll(t, engines, 100)
	nc.Close() // kill -9: no goodbye
	vcancel()
	<-vdone
	publishAll(t, engines, 100)
	require.Eventually(t, func() bool { return keeper.Status().Snapshots >= 1 }, waitLong, 10*time.Millisecond)

	again := openReplica(t, js, ReplicaConfig{Name: "victim"})
	last := publishAll(t, engines, 50)
	settle(t, js, node, last, engines, keeper, again)
	requireSameView(t, node.ref, []string{"m"}, keeper, again)
}

func TestSecondRelayTakesOverWhenTheFirstIsKilled(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	engines := []*engine{newEngine(t, "10.0.3.1:8000", "m", 31, true, nil), newEngine(t, "10.0.3.2:8000", "m2", 32, true, nil)}
	a := startRelay(t, env, "relay-a", engines...)
	waitLeader(t, a.relay)
	b := startRelay(t, env, "relay-b", engines...)
	rs := []*Replica{openReplica(t, js, ReplicaConfig{Name: "r0"}), openReplica(t, js, ReplicaConfig{Name: "r1"})}

	publishAll(t, engines, 100)
	a.kill()
	// Batches the dead relay never stored: only b's retained copies and
	// its takeover can get them to the stream.
	publishAll(t, engines, 30)
	waitLeader(t, b.relay)
	last := publishAll(t, engines, 70)
	settle(t, js, b, last, engines, rs...)
	requireSameView(t, b.ref, []string{"m", "m2"}, rs...)
	require.False(t, b.relay.Stats().Published == 0, "the standby published after the takeover")
	require.NotZero(t, b.relay.Stats().Tapped)
}

func TestNATSServerRestartedMidStreamLosesNothing(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	engines := []*engine{newEngine(t, "10.0.4.1:8000", "m", 41, true, nil), newEngine(t, "10.0.4.2:8000", "m", 42, true, nil)}
	node := startRelay(t, env, "relay", engines...)
	waitLeader(t, node.relay)
	rs := []*Replica{openReplica(t, js, ReplicaConfig{Name: "r0"}), openReplica(t, js, ReplicaConfig{Name: "r1"})}

	publishAll(t, engines, 100)
	env.srv.Shutdown()
	env.srv.WaitForShutdown()
	// The engines go on while the server is down; the relay holds these.
	publishAll(t, engines, 50)
	env.start()
	last := publishAll(t, engines, 50)
	settle(t, js, node, last, engines, rs...)
	requireSameView(t, node.ref, []string{"m"}, rs...)
}
