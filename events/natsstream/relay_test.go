package natsstream

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
)

// startSweepingRelay runs a relay whose sweep forgets an idle subject
// within about two seconds.
func startSweepingRelay(t *testing.T) *Relay {
	t.Helper()
	_, js := startNATS(t).connect(t)
	r, err := NewRelay(context.Background(), RelayConfig{JetStream: js, Name: t.Name(), LeaseTTL: time.Second, Retain: 1200 * time.Millisecond})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { require.NoError(t, r.Run(ctx)) })
	return r
}

func (r *Relay) subjectCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.subjects)
}

// A pod that stops publishing leaves nothing behind in the relay once its
// batches are older than Retain: not its batches, not its subject.
func TestRelayForgetsTheSubjectsOfPodsThatStoppedPublishing(t *testing.T) {
	r := startSweepingRelay(t)
	subjects := r.subjectCount
	for i := range 3 {
		r.Tap(events.TapBatch{Model: "m", Pod: "10.0.0." + string(rune('1'+i)) + ":8000", Seq: 0, Payload: []byte{0x90}})
	}
	require.Equal(t, 3, subjects())
	require.Eventually(t, func() bool { return subjects() == 0 }, waitLong, 20*time.Millisecond)
	// A pod that publishes again gets a subject again.
	r.Tap(events.TapBatch{Model: "m", Pod: "10.0.0.1:8000", Seq: 1, Payload: []byte{0x90}})
	require.Equal(t, 1, subjects())
}

// An engine that restarts (its sequence numbers from 0 again) after the
// relay forgot its idle subject has its first batches published, not
// taken for ones the stream has.
func TestRelayPublishesARestartedEnginesBatchesAfterForgettingItsSubject(t *testing.T) {
	r := startSweepingRelay(t)
	require.Eventually(t, func() bool { return r.Stats().Leader }, waitLong, 10*time.Millisecond)
	tap := func(seq uint64, payload byte) {
		r.Tap(events.TapBatch{Model: "m", Pod: "10.0.0.1:8000", Seq: seq, Payload: []byte{0x81, 0xa1, 't', payload}})
	}
	for seq := range uint64(5) {
		tap(seq, byte(seq))
	}
	require.NoError(t, r.Flush(context.Background()))
	require.Equal(t, uint64(5), r.Stats().Published)
	require.Eventually(t, func() bool { return r.subjectCount() == 0 }, waitLong, 20*time.Millisecond)
	tap(0, 100) // the restarted engine's first batches: other bytes
	tap(1, 101)
	require.NoError(t, r.Flush(context.Background()))
	require.Equal(t, uint64(7), r.Stats().Published)
}

func TestRelayRunReturnsOnlyOnceItReleasedTheLease(t *testing.T) {
	env := startNATS(t)
	nc, js := env.connect(t)
	relay, err := NewRelay(context.Background(), RelayConfig{JetStream: js, Name: "r", LeaseTTL: 2 * time.Second, Retain: 10 * time.Second})
	require.NoError(t, err)
	for range 5 {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- relay.Run(ctx) }()
		waitLeader(t, relay)
		cancel()
		require.NoError(t, <-done)
		// Closing the connection right away, as kvsource serve does,
		// must not lose the release: the key is gone already.
		kv, err := js.KeyValue(context.Background(), DefaultStream+"_RELAY")
		require.NoError(t, err)
		_, err = kv.Get(context.Background(), "relay")
		require.ErrorIs(t, err, jetstream.ErrKeyNotFound)
	}
	nc.Close()
}
