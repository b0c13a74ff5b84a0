package service

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

func TestServeRecordsPicksAsSpeculativeBlocksUntilTheEnginesEventsOrTheirTTL(t *testing.T) {
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0", "--speculative-ttl", "1s")
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 8*16)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	dest := "127.0.0.1:8001"
	tiers := func(pod string) map[string]int {
		code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": tokens, "pods": []string{pod}})
		require.Equal(t, http.StatusOK, code, "%s", body)
		var ans ScoreResponse
		require.NoError(t, json.Unmarshal(body, &ans))
		return ans.Pods[0].Tiers
	}
	code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": dest})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Equal(t, map[string]int{"GPU": 0, "CPU": 0, "speculative": 8}, tiers(dest), "the routed prompt scores on its destination at once")

	// Never a pull source: another destination's pick does not pull from it.
	code, body = call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": "127.0.0.1:8002"})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.NotContains(t, string(body), `"reason":"pull"`)

	// The engine's own event adds what it stored beside the guesses,
	// which stay until the TTL.
	newServeFeeder(t, s).store(dest, "m", "GPU", keys[:5])
	got := tiers(dest)
	require.Equal(t, 5, got["GPU"])
	require.Equal(t, 8, got["speculative"], "the guesses stay beside the stored blocks")
	require.Equal(t, 8, matched(t, base, dest, tokens))
	require.Eventually(t, func() bool { return matched(t, base, dest, tokens) == 5 }, 10*time.Second, 20*time.Millisecond,
		"the guesses outlived --speculative-ttl")
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Equal(t, "2", metricValue(metrics, "kvsource_speculative_recorded_total"))
	require.Equal(t, "0", metricValue(metrics, "kvsource_speculative_refused_total"))
}

// specPrompt is a prompt of 8 blocks and its block keys.
func specPrompt(t *testing.T) ([]uint32, []uint64) {
	t.Helper()
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 8*16)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	return tokens, keys
}

// pickTo picks tokens for n destinations made up as any client can.
func pickTo(t *testing.T, base string, tokens []uint32, n int) {
	t.Helper()
	for i := range n {
		code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": fmt.Sprintf("made-up-%d:1", i)})
		require.Equal(t, http.StatusOK, code, "%s", body)
	}
}

func TestServeForgetsPickDestinationsNoEngineReportedFromOnceTheirGuessesExpire(t *testing.T) {
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0", "--speculative-ttl", "200ms")
	tokens, keys := specPrompt(t)
	engine := "127.0.0.1:8001"
	newServeFeeder(t, s).store(engine, "m", "GPU", keys[:2])
	pickTo(t, base, tokens, 50)
	code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": engine})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Eventually(t, func() bool {
		pods := podsByHolder(t, base)
		_, ok := pods[index.Holder{Pod: engine}]
		return len(pods) == 1 && ok
	}, 10*time.Second, 20*time.Millisecond, "made-up destinations stay listed after their guesses expired")
	require.Equal(t, 2, matched(t, base, engine, tokens), "the engine's own blocks stay")
	require.Equal(t, 1, s.idx.Stats().Holders)
}

func TestServeSnapshotSaveLogsNoLinePerPickDestination(t *testing.T) {
	logs := &syncLog{}
	s, base := startServeWith(t, slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		"--events-bind", "tcp://127.0.0.1:0", "--speculative-ttl", "1m", "--snapshot", filepath.Join(t.TempDir(), "snap"))
	tokens, _ := specPrompt(t)
	pickTo(t, base, tokens, 50)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, s.Shutdown(ctx))
	out := logs.String()
	require.Contains(t, out, "snapshot saved")
	require.Zero(t, strings.Count(out, "made-up-"), "%s", out)
}

func TestServeBoundsPickDestinationsNoEngineReportedFrom(t *testing.T) {
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0", "--speculative-ttl", "1m", "--speculative-holders", "20")
	tokens, keys := specPrompt(t)
	engine := "127.0.0.1:8001"
	newServeFeeder(t, s).store(engine, "m", "GPU", keys[:2])
	pickTo(t, base, tokens, 50)
	code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": engine})
	require.Equal(t, http.StatusOK, code, "%s", body)
	require.Len(t, podsByHolder(t, base), 21, "20 made-up destinations and the engine")
	require.Equal(t, 8, matched(t, base, engine, tokens), "a pod an engine reported from is never refused")
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Equal(t, "21", metricValue(metrics, "kvsource_speculative_recorded_total"))
	require.Equal(t, "30", metricValue(metrics, "kvsource_speculative_refused_total"))
	require.Equal(t, "20", metricValue(metrics, "kvsource_speculative_holders"))
}
