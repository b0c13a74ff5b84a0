package events

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// randomBatch builds a batch exercising every optional field.
func randomBatch(rng *rand.Rand) Batch {
	b := Batch{TS: rng.Float64() * 1e9}
	if rng.IntN(2) == 0 {
		b.DPRank = Some(rng.IntN(8))
	}
	for range rng.IntN(6) {
		var e Event
		e.Medium = []string{"GPU", "CPU"}[rng.IntN(2)]
		switch rng.IntN(4) {
		case 0, 1:
			e.Type = EventBlockStored
			n := 1 + rng.IntN(5)
			e.BlockSize = 1 + rng.IntN(16)
			for range n {
				e.BlockHashes = append(e.BlockHashes, rng.Uint64()>>rng.IntN(64))
			}
			if rng.IntN(3) > 0 {
				for range n * e.BlockSize {
					e.TokenIDs = append(e.TokenIDs, uint32(rng.Uint64()>>rng.IntN(64)))
				}
			}
			if rng.IntN(2) == 0 {
				e.Parent = Some(rng.Uint64())
			}
			if rng.IntN(2) == 0 {
				e.LoRAID, e.LoRAName = Some(rng.IntN(100)), "lora-x"
			}
			if rng.IntN(2) == 0 {
				var extra [][]byte
				for i := range n {
					if i%2 == 0 {
						extra = append(extra, nil)
					} else {
						// ("lora-x", ("img", -3))
						extra = append(extra, []byte{0x92, 0xa6, 'l', 'o', 'r', 'a', '-', 'x', 0x92, 0xa3, 'i', 'm', 'g', 0xfd})
					}
				}
				e.ExtraKeys = Some(extra)
			}
		case 2:
			e.Type = EventBlockRemoved
			for range 1 + rng.IntN(4) {
				e.BlockHashes = append(e.BlockHashes, rng.Uint64())
			}
		case 3:
			e.Type = EventAllBlocksCleared
			e.Medium = "GPU"
		}
		if e.Type != EventAllBlocksCleared && rng.IntN(2) == 0 {
			e.GroupIdx = Some(rng.IntN(3))
		}
		b.Events = append(b.Events, e)
	}
	return b
}

func requireSameBatch(t *testing.T, want, got *Batch) {
	t.Helper()
	require.Equal(t, want.TS, got.TS)
	require.Equal(t, want.DPRank, got.DPRank)
	require.Len(t, got.Events, len(want.Events))
	for i := range want.Events {
		w, g := &want.Events[i], &got.Events[i]
		require.Equal(t, w.Type, g.Type, "event %d", i)
		require.Equal(t, len(w.BlockHashes), len(g.BlockHashes))
		for j := range w.BlockHashes {
			require.Equal(t, w.BlockHashes[j], g.BlockHashes[j])
		}
		require.Equal(t, len(w.TokenIDs), len(g.TokenIDs))
		for j := range w.TokenIDs {
			require.Equal(t, w.TokenIDs[j], g.TokenIDs[j])
		}
		require.Equal(t, w.Parent, g.Parent)
		require.Equal(t, w.Medium, g.Medium)
		require.Equal(t, w.GroupIdx, g.GroupIdx)
		if w.Type == EventBlockStored {
			require.Equal(t, w.BlockSize, g.BlockSize)
			require.Equal(t, w.LoRAID, g.LoRAID)
			require.Equal(t, w.LoRAName, g.LoRAName)
			wx, wok := w.ExtraKeys.Get()
			gx, gok := g.ExtraKeys.Get()
			require.Equal(t, wok, gok)
			require.Equal(t, len(wx), len(gx))
			for j := range wx {
				require.Equal(t, wx[j], gx[j])
			}
		}
	}
}

func TestAppendBatchRoundTripsThroughDecodeInBothLayouts(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	d := NewDecoder()
	var got Batch
	for i := range 2000 {
		want := randomBatch(rng)
		for _, layout := range []Layout{LayoutMap, LayoutArray} {
			payload := AppendBatch(nil, &want, layout, 0)
			require.NoError(t, d.Decode(payload, &got), "batch %d %s", i, layout)
			requireSameBatch(t, &want, &got)
		}
	}
}

func TestAppendBatchReencodesConformancePayloadsToTheSameBatch(t *testing.T) {
	d := NewDecoder()
	for _, c := range loadPayloadCases(t) {
		if c.Error != nil {
			continue
		}
		var want, got Batch
		require.NoError(t, d.Decode(c.Payload, &want))
		kept := want.Events[:0]
		for _, e := range want.Events {
			if e.Type != EventUnknown {
				kept = append(kept, e)
			}
		}
		want.Events = kept
		for _, layout := range []Layout{LayoutMap, LayoutArray} {
			require.NoError(t, d.Decode(AppendBatch(nil, &want, layout, 0), &got), c.Name)
			requireSameBatch(t, &want, &got)
		}
	}
}

func TestArrayLayoutTrimmedLikeV09DecodesWithDefaults(t *testing.T) {
	b := Batch{TS: 1, Events: []Event{{Type: EventBlockStored, BlockHashes: []uint64{7, 8}, TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 2, Medium: "CPU", LoRAName: "x", GroupIdx: Some(2)}}}
	var got Batch
	require.NoError(t, NewDecoder().Decode(AppendBatch(nil, &b, LayoutArray, 5), &got))
	e := got.Events[0]
	require.Equal(t, []uint64{7, 8}, e.BlockHashes)
	require.Equal(t, "GPU", e.Medium, "trimmed before medium: the default applies")
	require.Empty(t, e.LoRAName)
	_, ok := e.GroupIdx.Get()
	require.False(t, ok)
}

// benchBatch is the benchmark shape: 32 BlockStored events of 16
// blocks of 16 tokens, token ids in a realistic vocabulary range.
func benchBatch() Batch {
	rng := rand.New(rand.NewPCG(3, 4))
	b := Batch{DPRank: Some(0), TS: 1.5}
	parent := uint64(0)
	for i := range 32 {
		e := Event{GroupIdx: Some(0), Type: EventBlockStored, BlockSize: 16, Medium: "GPU"}
		if i > 0 {
			e.Parent = Some(parent)
		}
		for range 16 {
			parent = rng.Uint64()
			e.BlockHashes = append(e.BlockHashes, parent)
			for range 16 {
				e.TokenIDs = append(e.TokenIDs, uint32(rng.IntN(150000)))
			}
		}
		e.ExtraKeys = Some(make([][]byte, 16))
		b.Events = append(b.Events, e)
	}
	return b
}

func BenchmarkDecode(b *testing.B) {
	for _, layout := range []Layout{LayoutMap, LayoutArray} {
		b.Run(layout.String(), func(b *testing.B) {
			src := benchBatch()
			payload := AppendBatch(nil, &src, layout, 0)
			d := NewDecoder()
			var batch Batch
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if err := d.Decode(payload, &batch); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(32*16*b.N)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}
