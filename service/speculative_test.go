package service

import (
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
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

	// The engine's own event replaces what it stored; the rest is still
	// a guess, until the TTL.
	newServeFeeder(t, s).store(dest, "m", "GPU", keys[:5])
	got := tiers(dest)
	require.Equal(t, 5, got["GPU"])
	require.Zero(t, got["speculative"], "blocks 0-4 are no longer guesses")
	require.Equal(t, 8, matched(t, base, dest, tokens), "blocks 5-7 still score")
	require.Eventually(t, func() bool { return matched(t, base, dest, tokens) == 5 }, 10*time.Second, 20*time.Millisecond,
		"the guesses outlived --speculative-ttl")
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Equal(t, "2", metricValue(metrics, "kvsource_speculative_recorded_total"))
	require.NotEqual(t, "0", metricValue(metrics, "kvsource_speculative_replaced_total"))
}
