package natsstream

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

func TestReplicasMatchASingleNodeFedTheSameEvents(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	ctx := context.Background()

	engines := []*engine{
		// Live losses repaired from replay.
		newEngine(t, "10.0.0.1:8000", "meta-llama/Llama-3.1-8B", 1, true, func(s uint64) bool { return s%17 == 5 }),
		// Live losses no replay can repair: gaps the holder is cleared on.
		newEngine(t, "10.0.0.2:8000", "meta-llama/Llama-3.1-8B", 2, false, func(s uint64) bool { return s == 40 || s == 90 }),
		newEngine(t, "10.0.0.3:8000", "qwen/Qwen3.5", 3, true, nil),
	}
	relay, err := NewRelay(ctx, RelayConfig{JetStream: js, Name: "relay-a", LeaseTTL: 2 * time.Second, Retain: 10 * time.Second})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = relay.Run(ctx) })
	require.Eventually(t, func() bool { return relay.Stats().Leader }, waitLong, 10*time.Millisecond)

	// The reference is the relay's own subscriber: a single node fed the
	// engines' events. (A second subscriber of the same engines could see
	// other losses: ZMQ drops and replay timeouts are its own.)
	ref := index.New(index.Config{})
	relaySub := newSub(t, ref, relay.Tap, engines...)
	for _, e := range engines {
		e.hello(t, relaySub)
	}

	// The independent model of vLLM's publisher, as a fourth engine; its
	// engine value only supplies the workload and endpoints.
	py := &engine{pod: "10.0.0.9:8000", model: "meta-llama/Llama-3.1-8B", rng: rand.New(rand.NewPCG(9, 7)), have: make([]int, prompts),
		pubEP: fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)), replayEP: fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))}
	require.NoError(t, relaySub.AddPod(py.pod, py.pubEP, py.replayEP))
	pyLast, pyWait := pyEngine(t, py, 60, 7, 30)

	rs := []*Replica{
		openReplica(t, js, ReplicaConfig{Name: "r0"}),
		openReplica(t, js, ReplicaConfig{Name: "r1"}),
	}
	for _, e := range engines {
		e.publish(t, 120)
	}
	// An engine restart mid-stream, and a replica joining late.
	engines[0].restart(t)
	engines[0].rejoin(t, relaySub)
	rs = append(rs, openReplica(t, js, ReplicaConfig{Name: "r2"}))
	var last []uint64
	for _, e := range engines {
		last = append(last, e.publish(t, 80))
	}
	waitSeq(t, relaySub, index.Holder{Pod: py.pod}, pyLast)
	waitStream(t, js, py, pyLast)
	for i, e := range engines {
		waitSeq(t, relaySub, index.Holder{Pod: e.pod}, last[i])
		waitStream(t, js, e, last[i])
	}
	waitApplied(t, streamLast(t, js), rs...)

	models := []string{engines[0].model, engines[2].model}
	want := viewOf(ref, models...)
	require.NotEmpty(t, want.Hits)
	for _, r := range rs {
		require.Equal(t, want, viewOf(r.Index(), models...), "replica %s", r.cfg.Name)
		st := r.Status()
		require.True(t, st.Ready)
		require.Zero(t, st.LagMessages)
	}
	require.NotZero(t, rs[0].Status().Restarts, "the engine restart reached the replicas")
	require.NotZero(t, rs[0].Status().Gaps, "the unrepairable losses reached the replicas")
	pyWait()
}
