package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
)

func TestEventStatsSumAndRenderEveryCounterByItsTableName(t *testing.T) {
	var a, b eventStats
	a.Gaps, a.HashChecks = 1, 10
	b.Gaps, b.Replayed = 2, 5
	sum := a.add(b)
	require.Equal(t, uint64(3), sum.Gaps)
	require.Equal(t, uint64(10), sum.HashChecks)
	require.Equal(t, uint64(5), sum.Replayed)

	raw, err := json.Marshal(sum)
	require.NoError(t, err)
	var got map[string]uint64
	require.NoError(t, json.Unmarshal(raw, &got))
	require.Len(t, got, len(events.Counters))
	for _, c := range events.Counters {
		require.Equal(t, *c.Stat(&sum.Stats), got[c.Name], c.Name)
	}
	require.Equal(t, uint64(5), got["replayed_batches"])
}
