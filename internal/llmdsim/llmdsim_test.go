package llmdsim

import (
	"hash/fnv"
	"testing"

	"github.com/fxamacker/cbor/v2"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

func canonicalFNV(t *testing.T, v any) uint64 {
	t.Helper()
	em, err := cbor.CanonicalEncOptions().EncMode()
	require.NoError(t, err)
	b, err := em.Marshal(v)
	require.NoError(t, err)
	h := fnv.New64a()
	_, _ = h.Write(b)
	return h.Sum64()
}

func TestKeysAreFNV64aOverCanonicalCBORChainedFromSeedAndModel(t *testing.T) {
	s := &Sim{Seed: "0", Model: "Qwen/Qwen3-0.6B", BlockSize: 4}
	tokens := []uint32{1, 2, 3, 300, 70000, 4_000_000_000, 7, 8, 9}
	root := canonicalFNV(t, []any{"0", "Qwen/Qwen3-0.6B"})
	require.Equal(t, root, s.Root())
	k0 := canonicalFNV(t, []any{root, tokens[0:4], nil})
	k1 := canonicalFNV(t, []any{k0, tokens[4:8], nil})
	require.Equal(t, []uint64{k0, k1}, s.Keys(tokens))
	other := &Sim{Seed: "0", Model: "other", BlockSize: 4}
	require.NotEqual(t, s.Keys(tokens), other.Keys(tokens), "the model roots the chain")
}

func TestFlushWritesTheSimulatorsLayouts(t *testing.T) {
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	for _, tc := range []struct {
		format Format
		check  func(t *testing.T, stored, removed, cleared any)
	}{
		{Array, func(t *testing.T, stored, removed, cleared any) {
			ev := stored.([]any)
			require.Len(t, ev, 9)
			require.Equal(t, "BlockStored", ev[0])
			require.EqualValues(t, 0, ev[2], "parent 0 for a chain's first block")
			require.Len(t, ev[3], 8)
			require.EqualValues(t, 4, ev[4])
			require.Nil(t, ev[5])
			require.Equal(t, "GPU", ev[6])
			require.Equal(t, []any{"BlockRemoved", removed.([]any)[1], "GPU"}, removed)
			require.Equal(t, []any{"AllBlocksCleared"}, cleared)
		}},
		{Map, func(t *testing.T, stored, removed, cleared any) {
			ev := stored.(map[string]any)
			require.Equal(t, "BlockStored", ev["type"])
			v, ok := ev["parent_block_hash"]
			require.True(t, ok)
			require.Nil(t, v)
			require.Equal(t, "BlockRemoved", removed.(map[string]any)["type"])
			require.Equal(t, "AllBlocksCleared", cleared.(map[string]any)["type"])
		}},
	} {
		s := &Sim{Model: "m", BlockSize: 4, Format: tc.format, TS: 100}
		keys := s.Store(tokens, 0)
		s.Remove(keys[1])
		s.Clear()
		payload, err := s.Flush()
		require.NoError(t, err)
		var batch []any
		require.NoError(t, msgpack.Unmarshal(payload, &batch))
		require.Len(t, batch, 3)
		require.EqualValues(t, 100, batch[0])
		require.EqualValues(t, 0, batch[2])
		evs := batch[1].([]any)
		require.Len(t, evs, 3)
		tc.check(t, evs[0], evs[1], evs[2])
		require.EqualValues(t, 101, s.TS)
	}
}

func TestStoreContinuesAChainWithItsParentsKey(t *testing.T) {
	s := &Sim{Model: "m", BlockSize: 2}
	keys := s.Store([]uint32{1, 2, 3, 4, 5, 6}, 2)
	payload, err := s.Flush()
	require.NoError(t, err)
	var batch []any
	require.NoError(t, msgpack.Unmarshal(payload, &batch))
	ev := batch[1].([]any)[0].([]any)
	require.EqualValues(t, keys[1], ev[2])
	require.Equal(t, []any{keys[2]}, ev[1])
	require.Len(t, ev[3], 2)
}
