package service

import (
	"context"
	"encoding/json"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

func TestServeListsExpandsAndKeepsSnapshotHoldersNotYetHeardFrom(t *testing.T) {
	const model = "org/m"
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 8*16)
	for i := range tokens {
		tokens[i] = uint32(7 + i)
	}
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	rank1 := index.Holder{Pod: "10.0.0.5:8000", Rank: 1}
	noSeq := index.Holder{Pod: "10.0.0.6:8000"}
	ix := index.New(index.Config{})
	ix.Store(index.Blocks{Model: model, Holder: rank1, Tier: index.TierCPU, Keys: keys})
	ix.Store(index.Blocks{Model: model, Holder: noSeq, Tier: index.TierGPU, Keys: keys[:2]})
	path := filepath.Join(t.TempDir(), "index.snap")
	require.NoError(t, ix.SaveFile(path, map[index.Holder]uint64{rank1: 41}))

	s, base := startServe(t, "--snapshot", path)

	code, body := call(t, "GET", base+"/v1/pods", nil)
	require.Equal(t, http.StatusOK, code, "%s", body)
	var pods struct{ Pods []Pod }
	require.NoError(t, json.Unmarshal(body, &pods))
	require.Equal(t, []Pod{
		{Pod: rank1.Pod, Model: model, DPRank: 1, Blocks: map[string]int{"GPU": 0, "CPU": 8}, LastSeq: 41, State: "stale",
			Counters: zeroHolderCounters()},
		{Pod: noSeq.Pod, Model: model, Blocks: map[string]int{"GPU": 2, "CPU": 0}, State: "stale",
			Counters: zeroHolderCounters()},
	}, pods.Pods)

	// A candidate without dp_rank stands for the ranks the snapshot knows:
	// here rank 1, which holds the prompt but, known only from the
	// snapshot, scores and serves no pull.
	code, body = call(t, "POST", base+"/v1/pick", map[string]any{"model": model, "tokens": tokens,
		"destination": "10.0.0.9:8000", "candidates": []map[string]any{{"pod": rank1.Pod}}})
	require.Equal(t, http.StatusOK, code, "%s", body)
	var pick PickResponse
	require.NoError(t, json.Unmarshal(body, &pick))
	require.Equal(t, "no_live_source", string(pick.Reason))
	require.Nil(t, pick.Source)
	require.Equal(t, 1, pick.SkippedSources)
	require.Equal(t, "stale", pick.SkippedState)
	require.Zero(t, pick.SourceBlocks)
	code, body = call(t, "POST", base+"/v1/score", map[string]any{"model": model, "tokens": tokens})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Contains(t, string(body), `"pod":"10.0.0.5:8000","dp_rank":1,"matched_blocks":8`)

	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Contains(t, string(metrics), "kvsource_holders{state=\"stale\"} 2\n")

	// Saved again, the holder keeps its loaded sequence number, so a replay
	// after the next restart starts where the snapshot left off; the holder
	// without one could never be replayed and is dropped.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, s.Shutdown(ctx))
	loaded, seqs, err := index.LoadFile(path, index.Config{})
	require.NoError(t, err)
	require.Equal(t, map[index.Holder]uint64{rank1: 41}, seqs)
	require.Equal(t, []index.HolderModel{{Model: model, Holder: rank1}}, loaded.HolderList())
	require.Equal(t, map[string]int{"CPU": 8}, loaded.HolderBlocks(model, rank1))
}
