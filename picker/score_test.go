package picker

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
)

func TestScoreWeighsTiers(t *testing.T) {
	keys := seqKeys(10)
	cases := []struct {
		name   string
		hold   []holding
		blocks int
		gpu    int
		cpu    int
		score  float64
	}{
		{"all on GPU", []holding{{peerA, index.TierGPU, 0, 10}}, 10, 10, 0, 10},
		{"all on CPU", []holding{{peerA, index.TierCPU, 0, 10}}, 10, 0, 10, 8},
		{"GPU prefix, CPU further", []holding{{peerA, index.TierGPU, 0, 4}, {peerA, index.TierCPU, 0, 10}}, 10, 4, 10, 4 + 0.8*6},
		{"CPU prefix, GPU further", []holding{{peerA, index.TierCPU, 0, 3}, {peerA, index.TierGPU, 0, 7}}, 7, 7, 3, 7},
		// Blocks 0-2 on GPU, 3-5 on CPU, 6-7 on GPU again: no tier's own
		// prefix covers 6-7, so they count at the lowest weight.
		{"prefix alternating tiers", []holding{{peerA, index.TierGPU, 0, 3}, {peerA, index.TierCPU, 3, 6}, {peerA, index.TierGPU, 6, 8}},
			8, 3, 0, 3 + 0.8*5},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPicker(t, fleet(keys, tc.hold...), Config{})
			got, err := p.Score(Request{Model: model, Keys: keys}, nil)
			require.NoError(t, err)
			require.Len(t, got, 1)
			require.Equal(t, peerA, got[0].Holder)
			require.Equal(t, tc.blocks, got[0].Blocks)
			require.Equal(t, tc.gpu, got[0].Tier(index.TierGPU))
			require.Equal(t, tc.cpu, got[0].Tier(index.TierCPU))
			require.InDelta(t, tc.score, got[0].Score, 1e-9)
		})
	}
}

func TestScoreOrdersBestFirstAndHonoursCandidates(t *testing.T) {
	keys := seqKeys(10)
	idx := fleet(keys,
		holding{peerA, index.TierCPU, 0, 10}, // 8
		holding{peerB, index.TierGPU, 0, 9},  // 9
		holding{peerC, index.TierGPU, 0, 8},  // 8 with fewer blocks
		holding{dst, index.TierGPU, 0, 9},    // 9, ties peerB, sorts first
	)
	p := newPicker(t, idx, Config{})
	got, err := p.Score(Request{Model: model, Keys: keys}, nil)
	require.NoError(t, err)
	var order []index.Holder
	for _, s := range got {
		order = append(order, s.Holder)
	}
	require.Equal(t, []index.Holder{dst, peerB, peerA, peerC}, order)

	stranger := index.Holder{Pod: "10.9.9.9:8000"}
	got, err = p.Score(Request{Model: model, Keys: keys, Candidates: []Candidate{{Holder: stranger}, {Holder: peerC}}}, got)
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.Equal(t, peerC, got[0].Holder)
	require.Equal(t, Score{Holder: stranger, Tiers: []index.TierPrefix{}}, got[1])
}

func TestScoreCustomWeights(t *testing.T) {
	keys := seqKeys(4)
	idx := fleet(keys, holding{peerA, index.TierCPU, 0, 4}, holding{peerB, "DISK", 0, 4})
	p := newPicker(t, idx, Config{Weights: map[string]float64{index.TierGPU: 1, index.TierCPU: 0.5, "DISK": 0.25}})
	got, err := p.Score(Request{Model: model, Keys: keys}, nil)
	require.NoError(t, err)
	require.Equal(t, peerA, got[0].Holder)
	require.InDelta(t, 2, got[0].Score, 1e-9)
	require.InDelta(t, 1, got[1].Score, 1e-9)
}

// TestScoreMatchesReferenceModel recomputes every score block by block from
// the raw holdings.
func TestScoreMatchesReferenceModel(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	weights := map[string]float64{"GPU": 1, "CPU": 0.8, "DISK": 0.3}
	pods := []index.Holder{dst, peerA, peerB, peerC}
	for iter := range 300 {
		keys := seqKeys(r.IntN(20))
		idx := newBrute()
		for _, h := range pods {
			for tier := range weights {
				for i, k := range keys {
					if r.IntN(12) < 10-i/3 {
						idx.store(model, h, tier, k)
					}
				}
			}
		}
		p := newPicker(t, idx, Config{Weights: weights})
		got, err := p.Score(Request{Model: model, Keys: keys}, nil)
		require.NoError(t, err)
		want := map[index.Holder]float64{}
		for _, h := range pods {
			tierPrefix := map[string]int{}
			for tier := range weights {
				for tierPrefix[tier] < len(keys) && idx.holds(model, h, tier, keys[tierPrefix[tier]]) {
					tierPrefix[tier]++
				}
			}
			score := 0.0
			for i, k := range keys {
				if !idx.holdsAny(model, h, nil, k) {
					break
				}
				w := -1.0
				for tier, tp := range tierPrefix {
					if tp > i {
						w = max(w, weights[tier])
					}
				}
				if w < 0 {
					w = 0.3
				}
				score += w
			}
			if score > 0 {
				want[h] = score
			}
		}
		require.Len(t, got, len(want), "iteration %d", iter)
		for i, s := range got {
			require.InDelta(t, want[s.Holder], s.Score, 1e-9, fmt.Sprint("iteration ", iter))
			if i > 0 {
				require.GreaterOrEqual(t, got[i-1].Score, s.Score)
			}
		}
	}
}

func TestScoreAllocatesNothingWithAReusedSlice(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts need a build without -race")
	}
	keys := seqKeys(64)
	idx := fleet(keys, holding{peerA, index.TierCPU, 0, 64}, holding{peerA, index.TierGPU, 0, 30},
		holding{peerB, index.TierGPU, 0, 50}, holding{peerC, index.TierCPU, 0, 10})
	p := newPicker(t, idx, Config{})
	req := Request{Model: model, Keys: keys}
	var dst []Score
	allocs := testing.AllocsPerRun(100, func() {
		var err error
		dst, err = p.Score(req, dst)
		if err != nil || len(dst) != 3 {
			t.Fatal(err, len(dst))
		}
	})
	require.Zero(t, allocs)
}

// A prompt routed to peerA whose prefill has stored half its blocks
// weighs as much as the same prompt routed to peerB with nothing stored
// yet: guesses weigh as GPU blocks, as upstream weighs them, and the
// engine's stores do not make the rest weigh less.
func TestScoreWeighsAPartlyStoredPromptsGuessesAsGPU(t *testing.T) {
	keys := seqKeys(40)
	idx := index.New(index.Config{})
	spec := index.NewSpeculative(idx, index.SpeculativeConfig{TTL: time.Hour})
	spec.Record(model, peerA, keys)
	spec.Record(model, peerB, keys)
	spec.Store(index.Blocks{Model: model, Holder: peerA, Tier: index.TierGPU, Keys: keys[:20]})
	p := newPicker(t, idx, Config{})
	got, err := p.Score(Request{Model: model, Keys: keys}, nil)
	require.NoError(t, err)
	require.Len(t, got, 2)
	for _, s := range got {
		require.InDelta(t, 40, s.Score, 1e-9, "%v", s.Holder)
	}
}
