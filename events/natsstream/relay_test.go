package natsstream

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
)

// A pod that stops publishing leaves nothing behind in the relay once its
// batches are older than Retain: not its batches, not its subject.
func TestRelayForgetsTheSubjectsOfPodsThatStoppedPublishing(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	r, err := NewRelay(context.Background(), RelayConfig{JetStream: js, Name: "sweep", LeaseTTL: time.Second, Retain: 1200 * time.Millisecond})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { require.NoError(t, r.Run(ctx)) })
	subjects := func() int {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.subjects)
	}
	for i := range 3 {
		r.Tap(events.TapBatch{Model: "m", Pod: "10.0.0." + string(rune('1'+i)) + ":8000", Seq: 0, Payload: []byte{0x90}})
	}
	require.Equal(t, 3, subjects())
	require.Eventually(t, func() bool { return subjects() == 0 }, 10*time.Second, 20*time.Millisecond)
	// A pod that publishes again gets a subject again.
	r.Tap(events.TapBatch{Model: "m", Pod: "10.0.0.1:8000", Seq: 1, Payload: []byte{0x90}})
	require.Equal(t, 1, subjects())
}

// An engine that restarts (its sequence numbers from 0 again) after the
// relay forgot its idle subject has its first batches published, not
// taken for ones the stream has.
func TestRelayPublishesARestartedEnginesBatchesAfterForgettingItsSubject(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	r, err := NewRelay(context.Background(), RelayConfig{JetStream: js, Name: "restart", LeaseTTL: time.Second, Retain: 1200 * time.Millisecond})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { require.NoError(t, r.Run(ctx)) })
	require.Eventually(t, func() bool { return r.Stats().Leader }, 10*time.Second, 10*time.Millisecond)
	tap := func(seq uint64, payload byte) {
		r.Tap(events.TapBatch{Model: "m", Pod: "10.0.0.1:8000", Seq: seq, Payload: []byte{0x81, 0xa1, 't', payload}})
	}
	for seq := range uint64(5) {
		tap(seq, byte(seq))
	}
	require.Equal(t, uint64(5), r.Stats().Published)
	require.Eventually(t, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.subjects) == 0
	}, 10*time.Second, 20*time.Millisecond)
	tap(0, 100) // the restarted engine's first batches: other bytes
	tap(1, 101)
	require.Equal(t, uint64(7), r.Stats().Published)
}
