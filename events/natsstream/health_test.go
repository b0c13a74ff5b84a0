package natsstream

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
)

func TestReplicaIsUnhealthyWhileItLagsMoreThanMaxLag(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	ctx := context.Background()
	relay, err := NewRelay(ctx, RelayConfig{JetStream: js, Name: "relay", LeaseTTL: 2 * time.Second, Retain: 10 * time.Second})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = relay.Run(ctx) })
	waitLeader(t, relay)

	// The replica's apply stalls on its second batch until released.
	release := make(chan struct{})
	applied := 0
	r := openReplica(t, js, ReplicaConfig{Name: "slow", MaxLag: 200 * time.Millisecond, Applied: func(Batch, uint64) {
		applied++
		if applied == 2 {
			<-release
		}
	}})
	require.NoError(t, r.WaitReady(ctx))
	require.NoError(t, r.Healthy())
	payload := events.AppendBatch(nil, &events.Batch{DPRank: events.Some(0)}, events.LayoutMap, 0)
	for seq := range uint64(20) {
		relay.Tap(events.TapBatch{Model: "m", Pod: "p", Seq: seq, Payload: payload})
	}
	require.Eventually(t, func() bool { return r.Healthy() != nil }, waitLong, 10*time.Millisecond)
	st := r.Status()
	require.NotZero(t, st.LagMessages)
	require.Greater(t, st.LagSeconds, 0.2)
	require.ErrorContains(t, r.Healthy(), "lags")

	close(release)
	waitApplied(t, streamLast(t, js), r)
	require.Eventually(t, func() bool { return r.Healthy() == nil }, waitLong, 10*time.Millisecond)
	require.Zero(t, r.Status().LagMessages)
}

func TestReplicaShardedByModelAppliesOnlyItsModels(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	ctx := context.Background()
	relay, err := NewRelay(ctx, RelayConfig{JetStream: js, Name: "relay", LeaseTTL: 2 * time.Second, Retain: 10 * time.Second})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = relay.Run(ctx) })
	waitLeader(t, relay)
	r := openReplica(t, js, ReplicaConfig{Name: "llama", Models: []string{"org/llama.3"}})
	store := func(key uint64) []byte {
		return events.AppendBatch(nil, &events.Batch{DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockStored, Medium: "GPU", BlockSize: 16, BlockHashes: []uint64{key}}}}, events.LayoutMap, 0)
	}
	relay.Tap(events.TapBatch{Model: "org/llama.3", Pod: "10.0.0.1:8000", Seq: 0, Payload: store(1)})
	relay.Tap(events.TapBatch{Model: "qwen", Pod: "10.0.0.1:8000", Seq: 1, Payload: store(2)})
	relay.Tap(events.TapBatch{Model: "org/llama.3", Pod: "10.0.0.2:8000", Seq: 0, Payload: store(3)})
	waitApplied(t, 3, r)
	got := map[string]int{}
	for _, hm := range r.Index().HolderList() {
		got[hm.Model+"|"+hm.Holder.Pod] = r.Index().HolderBlocks(hm.Model, hm.Holder)["GPU"]
	}
	require.Equal(t, map[string]int{"org/llama.3|10.0.0.1:8000": 1, "org/llama.3|10.0.0.2:8000": 1}, got)
	require.Equal(t, uint64(2), r.Status().Batches)
}
