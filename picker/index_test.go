package picker

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// toIndex copies b's holdings of keys into a real index, each block stored
// with its parent as an engine reports it.
func toIndex(b *bruteIndex, keys []uint64) *index.Index {
	ix := index.New(index.Config{})
	for m, hs := range b.m {
		for h, ts := range hs {
			for tier, ks := range ts {
				for i, k := range keys {
					if ks[k] {
						var parent uint64
						if i > 0 {
							parent = keys[i-1]
						}
						ix.Store(index.Blocks{Model: m, Holder: h, Tier: tier, Parent: parentIf(i > 0, parent), Keys: keys[i : i+1]})
					}
				}
			}
		}
	}
	return ix
}

// TestPickAndScoreAgreeOnRealIndex runs random fleets through the picker
// twice, over the reference index and over *index.Index, and requires the
// same decisions and scores.
func TestPickAndScoreAgreeOnRealIndex(t *testing.T) {
	pods := []index.Holder{dst, peerA, peerB, peerC, {Pod: "10.0.0.2:8000", Rank: 1}}
	checkPickAndScoreAgree(t, rand.New(rand.NewPCG(11, 12)), pods, 300)
}

// With more holders than the prompt has blocks, *index.Index finds a
// block's holders from the prompt's roots (HoldersAt) rather than by
// asking every holder; the decisions must not change.
func TestPickAgreesOnRealIndexWithMoreHoldersThanBlocks(t *testing.T) {
	pods := []index.Holder{dst}
	for i := range 60 {
		pods = append(pods, index.Holder{Pod: fmt.Sprintf("10.7.0.%d:8000", i%30), Rank: i / 30})
	}
	checkPickAndScoreAgree(t, rand.New(rand.NewPCG(13, 14)), pods, 100)
}

func checkPickAndScoreAgree(t *testing.T, r *rand.Rand, pods []index.Holder, iters int) {
	for iter := range iters {
		keys := seqKeys(1 + r.IntN(40))
		b := newBrute()
		for _, h := range pods {
			for _, tier := range []string{index.TierGPU, index.TierCPU} {
				end := r.IntN(len(keys) + 1)
				for i := r.IntN(3); i < end; i++ {
					if r.IntN(20) > 0 {
						b.store(model, h, tier, keys[i])
					}
				}
			}
		}
		ref := newPicker(t, b, Config{})
		real := newPicker(t, toIndex(b, keys), Config{})
		req := Request{ID: fmt.Sprint(iter), Model: model, Keys: keys, Destination: dst}
		want, err := ref.Pick(req)
		require.NoError(t, err)
		got, err := real.Pick(req)
		require.NoError(t, err)
		want.pull, got.pull = nil, nil
		require.Equal(t, want, got, "iteration %d", iter)

		ws, err := ref.Score(req, nil)
		require.NoError(t, err)
		gs, err := real.Score(req, nil)
		require.NoError(t, err)
		require.Len(t, gs, len(ws))
		for i := range ws {
			require.Equal(t, ws[i].Holder, gs[i].Holder)
			require.Equal(t, ws[i].Blocks, gs[i].Blocks)
			require.InDelta(t, ws[i].Score, gs[i].Score, 1e-9)
			require.ElementsMatch(t, ws[i].Tiers, gs[i].Tiers)
		}
	}
}

func TestPickOnRealIndexAllocatesOnlyTheMissingKeysAndTheClaim(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts need a build without -race")
	}
	p, req := benchFleet(t, 8192, 16)
	allocs := testing.AllocsPerRun(100, func() {
		d, err := p.Pick(req)
		if err != nil || d.Reason != ReasonPull {
			t.Fatal(d.Reason, err)
		}
		d.Done()
	})
	require.LessOrEqual(t, allocs, 2.0, "the missing keys and the pull's claim")
}

// benchFleet builds a fleet for a prompt of the given length: a destination
// holding a quarter of it on GPU and holders-1 peers holding CPU prefixes of
// various lengths (every fourth the whole prompt) plus GPU copies.
func benchFleet(tb testing.TB, tokens, holders int) (*Picker, Request) {
	h, err := hashing.New(hashing.Config{})
	require.NoError(tb, err)
	prompt := hashing.Request{Tokens: make([]uint32, tokens)}
	for i := range prompt.Tokens {
		prompt.Tokens[i] = uint32(i*2654435761) % 150000
	}
	keys, err := h.BlockKeys(nil, prompt)
	require.NoError(tb, err)
	ix := index.New(index.Config{MaxHolderBlocks: -1})
	n := len(keys)
	ix.Store(index.Blocks{Model: model, Holder: dst, Tier: index.TierGPU, Keys: keys[:n/4]})
	var cands []Candidate
	for i := 1; i < holders; i++ {
		peer := index.Holder{Pod: fmt.Sprintf("10.1.%d.%d:8000", i/256, i%256)}
		cpu := n
		if i%4 != 0 {
			cpu = n * (holders - i) / holders
		}
		ix.Store(index.Blocks{Model: model, Holder: peer, Tier: index.TierCPU, Keys: keys[:cpu]})
		ix.Store(index.Blocks{Model: model, Holder: peer, Tier: index.TierGPU, Keys: keys[:cpu/2]})
		cands = append(cands, Candidate{Holder: peer, Waiting: i % 5})
	}
	p, err := New(Config{Index: ix, Hasher: h})
	require.NoError(tb, err)
	return p, Request{ID: "bench", Model: model, Keys: keys, Prompt: prompt, Destination: dst, Candidates: cands}
}

// BenchmarkPick decides a 32,768-token prompt (2,048 blocks of 16) over 64
// holders, with the block keys given and with hashing (vLLM's default
// sha256) included; hashing-20k is the 20,000-token prompt of
// cmd/kvsource's BenchmarkServe/pick-20k. hashing-warm is a next turn
// through a Config.HashCache: each iteration's prompt shares its first
// 30,720 tokens with earlier ones and has 2,048 new ones; each iteration
// also runs the uncached Pick of the same prompt right after, so that
// x-cold, the ratio of the two times, is measured under the same load.
func BenchmarkPick(b *testing.B) {
	p, req := benchFleet(b, 32768, 64)
	hashed := req
	hashed.Keys = nil
	for _, bc := range []struct {
		name string
		req  Request
	}{{"keys", req}, {"hashing", hashed}} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				d, err := p.Pick(bc.req)
				if err != nil || d.Reason != ReasonPull {
					b.Fatal(d.Reason, err)
				}
				d.Done()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/pick")
		})
	}
	b.Run("hashing-20k", func(b *testing.B) {
		p, req := benchFleet(b, 20000, 64)
		req.Keys = nil
		b.ReportAllocs()
		for b.Loop() {
			d, err := p.Pick(req)
			if err != nil || d.Reason != ReasonPull {
				b.Fatal(d.Reason, err)
			}
			d.Done()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/pick")
	})
	b.Run("hashing-warm", func(b *testing.B) {
		const shared = 30720
		cache := hashing.NewCache(hashing.CacheConfig{})
		pc, err := New(Config{Index: p.idx, Hasher: p.hasher, HashCache: cache})
		require.NoError(b, err)
		warm := hashed
		warm.Prompt.Tokens = slices.Clone(hashed.Prompt.Tokens)
		pick := func(p *Picker) {
			d, err := p.Pick(warm)
			if err != nil || d.Reason != ReasonPull {
				b.Fatal(d.Reason, err)
			}
			d.Done()
		}
		pick(pc)
		var cached, cold time.Duration
		i := uint32(0)
		b.ReportAllocs()
		for b.Loop() {
			i++
			warm.Prompt.Tokens[shared] = 1<<31 | i // a turn no earlier call sent
			t0 := time.Now()
			pick(pc)
			t1 := time.Now()
			pick(p)
			cold += time.Since(t1)
			cached += t1.Sub(t0)
		}
		b.ReportMetric(float64(cached.Nanoseconds())/float64(b.N), "ns/pick")
		b.ReportMetric(float64(cold.Nanoseconds())/float64(b.N), "ns/cold-pick")
		b.ReportMetric(float64(cached)/float64(cold), "x-cold")
		st := cache.Stats()
		b.ReportMetric(float64(st.HitBlocks)/float64(st.HitBlocks+st.MissBlocks), "hit-rate")
	})
}

// BenchmarkScore scores the same prompt over the same 64 holders.
func BenchmarkScore(b *testing.B) {
	p, req := benchFleet(b, 32768, 64)
	req.Candidates = nil
	var out []Score
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if out, err = p.Score(req, out); err != nil || len(out) != 64 {
			b.Fatal(len(out), err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/score")
}

// parentIf is index.Blocks.Parent for a chain that continues from p when ok.
func parentIf(ok bool, p uint64) index.Parent {
	if !ok {
		return index.Parent{}
	}
	return index.ParentKey(p)
}
