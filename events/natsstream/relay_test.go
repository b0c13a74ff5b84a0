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
