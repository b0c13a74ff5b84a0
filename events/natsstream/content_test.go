package natsstream

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// A replica given ContentKeys indexes the stream's batches under the
// content keys a request's tokens hash to, as the relay's own index does in
// content-key mode; without it, under the engine's keys.
func TestAReplicaWithContentKeysIndexesWhatContentKeyedRequestsLookUp(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	ck, err := hashing.New(hashing.Config{Algo: hashing.Content, BlockSize: 16})
	require.NoError(t, err)
	tokens := make([]uint32, 3*16)
	for i := range tokens {
		tokens[i] = uint32(100 + i)
	}
	contentKeys, err := ck.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	// The engine's own keys are nothing the router can reproduce.
	engineKeys := []uint64{0xe1, 0xe2, 0xe3}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	relay, err := NewRelay(ctx, RelayConfig{JetStream: js, Name: "relay", LeaseTTL: time.Second, Retain: 10 * time.Second})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { _ = relay.Run(ctx) })
	waitLeader(t, relay)
	content := openReplica(t, js, ReplicaConfig{Name: "content", ContentKeys: ck})
	engine := openReplica(t, js, ReplicaConfig{Name: "engine"})
	h := index.Holder{Pod: "10.0.0.1:8000"}
	payload := events.AppendBatch(nil, &events.Batch{DPRank: events.Some(0), Events: []events.Event{{Type: events.EventBlockStored,
		Medium: "GPU", BlockSize: 16, BlockHashes: engineKeys, TokenIDs: tokens}}}, events.LayoutMap, 0)
	relay.Tap(events.TapBatch{Model: "m", Pod: h.Pod, Seq: 0, Payload: payload})
	require.NoError(t, relay.Flush(ctx))
	waitApplied(t, 1, content, engine)

	require.Equal(t, 3, content.Index().Run("m", h, contentKeys, 0, nil), "the content-keyed replica misses a content-keyed request")
	require.Equal(t, 3, engine.Index().Run("m", h, engineKeys, 0, nil))
	require.Zero(t, engine.Index().Run("m", h, contentKeys, 0, nil))
}

func TestOpenRefusesContentKeysOfAnotherAlgorithm(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	h, err := hashing.New(hashing.Config{Algo: hashing.SHA256, BlockSize: 16})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = Open(ctx, ReplicaConfig{JetStream: js, ContentKeys: h, TempDir: t.TempDir()})
	require.ErrorIs(t, err, events.ErrConfig)
}
