package kvplugin

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	"github.com/kvsource/kvsource/index"
)

// speculativeOn turns speculative indexing on with the guide's tier weights,
// under which a speculative block weighing as the CPU tier would show.
func speculativeOn(c *PrefixConfig) {
	c.SpeculativeIndexing = true
	c.IndexerConfig.BackendConfigs = []*KVCacheBackendConfig{{Name: "gpu", Weight: 1}, {Name: "cpu", Weight: 0.4}}
}

// probe scores a fresh request for the world's prompt on eps, as the next
// request on the same prefix sees them, and returns each one's match.
func (w *world) probe(eps ...scheduling.Endpoint) []match {
	w.t.Helper()
	require.NoError(w.t, w.prefix.Produce(context.Background(), w.request("probe"), eps))
	out := make([]match, len(eps))
	for i, ep := range eps {
		m := matchOf(w.t.(*testing.T), w.prefix, ep)
		out[i] = match{score: float64(m.MatchBlocks()), blocks: m.CachedBlockCount(), byTier: m.CachedBlocksByTier()}
	}
	return out
}

// A scheduled request's blocks become speculative entries of the pods
// chosen for it: the primary profile's first target and, under P/D,
// profile "prefill"'s, whether a source producer reads the prefix producer
// (and records after its decision) or not; weighed 1, as upstream weighs a
// tier it has no weight for.
func TestSpeculativeIndexingRecordsTheRoutedRequestsBlocks(t *testing.T) {
	spec := match{score: promptBlocks, blocks: promptBlocks, byTier: map[string]int{"speculative": promptBlocks}}
	none := match{byTier: map[string]int{}}
	tests := []struct {
		name       string
		set        func(*PrefixConfig)
		withSource bool
		route      func(decode, prefill scheduling.Endpoint) *scheduling.SchedulingResult
		want       [3]match // other, decode, prefill
	}{
		{name: "off by default: nothing is recorded", set: func(*PrefixConfig) {}, withSource: true,
			route: func(d, _ scheduling.Endpoint) *scheduling.SchedulingResult { return result(d, nil, "") },
			want:  [3]match{none, none, none}},
		{name: "on, the primary profile's target", set: speculativeOn,
			route: func(d, _ scheduling.Endpoint) *scheduling.SchedulingResult { return result(d, nil, "") },
			want:  [3]match{none, spec, none}},
		{name: "on with a source producer, the primary profile's target", set: speculativeOn, withSource: true,
			route: func(d, _ scheduling.Endpoint) *scheduling.SchedulingResult { return result(d, nil, "") },
			want:  [3]match{none, spec, none}},
		{name: "on under P/D, the decode and the prefill targets", set: speculativeOn,
			route: func(d, p scheduling.Endpoint) *scheduling.SchedulingResult { return result(d, p, "prefill") },
			want:  [3]match{none, spec, spec}},
		{name: "on under P/D with a source producer, the decode and the prefill targets", set: speculativeOn, withSource: true,
			route: func(d, p scheduling.Endpoint) *scheduling.SchedulingResult { return result(d, p, "prefill") },
			want:  [3]match{none, spec, spec}},
		{name: "a prefill profile of another name is not upstream's P/D", set: speculativeOn,
			route: func(d, p scheduling.Endpoint) *scheduling.SchedulingResult { return result(d, p, "P") },
			want:  [3]match{none, spec, none}},
		{name: "a target without metadata records nothing", set: speculativeOn,
			route: func(_, _ scheduling.Endpoint) *scheduling.SchedulingResult {
				return result(scheduling.NewEndpoint(nil, nil, nil), nil, "")
			},
			want: [3]match{none, none, none}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorldWith(t, tt.set, SourceConfig{})
			if !tt.withSource {
				w.prefix.sourced.Store(false)
			}
			other, decode, prefill := endpoint(ip(1), 0), endpoint(ip(2), 0), endpoint(ip(3), 0)
			eps := []scheduling.Endpoint{other, decode, prefill}
			res := tt.route(decode, prefill)
			req := w.request("r1")
			ctx := context.Background()
			require.NoError(t, w.prefix.Produce(ctx, req, eps))
			require.NoError(t, w.prefix.PreRequest(ctx, req, res))
			if tt.withSource {
				require.NoError(t, w.src.Produce(ctx, req, eps))
				require.NoError(t, w.src.PreRequest(ctx, req, res))
			}
			got := w.probe(eps...)
			require.Equal(t, tt.want[:], got)
			if w.prefix.Speculative() != nil {
				// A request is recorded once, however often its hooks run.
				require.NoError(t, w.prefix.PreRequest(ctx, req, res))
				require.NoError(t, w.src.PreRequest(ctx, req, res))
				st := w.prefix.Speculative().Stats()
				wantEntries := 0
				for _, m := range tt.want {
					if m.blocks > 0 {
						wantEntries++
					}
				}
				require.Equal(t, wantEntries, st.Entries)
			}
		})
	}
}

// Requests without a single tokenized prompt, or without a scheduling
// result, record nothing and fail nothing.
func TestSpeculativeIndexingSkipsRequestsWithoutAPrompt(t *testing.T) {
	w := newWorldWith(t, speculativeOn, SourceConfig{})
	c := endpoint(ip(2), 0)
	ctx := context.Background()
	noTokens := &scheduling.InferenceRequest{RequestID: "r", TargetModel: testModel}
	require.NoError(t, w.prefix.Produce(ctx, noTokens, []scheduling.Endpoint{c}))
	require.NoError(t, w.prefix.PreRequest(ctx, noTokens, result(c, nil, "")))
	require.NoError(t, w.src.PreRequest(ctx, noTokens, result(c, nil, "")))
	req := w.request("r2")
	require.NoError(t, w.prefix.Produce(ctx, req, []scheduling.Endpoint{c}))
	require.NoError(t, w.prefix.PreRequest(ctx, req, nil))
	require.Zero(t, w.prefix.Speculative().Stats().Entries)
}

// The engine's own events, fed through the Speculative, add its blocks
// beside the guesses, which weigh on as the GPU's until their TTL, as
// upstream's do: a pod whose prefill is under way scores the whole prompt.
// An evicted block is not kept alive by its guess.
func TestSpeculativeEntriesStayBesideTheEnginesStoresAndGoWithItsEvictions(t *testing.T) {
	w := newWorldWith(t, speculativeOn, SourceConfig{})
	c := endpoint(ip(2), 0)
	w.decide(w.request("r1"), []scheduling.Endpoint{c}, result(c, nil, ""))
	require.Equal(t, map[string]int{"speculative": promptBlocks}, w.probe(c)[0].byTier)

	sink := w.prefix.Speculative()
	h := holderOf(c.GetMetadata())
	// The engine reports the first three blocks: the rest still guessed
	// weigh as GPU blocks, not as the CPU tier's 0.4.
	sink.Store(index.Blocks{Model: testModel, Holder: h, Tier: index.TierGPU, Keys: w.keys[:3]})
	require.Equal(t, match{score: promptBlocks, blocks: promptBlocks, byTier: map[string]int{"gpu": 3, "speculative": promptBlocks}}, w.probe(c)[0])
	// Then the rest.
	sink.Store(index.Blocks{Model: testModel, Holder: h, Tier: index.TierGPU, Parent: index.ParentKey(w.keys[2]), Keys: w.keys[3:]})
	require.Equal(t, match{score: promptBlocks, blocks: promptBlocks, byTier: map[string]int{"gpu": promptBlocks, "speculative": promptBlocks}}, w.probe(c)[0])
	// And evicts them all: nothing is left, the guess included.
	sink.Remove(testModel, h, index.TierGPU, 0, w.keys)
	require.Equal(t, match{byTier: map[string]int{}}, w.probe(c)[0])
	require.NotZero(t, sink.Stats().Replaced)
}

// An engine that evicts a guessed block before storing it for real does not
// have it: the guess goes too.
func TestSpeculativeEntriesGoWithTheEnginesEvictions(t *testing.T) {
	w := newWorldWith(t, speculativeOn, SourceConfig{})
	c := endpoint(ip(2), 0)
	w.decide(w.request("r1"), []scheduling.Endpoint{c}, result(c, nil, ""))
	w.prefix.Speculative().Remove(testModel, holderOf(c.GetMetadata()), index.TierGPU, 0, w.keys[:1])
	require.Equal(t, match{byTier: map[string]int{}}, w.probe(c)[0])
}

// Entries expire after speculativeTTL by the expiry the factory runs for
// the EPP's lifetime.
func TestSpeculativeEntriesExpireAfterTheTTL(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	params := `{"tokenProcessorConfig":{"blockSizeTokens":16},"speculativeIndexing":true,"speculativeTTL":"1s","kvEventsConfig":{"discoverPods":false}}`
	pl, err := PrefixFactory(nil)("pp", plugin.StrictDecoder(json.RawMessage(params)), plugin.NewEppHandle(ctx, nil))
	require.NoError(t, err)
	prefix := pl.(*PrefixProducer)
	w := newWorld(t, SourceConfig{})
	w.prefix = prefix // the same prompt and block size, the factory's producer
	c := endpoint(ip(2), 0)
	req := w.request("r1")
	start := time.Now()
	require.NoError(t, prefix.Produce(ctx, req, []scheduling.Endpoint{c}))
	require.NoError(t, prefix.PreRequest(ctx, req, result(c, nil, "")))
	got := w.probe(c)[0]
	if time.Since(start) < time.Second {
		require.Equal(t, promptBlocks, got.byTier["speculative"])
	}
	require.Eventually(t, func() bool { return w.probe(c)[0].blocks == 0 }, 10*time.Second, 20*time.Millisecond)
	require.GreaterOrEqual(t, time.Since(start), time.Second, "expired before the TTL")
	require.Equal(t, uint64(1), prefix.Speculative().Stats().Expired)
}

// A request's own speculative entries, whichever PreRequest runs first, do
// not make its computing pod look cached: its pull is decided on what the
// pods held before it. The next request on the prefix, routed to the same
// pod, then counts the guess as the pod's (spec §3 step 3): no pull.
func TestSpeculativeEntriesOfARequestDoNotCancelItsPull(t *testing.T) {
	w := newWorldWith(t, speculativeOn, SourceConfig{})
	b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
	w.hold(b, index.TierCPU, 0, promptBlocks)
	eps := []scheduling.Endpoint{b, c}
	r1 := w.decide(w.request("r1"), eps, result(c, nil, ""))
	require.Equal(t, "10.0.0.2:8080", header(r1))
	require.Equal(t, promptBlocks*testBlockSize, w.pulled(r1))
	r2 := w.decide(w.request("r2"), eps, result(c, nil, ""))
	require.Empty(t, header(r2))
}

// The speculative entries' counters are registered with the EPP's metrics
// registry under the plugin's name.
func TestSpeculativeIndexingExportsItsCounters(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg := prometheus.NewRegistry()
	params := `{"tokenProcessorConfig":{"blockSizeTokens":16},"speculativeIndexing":true,"kvEventsConfig":{"discoverPods":false}}`
	pl, err := PrefixFactory(nil)("pp", plugin.StrictDecoder(json.RawMessage(params)), plugin.NewEppHandle(ctx, nil, plugin.WithMetricsRecorder(reg)))
	require.NoError(t, err)
	w := newWorld(t, SourceConfig{})
	w.prefix = pl.(*PrefixProducer)
	c := endpoint(ip(2), 0)
	req := w.request("r1")
	require.NoError(t, w.prefix.Produce(ctx, req, []scheduling.Endpoint{c}))
	require.NoError(t, w.prefix.PreRequest(ctx, req, result(c, nil, "")))
	w.prefix.Speculative().Store(index.Blocks{Model: testModel, Holder: holderOf(c.GetMetadata()), Tier: index.TierGPU, Keys: w.keys})

	require.Equal(t, map[string]float64{
		"kvsource_epp_speculative_recorded_total": 1,
		"kvsource_epp_speculative_expired_total":  0,
		"kvsource_epp_speculative_replaced_total": 1,
		"kvsource_epp_speculative_entries":        1,
		"kvsource_epp_speculative_bytes":          float64(64 + (8+index.SpeculativeBlockBytes)*promptBlocks),
	}, gather(t, reg, "pp"))
	// A producer of the same name made again reports its own entries.
	_, err = PrefixFactory(nil)("pp", plugin.StrictDecoder(json.RawMessage(params)), plugin.NewEppHandle(ctx, nil, plugin.WithMetricsRecorder(reg)))
	require.NoError(t, err)
	require.Equal(t, map[string]float64{
		"kvsource_epp_speculative_recorded_total": 0,
		"kvsource_epp_speculative_expired_total":  0,
		"kvsource_epp_speculative_replaced_total": 0,
		"kvsource_epp_speculative_entries":        0,
		"kvsource_epp_speculative_bytes":          0,
	}, gather(t, reg, "pp"))
}

// gather returns the registry's single-series metrics by name, checking
// that each is labelled with the plugin's name.
func gather(t *testing.T, reg *prometheus.Registry, name string) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, f := range families {
		require.Len(t, f.GetMetric(), 1, f.GetName())
		m := f.GetMetric()[0]
		require.Equal(t, name, m.GetLabel()[0].GetValue())
		got[f.GetName()] = m.GetCounter().GetValue() + m.GetGauge().GetValue()
	}
	return got
}

// Whatever parameters the loader hands over, the prefix producer's factory
// returns a producer or an ErrConfig, never a panic; with speculative
// indexing on, its entries have a positive TTL.
func FuzzPrefixParameters(f *testing.F) {
	for _, seed := range []string{
		guidePrefixParams,
		`{"speculativeIndexing":true,"speculativeTTL":"750ms","kvEventsConfig":{"discoverPods":false}}`,
		`{"speculativeIndexing":true,"speculativeTTL":"-3h","kvEventsConfig":null}`,
		`{"speculativeTTL":"9999999999999999999h"}`,
		`{"speculativeIndexing":true,"speculativeTTL":"1ns","kvEventsConfig":{"discoverPods":false}}`,
		`{"speculativeIndexing":1}`,
		`{"indexerConfig":{"kvCacheBackendConfigs":[{"name":"SPECULATIVE","weight":0.5}]},"speculativeIndexing":true,"kvEventsConfig":{"discoverPods":false}}`,
	} {
		f.Add(seed)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // goroutines a producer starts end at once
	handle := plugin.NewEppHandle(ctx, nil)
	f.Fuzz(func(t *testing.T, params string) {
		pl, err := PrefixFactory(nil)("pp", plugin.StrictDecoder(json.RawMessage(params)), handle)
		if err != nil {
			require.ErrorIs(t, err, ErrConfig)
			return
		}
		p := pl.(*PrefixProducer)
		if p.Speculative() != nil {
			require.Positive(t, p.specTTL)
		}
	})
}

// A source producer that fails to be made does not take the recording
// over: the prefix producer's own PreRequest still records.
func TestSpeculativeIndexingRecordsWhenTheSourceProducerFailed(t *testing.T) {
	w := newWorldWith(t, speculativeOn, SourceConfig{})
	w.prefix.sourced.Store(false)
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvsource_epp_source_decisions_total", Help: "taken"}))
	_, err := NewSourceProducer("other", SourceConfig{MinCachedTokenDelta: 1}, w.prefix, reg)
	require.Error(t, err)
	c := endpoint(ip(2), 0)
	req := w.request("r1")
	require.NoError(t, w.prefix.Produce(context.Background(), req, []scheduling.Endpoint{c}))
	require.NoError(t, w.prefix.PreRequest(context.Background(), req, result(c, nil, "")))
	require.Equal(t, 1, w.prefix.Speculative().Stats().Entries)
}
