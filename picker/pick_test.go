package picker

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

const model = "m"

var (
	dst   = index.Holder{Pod: "10.0.0.1:8000"}
	peerA = index.Holder{Pod: "10.0.0.2:8000"}
	peerB = index.Holder{Pod: "10.0.0.3:8000"}
	peerC = index.Holder{Pod: "10.0.0.4:8000"}
)

func seqKeys(n int) []uint64 {
	k := make([]uint64, n)
	for i := range k {
		k[i] = 1000 + uint64(i)
	}
	return k
}

// constRand returns a random source whose Float64 is always u.
func constRand(u float64) *rand.Rand { return rand.New(constSource(uint64(u * (1 << 53)))) }

type constSource uint64

func (s constSource) Uint64() uint64 { return uint64(s) }

func newPicker(t *testing.T, idx Index, cfg Config) *Picker {
	t.Helper()
	cfg.Index = idx
	p, err := New(cfg)
	require.NoError(t, err)
	return p
}

type holding struct {
	h        index.Holder
	tier     string
	from, to int
}

func fleet(keys []uint64, hs ...holding) *bruteIndex {
	b := newBrute()
	for _, x := range hs {
		b.store(model, x.h, x.tier, keys[x.from:x.to]...)
	}
	return b
}

func TestPickReasons(t *testing.T) {
	keys := seqKeys(16)
	cases := []struct {
		name      string
		hold      []holding
		keys      []uint64
		threshold int
		reason    Reason
		source    index.Holder
		cached    int
		gain      int
		best      int
	}{
		{name: "prompt without a full block is no_holder", keys: []uint64{}, reason: ReasonNoHolder},
		{name: "cold prompt is no_holder", reason: ReasonNoHolder},
		{name: "peer holding block 0 only on GPU is no_holder",
			hold: []holding{{peerA, index.TierGPU, 0, 16}}, reason: ReasonNoHolder},
		{name: "peer holding only speculative blocks is no source: no_holder",
			hold: []holding{{peerA, index.TierSpeculative, 0, 16}}, reason: ReasonNoHolder},
		{name: "destination's speculative blocks count as cached: local_hit",
			hold:   []holding{{dst, index.TierSpeculative, 0, 16}, {peerA, index.TierCPU, 0, 16}},
			reason: ReasonLocalHit, cached: 16},
		{name: "destination holding every block across tiers is local_hit",
			hold:   []holding{{dst, index.TierGPU, 0, 8}, {dst, index.TierCPU, 8, 16}, {peerA, index.TierCPU, 0, 16}},
			reason: ReasonLocalHit, cached: 16},
		{name: "peer holding no more than the destination is self",
			hold: []holding{{dst, index.TierGPU, 0, 6}, {peerA, index.TierCPU, 0, 6}}, reason: ReasonSelf, cached: 6},
		{name: "peer extending only on GPU is self",
			hold:   []holding{{dst, index.TierGPU, 0, 6}, {peerA, index.TierCPU, 0, 6}, {peerA, index.TierGPU, 0, 16}},
			reason: ReasonSelf, cached: 6},
		{name: "gain below the threshold is below_threshold",
			hold: []holding{{dst, index.TierGPU, 0, 6}, {peerA, index.TierCPU, 0, 9}}, threshold: 64,
			reason: ReasonBelowThreshold, cached: 6, best: 3},
		{name: "gain reaching the threshold exactly pulls",
			hold: []holding{{dst, index.TierGPU, 0, 6}, {peerA, index.TierCPU, 0, 10}}, threshold: 64,
			reason: ReasonPull, source: peerA, cached: 6, gain: 4, best: 4},
		{name: "gain counts from the destination's prefix, not from block 0",
			hold:   []holding{{dst, index.TierGPU, 0, 6}, {peerA, index.TierCPU, 6, 12}, {peerB, index.TierCPU, 0, 10}},
			reason: ReasonPull, source: peerA, cached: 6, gain: 6, best: 6},
		{name: "gain stops at the first block outside the pullable tiers",
			hold:   []holding{{dst, index.TierGPU, 0, 2}, {peerA, index.TierCPU, 0, 5}, {peerA, index.TierGPU, 5, 16}},
			reason: ReasonPull, source: peerA, cached: 2, gain: 3, best: 3},
		{name: "destination's CPU blocks count toward its prefix",
			hold:   []holding{{dst, index.TierGPU, 0, 3}, {dst, index.TierCPU, 3, 8}, {peerA, index.TierCPU, 0, 12}},
			reason: ReasonPull, source: peerA, cached: 8, gain: 4, best: 4},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			k := keys
			if tc.keys != nil {
				k = tc.keys
			}
			p := newPicker(t, fleet(keys, tc.hold...), Config{MinCachedTokenDelta: tc.threshold})
			d, err := p.Pick(Request{ID: "r", Model: model, Keys: k, Destination: dst})
			require.NoError(t, err)
			require.Equal(t, tc.reason, d.Reason)
			require.Equal(t, tc.source, d.Source)
			require.Equal(t, tc.cached, d.Cached)
			require.Equal(t, tc.gain, d.Gain)
			require.Equal(t, tc.best, d.Best)
			require.Equal(t, len(k)-tc.cached-tc.gain, d.Recompute)
			require.Equal(t, len(k), d.Blocks)
			if tc.gain > 0 {
				require.Equal(t, k[tc.cached:tc.cached+tc.gain], d.Missing)
			} else {
				require.Nil(t, d.Missing)
			}
		})
	}
}

func TestPickBandIsOneBlockWide(t *testing.T) {
	keys := seqKeys(20)
	idx := fleet(keys,
		holding{dst, index.TierGPU, 0, 4},
		holding{peerA, index.TierCPU, 0, 14}, // gain 10
		holding{peerB, index.TierCPU, 0, 13}, // gain 9, within one block
		holding{peerC, index.TierCPU, 0, 12}, // gain 8, outside
	)
	p := newPicker(t, idx, Config{})
	seen := map[index.Holder]int{}
	for i := range 200 {
		d, err := p.Pick(Request{ID: fmt.Sprint("req-", i), Model: model, Keys: keys, Destination: dst})
		require.NoError(t, err)
		require.Equal(t, ReasonPull, d.Reason)
		require.Equal(t, 10, d.Best)
		seen[d.Source]++
		require.Equal(t, map[index.Holder]int{peerA: 10, peerB: 9}[d.Source], d.Gain)
		require.Equal(t, keys[4:4+d.Gain], d.Missing)
		d.Done()
	}
	require.Zero(t, seen[peerC])
	require.Positive(t, seen[peerA])
	require.Positive(t, seen[peerB])
}

func TestPickBandExcludesGainsBelowTheThreshold(t *testing.T) {
	keys := seqKeys(20)
	idx := fleet(keys,
		holding{peerA, index.TierCPU, 0, 4}, // 64 tokens: meets a 64-token threshold
		holding{peerB, index.TierCPU, 0, 3}, // within one block, but 48 tokens
	)
	p := newPicker(t, idx, Config{MinCachedTokenDelta: 64})
	for i := range 50 {
		d, err := p.Pick(Request{ID: fmt.Sprint(i), Model: model, Keys: keys, Destination: dst})
		require.NoError(t, err)
		require.Equal(t, peerA, d.Source)
	}
}

func TestPickWeightsSourcesByLoad(t *testing.T) {
	keys := seqKeys(8)
	idx := fleet(keys, holding{peerA, index.TierCPU, 0, 8}, holding{peerB, index.TierCPU, 0, 8})
	p := newPicker(t, idx, Config{})
	// Weights 1/(1+0) and 1/(1+3): peerA takes 0.8 of the draws. peerA sorts
	// first, so draws below 0.8 go to it.
	cands := []Candidate{{Holder: peerA}, {Holder: peerB, Waiting: 2, Load: 1}}
	for _, tc := range []struct {
		u    float64
		want index.Holder
	}{{0.0, peerA}, {0.79, peerA}, {0.81, peerB}, {0.999, peerB}} {
		d, err := p.Pick(Request{Model: model, Keys: keys, Destination: dst, Candidates: cands, Rand: constRand(tc.u)})
		require.NoError(t, err)
		require.Equal(t, tc.want, d.Source, "u=%v", tc.u)
		d.Done()
	}
	// Negative and NaN loads count as none.
	bad := []Candidate{{Holder: peerA, Load: math.NaN()}, {Holder: peerB, Waiting: -4, Load: -1}}
	for _, u := range []float64{0.49, 0.51} {
		d, err := p.Pick(Request{Model: model, Keys: keys, Destination: dst, Candidates: bad, Rand: constRand(u)})
		require.NoError(t, err)
		require.Equal(t, map[bool]index.Holder{true: peerA, false: peerB}[u < 0.5], d.Source, "u=%v", u)
		d.Done()
	}
	r := rand.New(rand.NewPCG(1, 2))
	n := 0
	for range 4000 {
		d, err := p.Pick(Request{Model: model, Keys: keys, Destination: dst, Candidates: cands, Rand: r})
		require.NoError(t, err)
		if d.Source == peerA {
			n++
		}
		d.Done()
	}
	require.InDelta(t, 0.8, float64(n)/4000, 0.03)
}

func TestPickSpreadsInflightPulls(t *testing.T) {
	keys := seqKeys(8)
	idx := fleet(keys, holding{peerA, index.TierCPU, 0, 8}, holding{peerB, index.TierCPU, 0, 8})
	now := time.Unix(1_000_000, 0)
	p := newPicker(t, idx, Config{InflightTTL: 8 * time.Second, Now: func() time.Time { return now }})
	req := Request{Model: model, Keys: keys, Destination: dst, Rand: constRand(0.45)}

	first, err := p.Pick(req)
	require.NoError(t, err)
	require.Equal(t, peerA, first.Source, "equal weights: 0.45 falls on the first holder")
	require.Equal(t, 1, p.Inflight(peerA))

	// peerA now weighs 1/2 against peerB's 1: 0.45 of 1.5 lands past peerA.
	second, err := p.Pick(req)
	require.NoError(t, err)
	require.Equal(t, peerB, second.Source)
	require.Equal(t, 1, p.Inflight(peerB))

	first.Done()
	first.Done()
	require.Equal(t, 0, p.Inflight(peerA), "done releases once")
	third, err := p.Pick(req)
	require.NoError(t, err)
	require.Equal(t, peerA, third.Source, "peerB still has one in flight")

	// Unreleased pulls expire after the TTL.
	now = now.Add(9 * time.Second)
	require.Equal(t, 0, p.Inflight(peerA))
	require.Equal(t, 0, p.Inflight(peerB))
	third.Done()
	require.Equal(t, 0, p.Inflight(peerA), "done after expiry does not go negative")
}

func TestPickBurstSpreadsAcrossEqualSources(t *testing.T) {
	keys := seqKeys(8)
	idx := fleet(keys,
		holding{peerA, index.TierCPU, 0, 8}, holding{peerB, index.TierCPU, 0, 8}, holding{peerC, index.TierCPU, 0, 8})
	holders := []index.Holder{peerA, peerB, peerC}
	// Bursts of 12 requests for one hot prefix, none finished before the
	// next is decided, against the same bursts where each pull finishes at
	// once: only the in-flight counts differ. The in-flight counts must
	// cut the imbalance (the busiest source's excess over an even share).
	const bursts, size = 300, 12
	imbalance := func(release bool) float64 {
		total := 0
		for b := range bursts {
			p := newPicker(t, idx, Config{})
			count := map[index.Holder]int{}
			for i := range size {
				d, err := p.Pick(Request{ID: fmt.Sprint("burst-", b, "-", i), Model: model, Keys: keys, Destination: dst})
				require.NoError(t, err)
				count[d.Source]++
				if release {
					d.Done()
				}
			}
			busiest := 0
			for _, h := range holders {
				busiest = max(busiest, count[h])
				if !release {
					require.Equal(t, count[h], p.Inflight(h))
				}
			}
			total += busiest - size/len(holders)
		}
		return float64(total) / bursts
	}
	held, released := imbalance(false), imbalance(true)
	t.Logf("mean excess of the busiest source: %.2f with in-flight counting, %.2f without", held, released)
	require.Less(t, held, 0.75*released)
}

func TestPickIsReproducibleFromTheRequestID(t *testing.T) {
	keys := seqKeys(8)
	// Two indexes with the same content, built in opposite orders.
	a := fleet(keys, holding{peerA, index.TierCPU, 0, 8}, holding{peerB, index.TierCPU, 0, 8}, holding{peerC, index.TierCPU, 0, 8})
	b := fleet(keys, holding{peerC, index.TierCPU, 0, 8}, holding{peerB, index.TierCPU, 0, 8}, holding{peerA, index.TierCPU, 0, 8})
	pa, pb := newPicker(t, a, Config{}), newPicker(t, b, Config{})
	seen := map[index.Holder]bool{}
	for i := range 60 {
		req := Request{ID: fmt.Sprint("id-", i), Model: model, Keys: keys, Destination: dst}
		da, err := pa.Pick(req)
		require.NoError(t, err)
		db, err := pb.Pick(req)
		require.NoError(t, err)
		require.Equal(t, da.Source, db.Source, "tied holders are drawn in a fixed order")
		da.Done()
		db.Done()
		seen[da.Source] = true
	}
	require.Len(t, seen, 3, "different ids spread over tied holders")
}

func TestPickNeverPicksTheDestinationNorOtherModels(t *testing.T) {
	keys := seqKeys(8)
	idx := fleet(keys, holding{dst, index.TierCPU, 0, 3})
	idx.store("other-model", peerA, index.TierCPU, keys...)
	p := newPicker(t, idx, Config{})
	d, err := p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst})
	require.NoError(t, err)
	require.Equal(t, ReasonSelf, d.Reason)
}

func TestPickTreatsDataParallelRanksAsSeparateHolders(t *testing.T) {
	keys := seqKeys(8)
	sibling := index.Holder{Pod: dst.Pod, Rank: 1}
	idx := fleet(keys, holding{dst, index.TierGPU, 0, 2}, holding{sibling, index.TierCPU, 0, 8})
	p := newPicker(t, idx, Config{})
	d, err := p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst})
	require.NoError(t, err)
	require.Equal(t, ReasonPull, d.Reason)
	require.Equal(t, sibling, d.Source)
	require.Equal(t, DefaultP2PPort+1, d.KVTransferParams("k").RemoteKVSource.RemotePort)
}

func TestPickPrefillDecode(t *testing.T) {
	// Turn 2 of a conversation: the decode pod that produced turn 1 holds the
	// whole history (GPU, offloaded to CPU); the router sends the prefill to
	// a prefill pod that computed only the shared system prompt.
	keys := seqKeys(64)
	prefill := index.Holder{Pod: "prefill-0:8000"}
	decode := index.Holder{Pod: "decode-0:8000"}
	otherPrefill := index.Holder{Pod: "prefill-1:8000"}
	idx := fleet(keys,
		holding{prefill, index.TierGPU, 0, 8},
		holding{otherPrefill, index.TierCPU, 0, 8},
		holding{decode, index.TierGPU, 0, 64},
		holding{decode, index.TierCPU, 0, 60},
	)
	p := newPicker(t, idx, Config{MinCachedTokenDelta: 256})
	d, err := p.Pick(Request{ID: "turn-2", Model: model, Keys: keys, Destination: prefill,
		Candidates: []Candidate{{Holder: prefill}, {Holder: decode, Waiting: 5}, {Holder: otherPrefill}}})
	require.NoError(t, err)
	require.Equal(t, ReasonPull, d.Reason)
	require.Equal(t, decode, d.Source)
	require.Equal(t, 8, d.Cached)
	require.Equal(t, 52, d.Gain)
	require.Equal(t, 4, d.Recompute)
	require.Equal(t, keys[8:60], d.Missing)
}

func TestPickCandidatesRestrictSources(t *testing.T) {
	keys := seqKeys(10)
	idx := fleet(keys, holding{peerA, index.TierCPU, 0, 10}, holding{peerB, index.TierCPU, 0, 5})
	p := newPicker(t, idx, Config{})
	d, err := p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst, Candidates: []Candidate{{Holder: peerB}}})
	require.NoError(t, err)
	require.Equal(t, peerB, d.Source)
	require.Equal(t, 5, d.Best)
}

func TestPickRequestThresholdOverridesConfig(t *testing.T) {
	keys := seqKeys(10)
	idx := fleet(keys, holding{peerA, index.TierCPU, 0, 4})
	p := newPicker(t, idx, Config{MinCachedTokenDelta: 1024})
	d, err := p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst})
	require.NoError(t, err)
	require.Equal(t, ReasonBelowThreshold, d.Reason)
	d, err = p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst, MinCachedTokenDelta: 64})
	require.NoError(t, err)
	require.Equal(t, ReasonPull, d.Reason)
}

func TestPickWithCostModelDecidesByPredictedSaving(t *testing.T) {
	// Recompute 0.1 ms/token, pull 50 ms + 0.01 ms/token: a pull pays from
	// about 556 tokens on, i.e. 35 blocks of 16.
	m := &Model{Recompute: Quadratic{A: 10, B: 0.1}, Pull: Linear{Floor: 60, PerToken: 0.01}}
	keys := seqKeys(100)
	for _, tc := range []struct {
		cached int
		reason Reason
	}{{0, ReasonPull}, {60, ReasonPull}, {66, ReasonBelowThreshold}, {90, ReasonBelowThreshold}} {
		p := newPicker(t, fleet(keys, holding{peerA, index.TierCPU, 0, 100}, holding{dst, index.TierGPU, 0, tc.cached}), Config{Cost: m})
		d, err := p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst})
		require.NoError(t, err)
		require.Equal(t, tc.reason, d.Reason, "cached %d", tc.cached)
		if d.Reason == ReasonPull {
			g := float64(100-tc.cached) * 16
			require.InDelta(t, 0.1*g-60-0.01*g+10, d.SavingMillis, 1e-9)
		}
	}
}

func TestPickHashesThePrompt(t *testing.T) {
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 16*10+5)
	for i := range tokens {
		tokens[i] = uint32(i * 7)
	}
	prompt := hashing.Request{Tokens: tokens, LoRAName: "adapter", CacheSalt: "s"}
	keys, err := h.BlockKeys(nil, prompt)
	require.NoError(t, err)
	require.Len(t, keys, 10)
	idx := fleet(keys, holding{dst, index.TierGPU, 0, 3}, holding{peerA, index.TierCPU, 0, 10})
	p := newPicker(t, idx, Config{Hasher: h})
	d, err := p.Pick(Request{ID: "x", Model: model, Prompt: prompt, Destination: dst})
	require.NoError(t, err)
	require.Equal(t, ReasonPull, d.Reason)
	require.Equal(t, keys[3:10], d.Missing)

	_, err = p.Pick(Request{ID: "x", Model: model, Prompt: hashing.Request{Tokens: tokens, MM: []hashing.MMItem{{ID: "i", Offset: -1, Length: 2}}}, Destination: dst})
	require.ErrorIs(t, err, ErrHash)
}

func TestPickErrors(t *testing.T) {
	p := newPicker(t, newBrute(), Config{})
	_, err := p.Pick(Request{Model: model, Keys: seqKeys(2)})
	require.ErrorIs(t, err, ErrNoDestination)
	_, err = p.Pick(Request{Model: model, Destination: dst})
	require.ErrorIs(t, err, ErrNoKeys)
	_, err = New(Config{})
	require.ErrorIs(t, err, ErrNoIndex)
	h, err := hashing.New(hashing.Config{BlockSize: 32})
	require.NoError(t, err)
	_, err = New(Config{Index: newBrute(), Hasher: h, BlockSize: 16})
	require.Error(t, err)
	_, err = New(Config{Index: newBrute(), Weights: map[string]float64{"GPU": -1}})
	require.Error(t, err)
}

func TestDecisionRendersSourceForLLMDAndVLLM(t *testing.T) {
	keys := seqKeys(8)
	for _, tc := range []struct {
		name   string
		src    index.Holder
		port   int
		header string
		json   string
	}{
		{"ipv4 rank 0", index.Holder{Pod: "10.0.0.2:8000"}, 0, "10.0.0.2:8000",
			`{"remote_kv_source":{"kv_request_id":"req-1","remote_host":"10.0.0.2","remote_port":5710}}`},
		{"rank adds to the port", index.Holder{Pod: "10.0.0.2:8000", Rank: 3}, 7777, "10.0.0.2:8003",
			`{"remote_kv_source":{"kv_request_id":"req-1","remote_host":"10.0.0.2","remote_port":7780}}`},
		{"ipv6", index.Holder{Pod: "[fd00::2]:8000"}, 0, "[fd00::2]:8000",
			`{"remote_kv_source":{"kv_request_id":"req-1","remote_host":"fd00::2","remote_port":5710}}`},
		{"ipv6 rank adds to the port", index.Holder{Pod: "[fd00::2]:8000", Rank: 2}, 0, "[fd00::2]:8002",
			`{"remote_kv_source":{"kv_request_id":"req-1","remote_host":"fd00::2","remote_port":5712}}`},
		{"rank of a pod without port keeps the pod", index.Holder{Pod: "pod-2.svc", Rank: 1}, 0, "pod-2.svc",
			`{"remote_kv_source":{"kv_request_id":"req-1","remote_host":"pod-2.svc","remote_port":5711}}`},
		{"rank of a bare ipv6 keeps the pod", index.Holder{Pod: "fd00::2", Rank: 1}, 0, "fd00::2",
			`{"remote_kv_source":{"kv_request_id":"req-1","remote_host":"fd00::2","remote_port":5711}}`},
		{"rank past the last port keeps the pod", index.Holder{Pod: "10.0.0.2:65535", Rank: 1}, 0, "10.0.0.2:65535",
			`{"remote_kv_source":{"kv_request_id":"req-1","remote_host":"10.0.0.2","remote_port":5711}}`},
		{"pod without port", index.Holder{Pod: "pod-2.svc"}, 0, "pod-2.svc",
			`{"remote_kv_source":{"kv_request_id":"req-1","remote_host":"pod-2.svc","remote_port":5710}}`},
		{"bare ipv6 without port", index.Holder{Pod: "fd00::2"}, 0, "fd00::2",
			`{"remote_kv_source":{"kv_request_id":"req-1","remote_host":"fd00::2","remote_port":5710}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPicker(t, fleet(keys, holding{tc.src, index.TierCPU, 0, 8}), Config{P2PPort: tc.port})
			d, err := p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst})
			require.NoError(t, err)
			name, value := d.Header()
			require.Equal(t, HeaderKVCacheSource, name)
			require.Equal(t, tc.header, value)
			b, err := json.Marshal(d.KVTransferParams("req-1"))
			require.NoError(t, err)
			require.JSONEq(t, tc.json, string(b))
		})
	}
	p := newPicker(t, fleet(keys, holding{index.Holder{Pod: "[fd00::2]:8000", Rank: 2}, index.TierCPU, 0, 8}), Config{})
	d, err := p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst})
	require.NoError(t, err)
	require.Equal(t, "[fd00::2]:5712", d.P2PAddress())

	p = newPicker(t, newBrute(), Config{})
	d, err = p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst})
	require.NoError(t, err)
	name, value := d.Header()
	require.Empty(t, name)
	require.Empty(t, value)
	require.Nil(t, d.KVTransferParams("req-1").RemoteKVSource)
	require.Empty(t, d.P2PAddress())
	b, err := json.Marshal(d.KVTransferParams("req-1"))
	require.NoError(t, err)
	require.Equal(t, `{}`, string(b))
}

// TestPickMatchesReferenceModel checks Pick on random fleets against a
// decision computed independently from the raw holdings.
func TestPickMatchesReferenceModel(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	tiers := []string{index.TierGPU, index.TierCPU}
	pods := []index.Holder{dst, peerA, peerB, peerC, {Pod: "10.0.0.5:8000"}, {Pod: "10.0.0.2:8000", Rank: 1}}
	for iter := range 500 {
		n := r.IntN(24)
		keys := seqKeys(n)
		idx := newBrute()
		for _, h := range pods {
			for _, tier := range tiers {
				for i, k := range keys {
					// Mostly prefixes, with holes.
					if r.IntN(10) < 8-i/4 {
						idx.store(model, h, tier, k)
					}
				}
			}
		}
		threshold := []int{1, 16, 48, 100}[r.IntN(4)]
		p := newPicker(t, idx, Config{MinCachedTokenDelta: threshold})
		d, err := p.Pick(Request{ID: fmt.Sprint(iter), Model: model, Keys: keys, Destination: dst})
		require.NoError(t, err)

		l := 0
		for l < n && (idx.holds(model, dst, "GPU", keys[l]) || idx.holds(model, dst, "CPU", keys[l])) {
			l++
		}
		gains := map[index.Holder]int{}
		best := 0
		for _, h := range pods[1:] {
			g := 0
			for l+g < n && idx.holds(model, h, "CPU", keys[l+g]) {
				g++
			}
			gains[h] = g
			best = max(best, g)
		}
		want := ReasonPull
		switch {
		case n == 0:
			want = ReasonNoHolder
		case l == n:
			want = ReasonLocalHit
		case best == 0 && l == 0:
			want = ReasonNoHolder
		case best == 0:
			want = ReasonSelf
		case best*16 < threshold:
			want = ReasonBelowThreshold
		}
		require.Equal(t, want, d.Reason, "iteration %d", iter)
		require.Equal(t, l, d.Cached)
		if want != ReasonLocalHit && n > 0 {
			require.Equal(t, best, d.Best)
		}
		if want == ReasonPull {
			g := gains[d.Source]
			require.GreaterOrEqual(t, g, best-1)
			require.GreaterOrEqual(t, g*16, threshold)
			require.Equal(t, g, d.Gain)
			require.Equal(t, keys[l:l+g], d.Missing)
			require.Equal(t, n-l-g, d.Recompute)
		}
		d.Done()
	}
}

func TestPickAllocatesOnlyTheMissingKeysAndTheClaim(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts need a build without -race")
	}
	keys := seqKeys(256)
	idx := fleet(keys, holding{dst, index.TierGPU, 0, 10},
		holding{peerA, index.TierCPU, 0, 256}, holding{peerB, index.TierCPU, 0, 255}, holding{peerC, index.TierCPU, 0, 100})
	p := newPicker(t, idx, Config{})
	req := Request{ID: "x", Model: model, Keys: keys, Destination: dst,
		Candidates: []Candidate{{Holder: peerA, Waiting: 1}, {Holder: peerB}, {Holder: peerC}}}
	allocs := testing.AllocsPerRun(200, func() {
		d, err := p.Pick(req)
		if err != nil || d.Reason != ReasonPull {
			t.Fatalf("pick: %v %v", d.Reason, err)
		}
		d.Done()
	})
	require.LessOrEqual(t, allocs, 2.0, "the missing keys and the pull's claim")
	local := req
	local.Destination = peerA
	allocs = testing.AllocsPerRun(200, func() {
		if _, err := p.Pick(local); err != nil {
			t.Fatal(err)
		}
	})
	require.Zero(t, allocs)
}

// TestPickCountsInflightPullsUnderConcurrency races picks and releases from
// many goroutines: every pull is counted once and every release undoes
// exactly one.
func TestPickCountsInflightPullsUnderConcurrency(t *testing.T) {
	keys := seqKeys(8)
	b := fleet(keys, holding{peerA, index.TierCPU, 0, 8}, holding{peerB, index.TierCPU, 0, 8}, holding{peerC, index.TierCPU, 0, 8})
	now := time.Unix(1_000_000, 0)
	p := newPicker(t, toIndex(b, keys), Config{Now: func() time.Time { return now }})
	const workers, picks = 8, 300
	kept := make([][]Decision, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range picks {
				d, err := p.Pick(Request{ID: fmt.Sprint(w, "-", i), Model: model, Keys: keys, Destination: dst})
				if err != nil || d.Reason != ReasonPull {
					t.Errorf("pick: %v %v", d.Reason, err)
					return
				}
				if i%3 == 0 {
					kept[w] = append(kept[w], d)
				} else {
					d.Done()
				}
			}
		})
	}
	wg.Wait()
	inflight := func() int { return p.Inflight(peerA) + p.Inflight(peerB) + p.Inflight(peerC) }
	require.Equal(t, workers*picks/3, inflight())
	for w := range kept {
		wg.Go(func() {
			for i := range kept[w] {
				kept[w][i].Done()
			}
		})
	}
	wg.Wait()
	require.Zero(t, inflight())
}

func TestPickNeverPullsUnderTheThresholdOfACalibrationWherePullsNeverPay(t *testing.T) {
	keys := seqKeys(16)
	idx := fleet(keys, holding{peerA, index.TierCPU, 0, 16})
	for _, tc := range []struct {
		name     string
		cfg, req int
	}{{"config", math.MaxInt, 0}, {"request", 0, math.MaxInt}, {"both", math.MaxInt, math.MaxInt - 1}} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPicker(t, idx, Config{MinCachedTokenDelta: tc.cfg})
			d, err := p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst, MinCachedTokenDelta: tc.req})
			require.NoError(t, err)
			require.Equal(t, ReasonBelowThreshold, d.Reason)
			require.Equal(t, 16, d.Best)
		})
	}
}

func TestPickInflightPullCountsForSevenEighthsToAllOfTheTTL(t *testing.T) {
	keys := seqKeys(8)
	idx := fleet(keys, holding{peerA, index.TierCPU, 0, 8})
	start := time.Unix(1_000_000, 0)
	for _, offset := range []time.Duration{0, 500 * time.Millisecond, 999 * time.Millisecond} {
		now := start.Add(offset)
		p := newPicker(t, idx, Config{InflightTTL: 8 * time.Second, Now: func() time.Time { return now }})
		_, err := p.Pick(Request{ID: "x", Model: model, Keys: keys, Destination: dst})
		require.NoError(t, err)
		picked := now
		now = picked.Add(7*time.Second - time.Millisecond)
		require.Equal(t, 1, p.Inflight(peerA), "picked at +%v, checked 7s later", offset)
		now = picked.Add(8 * time.Second)
		require.Zero(t, p.Inflight(peerA), "picked at +%v, checked a TTL later", offset)
	}
}
