package kvhints_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/picker/kvhints"
)

const model = "m"

var (
	dst   = index.Holder{Pod: "10.0.0.1:8000"}
	peerA = index.Holder{Pod: "10.0.0.2:8000"}
	peerB = index.Holder{Pod: "10.0.0.3:8000"}
	// peerA1 is peerA's data-parallel rank 1.
	peerA1 = index.Holder{Pod: "10.0.0.2:8000", Rank: 1}
)

func promptKeys(n int) []uint64 {
	k := make([]uint64, n)
	for i := range k {
		// Large values, where float64 would lose bits.
		k[i] = 1<<63 + 1<<53 + uint64(i)*977
	}
	return k
}

type hold struct {
	h        index.Holder
	tier     string
	from, to int
}

// world is an index holding hs, a picker on it and a hinter whose
// endpoints are eps.
type world struct {
	pk   *picker.Picker
	hint *kvhints.Hinter
}

func newWorld(t *testing.T, keys []uint64, cfg picker.Config, hc kvhints.Config, hs ...hold) world {
	t.Helper()
	idx := index.New(index.Config{})
	for _, x := range hs {
		idx.Store(index.Blocks{Model: model, Holder: x.h, Tier: x.tier, Keys: keys[x.from:x.to]})
	}
	cfg.Index = idx
	pk, err := picker.New(cfg)
	require.NoError(t, err)
	return world{pk: pk, hint: kvhints.New(hc)}
}

func endpoints(t *testing.T, eps ...kvhints.Endpoint) *kvhints.Endpoints {
	t.Helper()
	var e kvhints.Endpoints
	for _, ep := range eps {
		require.NoError(t, e.Add(ep))
	}
	return &e
}

func ep(h index.Holder, addr string, wt kvhints.WorkerType) kvhints.Endpoint {
	return kvhints.Endpoint{Holder: h, Address: addr, WorkerType: wt}
}

// The fleet of most cases: every holder an aggregated KVCR engine.
func aggregated(t *testing.T) *kvhints.Endpoints {
	return endpoints(t,
		ep(dst, "tcp://10.0.0.1:17771", ""),
		ep(peerA, "tcp://10.0.0.2:17771", kvhints.Aggregated),
		ep(peerA1, "tcp://10.0.0.2:17772", kvhints.Aggregated),
		ep(peerB, "tcp://[fd00::3]:17771", "agg"))
}

func TestHintsOnlyWherePickerDecidesAPullAndTheSpecsRulesHold(t *testing.T) {
	const cpu, gpu = index.TierCPU, index.TierGPU
	keys := promptKeys(10)
	tests := []struct {
		name      string
		hold      []hold
		eps       func(t *testing.T) *kvhints.Endpoints
		cfg       picker.Config
		content   bool
		reason    kvhints.Reason
		endpoint  string
		hashes    int // len(BlockHashes): Cached+Gain
		candidate []picker.Candidate
	}{
		{name: "a pull from a CPU peer names its endpoint and the prefix from block 0",
			hold: []hold{{dst, gpu, 0, 2}, {peerA, cpu, 0, 8}}, eps: aggregated,
			reason: kvhints.ReasonHinted, endpoint: "tcp://10.0.0.2:17771", hashes: 8},
		{name: "a source of rank 1 is named by rank 1's endpoint",
			hold: []hold{{peerA1, cpu, 0, 6}}, eps: aggregated,
			reason: kvhints.ReasonHinted, endpoint: "tcp://10.0.0.2:17772", hashes: 6},
		{name: "an IPv6 endpoint stays bracketed",
			hold: []hold{{peerB, cpu, 0, 4}}, eps: aggregated,
			reason: kvhints.ReasonHinted, endpoint: "tcp://[fd00::3]:17771", hashes: 4},
		{name: "strictly longer by one block is enough",
			hold: []hold{{dst, gpu, 0, 5}, {peerA, cpu, 0, 6}}, eps: aggregated,
			reason: kvhints.ReasonHinted, endpoint: "tcp://10.0.0.2:17771", hashes: 6},
		{name: "a source as long as the destination is no source",
			hold: []hold{{dst, gpu, 0, 5}, {peerA, cpu, 0, 5}}, eps: aggregated,
			reason: kvhints.ReasonNoPull},
		{name: "a gain below the picker's threshold gets no hint",
			hold: []hold{{dst, gpu, 0, 5}, {peerA, cpu, 0, 6}}, eps: aggregated,
			cfg: picker.Config{MinCachedTokenDelta: 2 * 16}, reason: kvhints.ReasonNoPull},
		{name: "a peer holding the prefix on GPU only is no source by default (KVCR serves from the CPU tier)",
			hold: []hold{{peerA, gpu, 0, 8}}, eps: aggregated, reason: kvhints.ReasonNoPull},
		{name: "a peer the liveness check refuses gets no hint",
			hold: []hold{{peerA, cpu, 0, 8}}, eps: aggregated,
			cfg:    picker.Config{Sources: func(index.Holder) (string, bool) { return "stale", false }},
			reason: kvhints.ReasonNoPull},
		{name: "a source without an endpoint is no hint source",
			hold:   []hold{{peerA, cpu, 0, 8}},
			eps:    func(t *testing.T) *kvhints.Endpoints { return endpoints(t, ep(dst, "tcp://10.0.0.1:17771", "")) },
			reason: kvhints.ReasonNoSourceEndpoint},
		{name: "a destination without an endpoint is not known to run KVCR",
			hold: []hold{{peerA, cpu, 0, 8}},
			eps: func(t *testing.T) *kvhints.Endpoints {
				return endpoints(t, ep(peerA, "tcp://10.0.0.2:17771", ""))
			},
			reason: kvhints.ReasonDestinationNotKVCR},
		{name: "worker types must match",
			hold: []hold{{peerA, cpu, 0, 8}},
			eps: func(t *testing.T) *kvhints.Endpoints {
				return endpoints(t, ep(dst, "tcp://10.0.0.1:17771", kvhints.Prefill), ep(peerA, "tcp://10.0.0.2:17771", kvhints.Aggregated))
			},
			reason: kvhints.ReasonWorkerType},
		{name: "prefill to prefill is hinted",
			hold: []hold{{peerA, cpu, 0, 8}},
			eps: func(t *testing.T) *kvhints.Endpoints {
				return endpoints(t, ep(dst, "tcp://10.0.0.1:17771", kvhints.Prefill), ep(peerA, "tcp://10.0.0.2:17771", kvhints.Prefill))
			},
			reason: kvhints.ReasonHinted, endpoint: "tcp://10.0.0.2:17771", hashes: 8},
		{name: "the decode leg never carries a hint",
			hold: []hold{{peerA, cpu, 0, 8}},
			eps: func(t *testing.T) *kvhints.Endpoints {
				return endpoints(t, ep(dst, "tcp://10.0.0.1:17771", kvhints.Decode), ep(peerA, "tcp://10.0.0.2:17771", kvhints.Decode))
			},
			reason: kvhints.ReasonDecodeLeg},
		{name: "a content-key index has no engine hashes",
			hold: []hold{{peerA, cpu, 0, 8}}, eps: aggregated, content: true,
			reason: kvhints.ReasonContentKeys},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, keys, tc.cfg, kvhints.Config{Endpoints: tc.eps(t), ContentKeys: tc.content}, tc.hold...)
			d, err := w.pk.Pick(picker.Request{ID: "req-1", Model: model, Keys: keys, Destination: dst, Candidates: tc.candidate})
			require.NoError(t, err)
			defer d.Done()
			h, reason, err := w.hint.Hint(&d, keys, "req-1")
			require.NoError(t, err)
			require.Equal(t, tc.reason, reason, "picker: %s", d.Reason)
			if reason != kvhints.ReasonHinted {
				require.Zero(t, h)
				return
			}
			require.Equal(t, picker.ReasonPull, d.Reason)
			require.Equal(t, tc.endpoint, h.SourceControlEndpoint)
			require.Equal(t, keys[:tc.hashes], h.BlockHashes)
			require.Equal(t, d.Cached+d.Gain, len(h.BlockHashes))
			b, err := h.AppendEnvelope(nil)
			require.NoError(t, err)
			v, err := decodeNumbers(b)
			require.NoError(t, err)
			got, err := kvcrParseEnvelope(v)
			require.NoError(t, err)
			require.Equal(t, tc.endpoint, got.endpoint)
		})
	}
}

// Dynamo breaks ties between equally long sources by the smallest
// (worker, rank); kvsource's hint follows the picker's draw, which weighs
// load and in-flight pulls, so a busy smallest holder is passed over.
func TestHintFollowsThePickersLoadAwareDrawNotTheSmallestHolder(t *testing.T) {
	keys := promptKeys(8)
	w := newWorld(t, keys, picker.Config{}, kvhints.Config{Endpoints: aggregated(t)},
		hold{peerA, index.TierCPU, 0, 8}, hold{peerB, index.TierCPU, 0, 8})
	cands := []picker.Candidate{{Holder: peerA, Waiting: 1000}, {Holder: peerB}}
	r := rand.New(rand.NewPCG(1, 2))
	for range 20 {
		d, err := w.pk.Pick(picker.Request{Model: model, Keys: keys, Destination: dst, Candidates: cands, Rand: r})
		require.NoError(t, err)
		h, reason, err := w.hint.Hint(&d, keys, "r")
		require.NoError(t, err)
		require.Equal(t, kvhints.ReasonHinted, reason)
		src, _ := aggregated(t).Lookup(d.Source)
		require.Equal(t, src.Address, h.SourceControlEndpoint, "the hint names the picker's source")
		d.Done()
	}
	// With peerA idle too, the in-flight spreading alternates sources: the
	// hint is never pinned to the smallest holder.
	seen := map[string]int{}
	var open []picker.Decision
	for range 8 {
		d, err := w.pk.Pick(picker.Request{Model: model, Keys: keys, Destination: dst, Rand: r})
		require.NoError(t, err)
		h, _, err := w.hint.Hint(&d, keys, "r")
		require.NoError(t, err)
		seen[h.SourceControlEndpoint]++
		open = append(open, d)
	}
	for i := range open {
		open[i].Done()
	}
	require.Len(t, seen, 2, "%v", seen)
}

func TestHintRefusesKeysThatAreNotTheDecisionsPrompt(t *testing.T) {
	keys := promptKeys(8)
	w := newWorld(t, keys, picker.Config{}, kvhints.Config{Endpoints: aggregated(t)}, hold{peerA, index.TierCPU, 0, 8})
	d, err := w.pk.Pick(picker.Request{Model: model, Keys: keys, Destination: dst})
	require.NoError(t, err)
	defer d.Done()
	_, _, err = w.hint.Hint(&d, keys[:4], "r")
	require.ErrorIs(t, err, kvhints.ErrKeys)
	other := promptKeys(8)
	other[3]++
	_, _, err = w.hint.Hint(&d, other, "r")
	require.ErrorIs(t, err, kvhints.ErrKeys)
	_, _, err = w.hint.Hint(&d, keys, "")
	require.ErrorIs(t, err, kvhints.ErrInvalid)
}

// Decisions the picker never makes are refused all the same.
func TestHintRefusesASourceThatIsTheDestinationOrNoLonger(t *testing.T) {
	hint := kvhints.New(kvhints.Config{Endpoints: aggregated(t)})
	keys := promptKeys(4)
	self := picker.Decision{Reason: picker.ReasonPull, Destination: dst, Source: dst, Cached: 1, Gain: 2, Missing: keys[1:3]}
	_, reason, err := hint.Hint(&self, keys, "r")
	require.NoError(t, err)
	require.Equal(t, kvhints.ReasonSameHolder, reason)
	none := picker.Decision{Reason: picker.ReasonPull, Destination: dst, Source: peerA, Cached: 2}
	_, reason, err = hint.Hint(&none, keys, "r")
	require.NoError(t, err)
	require.Equal(t, kvhints.ReasonNotLonger, reason)
}
