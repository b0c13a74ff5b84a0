package kvplugin

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/common/routing"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requestcontrol"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	attrprefix "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/datalayer/attribute/prefix"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/transfer"
)

// One request's decision, re-deriving the single-request behaviours of
// upstream's p2psource producer tests (named in upstream), then kvsource's
// deliberate differences. Upstream's "n cached blocks" become n blocks of
// the prompt in the index; without a tier map upstream trusts a producer's
// count, here a block is in the CPU tier (where pulls are served from)
// unless the case says otherwise. Produce and PreRequest always run
// together: kvsource decides in PreRequest, once the computing pod is known,
// so upstream's stash is observed as the header and the pulled tokens.
// differs says why kvsource decides otherwise than upstream would, if it
// does.
func TestSourceProducerDecision(t *testing.T) {
	const cpu, gpu, spec = index.TierCPU, index.TierGPU, index.TierSpeculative
	type setup func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest)
	tests := []struct {
		name       string
		cfg        SourceConfig
		setup      setup
		wantHeader string
		wantTokens int
		differs    string
	}{
		{
			name: "TestProduce_StashesBestMatchPeer: the peer with 3 blocks beats the one with 1",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, b, c := endpoint(ip(1), 0), endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(a, cpu, 0, 1)
				w.hold(b, cpu, 0, 3)
				return []scheduling.Endpoint{a, b, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 48,
		},
		{
			name: "TestProduce_NoCachedBlocks_NoStash: nobody holds anything",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, b, c := endpoint(ip(1), 0), endpoint(ip(2), 0), endpoint(ip(9), 0)
				return []scheduling.Endpoint{a, b, c}, result(c, nil, ""), w.request("r")
			},
		},
		{
			name: "TestProduce_MissingMatchInfo_TreatedAsZero: an endpoint the index does not know is no source",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, b, c := endpoint(ip(1), 0), endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 3)
				return []scheduling.Endpoint{a, b, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 48,
		},
		{
			name: "TestProduce_MetadataNilMax_DoesNotSuppressStash: a holder behind an endpoint without metadata is no source and sets no bar",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(endpoint(ip(7), 0), cpu, 0, promptBlocks)
				w.hold(b, cpu, 0, 3)
				nilMeta := scheduling.NewEndpoint(nil, nil, nil)
				return []scheduling.Endpoint{nilMeta, b, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 48,
		},
		{
			name: "TestPreRequest_SetsKVCacheSourceHeader: 48 cached tokens against the computing pod's 16",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 3)
				w.hold(c, gpu, 0, 1)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
			// The pull brings the 32 tokens after the computing pod's own 16.
			wantHeader: "10.0.0.2:8080", wantTokens: 32,
		},
		{
			name: "TestPreRequest_DeltaBelowThreshold_NoHeader: 32 against 16 with a delta of 17",
			cfg:  SourceConfig{MinCachedTokenDelta: 17},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 2)
				w.hold(c, gpu, 0, 1)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
		},
		{
			name: "TestPluginFactory_WiresConfig: a delta of 33 refuses a 32-token pull",
			cfg:  SourceConfig{MinCachedTokenDelta: 33},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 2)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
		},
		{
			name: "TestPluginFactory_WiresConfig: a delta of 33 takes a 48-token pull",
			cfg:  SourceConfig{MinCachedTokenDelta: 33},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 3)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 48,
		},
		{
			name: "TestPreRequest_BestIsChosen_NoHeader: the computing pod holds the most",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, b := endpoint(ip(1), 0), endpoint(ip(2), 0)
				w.hold(a, cpu, 0, 1)
				w.hold(b, cpu, 0, 3)
				return []scheduling.Endpoint{a, b}, result(b, nil, ""), w.request("r")
			},
		},
		{
			name: "TestPreRequest_PrefillProfile_BestIsPrefill_NoHeader: under P/D the prefill pod computes, and it holds the most",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, p, d := endpoint(ip(1), 0), endpoint(ip(2), 0), endpoint(ip(3), 0)
				w.hold(a, cpu, 0, 1)
				w.hold(p, cpu, 0, 3)
				return []scheduling.Endpoint{a, p, d}, result(d, p, "prefill"), w.request("r")
			},
		},
		{
			name: "TestPreRequest_PrefillProfile_HeaderFromThirdPod: 64 tokens on a third pod against the prefill pod's 16",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				p, d, third := endpoint(ip(1), 0), endpoint(ip(2), 0), endpoint(ip(3), 0)
				w.hold(p, gpu, 0, 1)
				w.hold(third, cpu, 0, 4)
				return []scheduling.Endpoint{p, d, third}, result(d, p, "prefill"), w.request("r")
			},
			wantHeader: "10.0.0.3:8080", wantTokens: 48,
		},
		{
			name: "TestPreRequest_DeletesInboundHeader: a client's header is removed, also without a decision",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 3)
				req := w.request("r")
				req.Body = nil // no tokens: nothing stashed
				req.Headers[routing.KVCacheSourceHeader] = "10.6.6.6:8080"
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), req
			},
		},
		{
			name: "TestPreRequest_DeletesInboundHeader: a client's header is replaced by the decision",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 3)
				req := w.request("r")
				req.Headers[routing.KVCacheSourceHeader] = "10.6.6.6:8080"
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), req
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 48,
		},
		{
			name: "TestPreRequest_IPv6HeaderBracketed: an IPv6 source is named [host]:port",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint("fd00::2", 0), endpoint("fd00::9", 0)
				w.hold(b, cpu, 0, 3)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "[fd00::2]:8080", wantTokens: 48,
		},
		{
			name: "TestPreRequest_ConfiguredPrefillProfileName: profile P computes, and it holds the most",
			cfg:  SourceConfig{PrefillProfileName: "P"},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				p, d := endpoint(ip(1), 0), endpoint(ip(2), 0)
				w.hold(p, cpu, 0, 3)
				return []scheduling.Endpoint{p, d}, result(d, p, "P"), w.request("r")
			},
		},
		{
			name: "TestPreRequest_ConfiguredPrefillProfileName: with P configured a profile named prefill does not compute",
			cfg:  SourceConfig{PrefillProfileName: "P"},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				p, d := endpoint(ip(1), 0), endpoint(ip(2), 0)
				w.hold(p, cpu, 0, 3)
				return []scheduling.Endpoint{p, d}, result(d, p, "prefill"), w.request("r")
			},
			wantHeader: "10.0.0.1:8080", wantTokens: 48,
		},
		{
			name: "TestProduce_BeyondBandWinsOverIdle: 5 blocks behind a queue of 20 beat 3 blocks idle",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, b, c := endpoint(ip(1), 20), endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(a, cpu, 0, 5)
				w.hold(b, cpu, 0, 3)
				return []scheduling.Endpoint{a, b, c}, result(c, nil, ""), w.request("req-strict")
			},
			wantHeader: "10.0.0.1:8080", wantTokens: 80,
		},
		{
			name: "TestProduce_NilMetrics_NeutralLoad: without metrics the most cached wins",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, b, c := endpoint(ip(1), -1), endpoint(ip(2), -1), endpoint(ip(9), -1)
				w.hold(a, cpu, 0, 1)
				w.hold(b, cpu, 0, 3)
				return []scheduling.Endpoint{a, b, c}, result(c, nil, ""), w.request("req-nilmetrics")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 48,
		},
		{
			name: "TestProduce_GPUOnlySource_NotChosen: 8 GPU blocks lose to 3 CPU blocks",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, b, c := endpoint(ip(1), 0), endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(a, gpu, 0, promptBlocks)
				w.hold(b, cpu, 0, 3)
				return []scheduling.Endpoint{a, b, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 48,
		},
		{
			name: "TestProduce_SpeculativeOnlySource_NoStash: a pod holding the prompt only speculatively is no source",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, c := endpoint(ip(1), 0), endpoint(ip(9), 0)
				w.hold(a, spec, 0, promptBlocks)
				return []scheduling.Endpoint{a, c}, result(c, nil, ""), w.request("r")
			},
		},
		{
			name: "kvsource: a speculative-only pod is no source even when GPU blocks are pulled too",
			cfg:  SourceConfig{PullTiers: []string{"gpu", "cpu"}},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, c := endpoint(ip(1), 0), endpoint(ip(9), 0)
				w.hold(a, spec, 0, promptBlocks)
				return []scheduling.Endpoint{a, c}, result(c, nil, ""), w.request("r")
			},
		},
		{
			name: "kvsource: a source's speculative blocks past its CPU run are not pulled",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, c := endpoint(ip(1), 0), endpoint(ip(9), 0)
				w.hold(a, cpu, 0, 3)
				w.hold(a, spec, 0, promptBlocks)
				return []scheduling.Endpoint{a, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.1:8080", wantTokens: 48,
		},
		{
			name: "TestProduce_NoTierData_FallsBackToUnweighted: with every tier pullable, GPU blocks count",
			cfg:  SourceConfig{PullTiers: []string{"gpu", "cpu"}},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, c := endpoint(ip(1), 0), endpoint(ip(9), 0)
				w.hold(a, gpu, 0, 4)
				return []scheduling.Endpoint{a, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.1:8080", wantTokens: 64,
			differs: "kvsource's index always knows tiers, so there is no producer without tier data to trust; " +
				"which tiers a source serves from is the pullTiers parameter (default cpu)",
		},
		{
			name: "TestPreRequest_ComputingSideCountsAllTiers: 6 CPU blocks against 5 GPU blocks with a delta of 32",
			cfg:  SourceConfig{MinCachedTokenDelta: 32},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 6)
				w.hold(c, gpu, 0, 5)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
		},
		{
			name: "TestPreRequest_ComputingSideCountsAllTiers: the computing pod's 5 speculative blocks count against 6 CPU blocks with a delta of 32",
			cfg:  SourceConfig{MinCachedTokenDelta: 32},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 6)
				w.hold(c, spec, 0, 5)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
		},
		{
			name: "TestPreRequest_ComputingSideCountsAllTiers: the computing pod's 2 speculative blocks leave 64 tokens to pull against a delta of 32",
			cfg:  SourceConfig{MinCachedTokenDelta: 32},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 6)
				w.hold(c, spec, 0, 2)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 64,
		},
		{
			name: "kvsource: the computing pod is never drawn as its own source",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				a, b := endpoint(ip(1), 0), endpoint(ip(2), 0)
				w.hold(a, cpu, 0, 3)
				w.hold(b, cpu, 0, 4)
				return []scheduling.Endpoint{a, b}, result(a, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 16,
			differs: "upstream draws its source before scheduling among all endpoints within a block of the best, " +
				"the computing pod included, and then sends no header when it drew that pod, although another " +
				"pod would add a block; kvsource draws after scheduling among the others only",
		},
		{
			name: "kvsource: a source's CPU run counts from where the computing pod's prefix ends",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(c, gpu, 0, 2)
				w.hold(b, cpu, 2, 6)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: 96,
			differs: "upstream counts a source's CPU prefix from block 0 (here 0: the source holds blocks 2-7 only) " +
				"and compares it with the computing pod's; kvsource counts what the computing pod lacks, " +
				"the source's CPU run right after the computing pod's own prefix",
		},
		{
			name: "kvsource: with a calibration where pulls never pay, nothing is pulled above the delta",
			cfg: SourceConfig{Calibration: &CalibrationConfig{
				Recompute: []transfer.Sample{{Tokens: 100, Millis: 1}, {Tokens: 200, Millis: 1}, {Tokens: 400, Millis: 1}},
				Pull:      []transfer.Sample{{Tokens: 100, Millis: 1000}, {Tokens: 400, Millis: 1000}},
			}},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, promptBlocks)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
			differs: "upstream pulls whenever the delta is met; kvsource with a calibration also needs a predicted saving",
		},
		{
			name: "kvsource: with a calibration where pulls pay, the pull is made",
			cfg: SourceConfig{Calibration: &CalibrationConfig{
				Recompute: []transfer.Sample{{Tokens: 100, Millis: 100}, {Tokens: 200, Millis: 400}, {Tokens: 400, Millis: 1600}},
				Pull:      []transfer.Sample{{Tokens: 100, Millis: 1}, {Tokens: 400, Millis: 2}},
			}},
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, promptBlocks)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), w.request("r")
			},
			wantHeader: "10.0.0.2:8080", wantTokens: promptBlocks * testBlockSize,
		},
		{
			name: "kvsource: a request with several prompts is not decided",
			setup: func(w *world) ([]scheduling.Endpoint, *scheduling.SchedulingResult, *scheduling.InferenceRequest) {
				b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
				w.hold(b, cpu, 0, 3)
				req := w.request("r")
				tp := req.Body.TokenizedPrompt
				tp.PerPromptTokens = append(tp.PerPromptTokens, w.tokens)
				return []scheduling.Endpoint{b, c}, result(c, nil, ""), req
			},
			differs: "one header names one source for one prompt; upstream sums a multi-prompt request's blocks " +
				"as if they were one prompt",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t, tt.cfg)
			eps, res, req := tt.setup(w)
			w.decide(req, eps, res)
			require.Equal(t, tt.wantHeader, header(req))
			require.Equal(t, tt.wantTokens, w.pulled(req))
			if tt.wantHeader != "" {
				host, port, err := net.SplitHostPort(tt.wantHeader)
				require.NoError(t, err)
				require.Equal(t, "8080", port)
				require.NotEmpty(t, host)
			}
		})
	}
}

// How decisions spread over equally good sources, re-deriving upstream's
// load tests. Each request's response ends before the next, so no pull is
// in flight and only the waiting queues weigh, as upstream has it.
func TestSourceProducerSpreadsByQueue(t *testing.T) {
	type src struct {
		blocks, queue int
	}
	tests := []struct {
		name    string
		sources []src // at 10.0.0.1, 10.0.0.2, ...
		n       int
		check   func(t *testing.T, picks map[string]int, tokens map[string]int)
	}{
		{
			name:    "TestProduce_SharesByInverseQueueWeight: queues 12, 2 and 7 share by 1/(1+queue)",
			sources: []src{{3, 12}, {3, 2}, {3, 7}},
			n:       400,
			check: func(t *testing.T, picks, _ map[string]int) {
				require.Greater(t, picks[ip(2)], picks[ip(3)], "%v", picks)
				require.Greater(t, picks[ip(3)], picks[ip(1)], "%v", picks)
				require.Positive(t, picks[ip(1)], "%v", picks)
			},
		},
		{
			name:    "TestProduce_NearTie_NoHerding: a queue of 1 against 0 still gets a share",
			sources: []src{{3, 0}, {3, 1}},
			n:       600,
			check: func(t *testing.T, picks, _ map[string]int) {
				require.Greater(t, picks[ip(1)], picks[ip(2)], "%v", picks)
				require.Greater(t, picks[ip(2)], 600/6, "%v", picks)
			},
		},
		{
			name:    "TestProduce_OneBlockShort_SharesByQueue: 3 blocks idle lead 4 blocks behind a queue of 20",
			sources: []src{{4, 20}, {3, 0}},
			n:       400,
			check: func(t *testing.T, picks, tokens map[string]int) {
				require.Greater(t, picks[ip(2)], picks[ip(1)], "%v", picks)
				require.Positive(t, picks[ip(1)], "%v", picks)
				// Each pull brings its own source's blocks.
				require.Equal(t, map[string]int{ip(1): 4 * testBlockSize, ip(2): 3 * testBlockSize}, tokens)
			},
		},
		{
			name:    "TestProduce_EqualQueues_SpreadByRequestID: 64 requests reach all of 3 equal sources",
			sources: []src{{3, 0}, {3, 0}, {3, 0}},
			n:       64,
			check: func(t *testing.T, picks, _ map[string]int) {
				require.Len(t, picks, 3, "%v", picks)
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t, SourceConfig{})
			var eps []scheduling.Endpoint
			for i, s := range tt.sources {
				ep := endpoint(ip(i+1), s.queue)
				w.hold(ep, index.TierCPU, 0, s.blocks)
				eps = append(eps, ep)
			}
			computing := endpoint(ip(9), 0)
			eps = append(eps, computing)
			picks, tokens := map[string]int{}, map[string]int{}
			for i := range tt.n {
				req := w.decide(w.request(fmt.Sprintf("req-%d", i)), eps, result(computing, nil, ""))
				host, _, err := net.SplitHostPort(header(req))
				require.NoError(t, err)
				picks[host]++
				tokens[host] = w.pulled(req)
				w.end(req)
			}
			tt.check(t, picks, tokens)
			for _, ep := range eps {
				require.Zero(t, w.src.Inflight(ep.GetMetadata()), "every pull was released")
			}
		})
	}
}

// TestProduce_EqualQueues_SpreadByRequestID's second half: the same request
// id under the same state gets the same source.
func TestSourceProducerDecidesARequestIDAlike(t *testing.T) {
	w := newWorld(t, SourceConfig{})
	var eps []scheduling.Endpoint
	for i := range 3 {
		ep := endpoint(ip(i+1), 0)
		w.hold(ep, index.TierCPU, 0, 3)
		eps = append(eps, ep)
	}
	computing := endpoint(ip(9), 0)
	eps = append(eps, computing)
	first := w.decide(w.request("req-7"), eps, result(computing, nil, ""))
	w.end(first)
	again := w.decide(w.request("req-7"), eps, result(computing, nil, ""))
	require.NotEmpty(t, header(first))
	require.Equal(t, header(first), header(again))
}

// A holder whose subscription reports it disconnected is no source: the
// pull goes to the next best live holder, and none to a dead one.
func TestSourceProducerPullsOnlyFromLiveHolders(t *testing.T) {
	w := newWorld(t, SourceConfig{})
	sub, _ := newFakeSubscribe()
	sub.down = map[string]bool{"10.0.0.1:8080": true}
	w.prefix.sub = sub
	a, b, computing := endpoint(ip(1), 0), endpoint(ip(2), 0), endpoint(ip(9), 0)
	w.hold(a, index.TierCPU, 0, 4)
	w.hold(b, index.TierCPU, 0, 2)
	eps := []scheduling.Endpoint{a, b, computing}
	r := w.decide(w.request("live-1"), eps, result(computing, nil, ""))
	require.Equal(t, "10.0.0.2:8080", header(r), "the longer run's holder is disconnected")
	w.end(r)
	sub.mu.Lock()
	sub.down["10.0.0.2:8080"] = true
	sub.mu.Unlock()
	r = w.decide(w.request("live-2"), eps, result(computing, nil, ""))
	require.Empty(t, header(r), "no live holder: no pull")
}

// kvsource's in-flight spreading: pulls whose responses have not ended
// count against their source, so a burst for one prefix spreads over its
// holders before any queue metric moves. Upstream weighs queues only.
func TestSourceProducerSpreadsABurstByPullsInFlight(t *testing.T) {
	w := newWorld(t, SourceConfig{})
	a, b, computing := endpoint(ip(1), 0), endpoint(ip(2), 0), endpoint(ip(9), 0)
	w.hold(a, index.TierCPU, 0, 3)
	w.hold(b, index.TierCPU, 0, 3)
	eps := []scheduling.Endpoint{a, b, computing}
	var reqs []*scheduling.InferenceRequest
	for i := range 12 {
		reqs = append(reqs, w.decide(w.request(fmt.Sprintf("burst-%d", i)), eps, result(computing, nil, "")))
	}
	na, nb := w.src.Inflight(a.GetMetadata()), w.src.Inflight(b.GetMetadata())
	require.Equal(t, 12, na+nb)
	require.GreaterOrEqual(t, min(na, nb), 4, "in flight: %d and %d", na, nb)
	for _, r := range reqs {
		w.end(r)
	}
	require.Zero(t, w.src.Inflight(a.GetMetadata())+w.src.Inflight(b.GetMetadata()))
}

// The response body hook releases a pull at the end of its stream, and at
// termination (the director's last call, EndOfStream set, for a scheduled
// request that never completed), once however often it is called.
func TestSourceProducerReleasesPullsAtTheEndOfTheResponse(t *testing.T) {
	type call struct{ start, end bool }
	tests := []struct {
		name           string
		calls          []call
		wantAfterCalls int // pulls in flight from the source afterwards
	}{
		{"streamed chunks keep the pull in flight", []call{{start: true}, {}, {}}, 1},
		{"the end of the stream releases it", []call{{start: true}, {}, {end: true}}, 0},
		{"a non-streamed response's one call releases it", []call{{start: true, end: true}}, 0},
		{"termination before any chunk releases it", []call{{end: true}}, 0},
		{"a second end releases nothing more", []call{{end: true}, {end: true}}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t, SourceConfig{})
			b, computing := endpoint(ip(2), 0), endpoint(ip(9), 0)
			w.hold(b, index.TierCPU, 0, 3)
			eps := []scheduling.Endpoint{b, computing}
			// Another request's pull from the same source stays in flight
			// throughout: a repeated end must not release it.
			other := w.decide(w.request("other"), eps, result(computing, nil, ""))
			req := w.decide(w.request("r"), eps, result(computing, nil, ""))
			require.Equal(t, "10.0.0.2:8080", header(req))
			require.Equal(t, 2, w.src.Inflight(b.GetMetadata()))
			for _, c := range tt.calls {
				w.src.ResponseBody(context.Background(), req, &requestcontrol.Response{RequestID: "r", StartOfStream: c.start, EndOfStream: c.end}, computing.GetMetadata())
			}
			require.Equal(t, tt.wantAfterCalls+1, w.src.Inflight(b.GetMetadata()))
			w.end(other)
			require.Equal(t, tt.wantAfterCalls, w.src.Inflight(b.GetMetadata()))
		})
	}
}

// A request that goes through PreRequest again gives its first pull back.
func TestSourceProducerReleasesAnEarlierPullWhenRescheduled(t *testing.T) {
	w := newWorld(t, SourceConfig{})
	b, computing := endpoint(ip(2), 0), endpoint(ip(9), 0)
	w.hold(b, index.TierCPU, 0, 3)
	req := w.decide(w.request("r"), []scheduling.Endpoint{b, computing}, result(computing, nil, ""))
	require.Equal(t, 1, w.src.Inflight(b.GetMetadata()))
	require.NoError(t, w.src.PreRequest(context.Background(), req, result(computing, nil, "")))
	require.Equal(t, 1, w.src.Inflight(b.GetMetadata()))
	w.end(req)
	require.Zero(t, w.src.Inflight(b.GetMetadata()))
}

// TestProduce_IPv6BestMatchBracketed: the candidates Produce records name
// IPv6 endpoints with brackets.
func TestSourceProducerRecordsCandidatesBracketed(t *testing.T) {
	w := newWorld(t, SourceConfig{})
	b, c := endpoint("fd00::2", 3), endpoint(ip(9), 0)
	req := w.request("r")
	require.NoError(t, w.prefix.Produce(context.Background(), req, []scheduling.Endpoint{b, c}))
	require.NoError(t, w.src.Produce(context.Background(), req, []scheduling.Endpoint{b, c}))
	st, ok := scheduling.ReadRequestAttribute[*stash](req, w.src.stashKey)
	require.True(t, ok)
	require.Equal(t, []picker.Candidate{
		{Holder: index.Holder{Pod: "[fd00::2]:8080"}, Waiting: 3},
		{Holder: index.Holder{Pod: "10.0.0.9:8080"}, Waiting: 0},
	}, st.cands)
}

// A PreRequest without a scheduling result or target sets nothing and
// never fails the request.
func TestSourceProducerWithoutAComputingPodDecidesNothing(t *testing.T) {
	tests := []struct {
		name string
		res  *scheduling.SchedulingResult
	}{
		{"no result", nil},
		{"no primary profile result", &scheduling.SchedulingResult{PrimaryProfileName: "decode"}},
		{"empty primary targets", &scheduling.SchedulingResult{PrimaryProfileName: "decode", ProfileResults: map[string]*scheduling.ProfileRunResult{"decode": {}}}},
		{"empty prefill targets and no primary", &scheduling.SchedulingResult{PrimaryProfileName: "decode", ProfileResults: map[string]*scheduling.ProfileRunResult{"prefill": {}}}},
		{"a target without metadata", result(scheduling.NewEndpoint(nil, nil, nil), nil, "")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t, SourceConfig{})
			b := endpoint(ip(2), 0)
			w.hold(b, index.TierCPU, 0, 3)
			req := w.request("r")
			req.Headers[routing.KVCacheSourceHeader] = "spoof"
			w.decide(req, []scheduling.Endpoint{b, endpoint(ip(9), 0)}, tt.res)
			require.NotContains(t, req.Headers, routing.KVCacheSourceHeader)
		})
	}
}

// The factory's parameters, re-deriving upstream's factory tests and
// TestConsumes_DeclaresPrefixCacheMatchInfo.
func TestSourceFactory(t *testing.T) {
	tests := []struct {
		name       string
		params     string // "" for none
		prefixName string // the prefix producer the handle holds
		wantErr    string
		want       SourceConfig // after defaults
		wantKey    string       // the Required key
		differs    string
	}{
		{
			name:       "TestPluginFactory_Defaults: no parameters",
			prefixName: PrefixProducerType,
			want:       SourceConfig{PrefixMatchInfoProducerName: PrefixProducerType, MinCachedTokenDelta: 1, PrefillProfileName: "prefill"},
			wantKey:    "PrefixCacheMatchInfoDataKey/" + PrefixProducerType,
			differs: "upstream's default producer is approx-prefix-cache-producer (the unbound key); kvsource's " +
				"decision reads a kvsource prefix producer's index, so the default is the one named like its type",
		},
		{
			name:       "TestPluginFactory_WiresConfig: the producer name and delta are taken",
			params:     `{"prefixMatchInfoProducerName":"precise","minCachedTokenDelta":33}`,
			prefixName: "precise",
			want:       SourceConfig{PrefixMatchInfoProducerName: "precise", MinCachedTokenDelta: 33, PrefillProfileName: "prefill"},
			wantKey:    "PrefixCacheMatchInfoDataKey/precise",
		},
		{
			name:    "TestPluginFactory_RejectsZeroDelta",
			params:  `{"minCachedTokenDelta":0}`,
			wantErr: "minCachedTokenDelta must be >= 1",
		},
		{
			name:       "TestPluginFactory_PrefillProfileName: P is kept",
			params:     `{"prefillProfileName":"P"}`,
			prefixName: PrefixProducerType,
			want:       SourceConfig{PrefixMatchInfoProducerName: PrefixProducerType, MinCachedTokenDelta: 1, PrefillProfileName: "P"},
			wantKey:    "PrefixCacheMatchInfoDataKey/" + PrefixProducerType,
		},
		{
			name:       "kvsource's own parameters are taken",
			params:     `{"pullTiers":["cpu","disk"],"inflightTTL":"5s","calibration":{"recompute":[{"tokens":100,"ms":10},{"tokens":200,"ms":30},{"tokens":400,"ms":90}],"pull":[{"tokens":100,"ms":5},{"tokens":400,"ms":8}],"minSavingMillis":2}}`,
			prefixName: PrefixProducerType,
			want: SourceConfig{PrefixMatchInfoProducerName: PrefixProducerType, MinCachedTokenDelta: 1, PrefillProfileName: "prefill",
				PullTiers: []string{"cpu", "disk"}, InflightTTL: "5s", Calibration: &CalibrationConfig{
					Recompute: []transfer.Sample{{Tokens: 100, Millis: 10}, {Tokens: 200, Millis: 30}, {Tokens: 400, Millis: 90}}, Pull: []transfer.Sample{{Tokens: 100, Millis: 5}, {Tokens: 400, Millis: 8}}, MinSavingMillis: 2,
				}},
			wantKey: "PrefixCacheMatchInfoDataKey/" + PrefixProducerType,
		},
		{name: "an unknown parameter is refused", params: `{"minCachedTokenDelta":1,"bogus":1}`, wantErr: `unknown field "bogus"`},
		{name: "speculative blocks as a pull tier are refused", params: `{"pullTiers":["cpu","Speculative"]}`, prefixName: PrefixProducerType, wantErr: "speculative blocks do not exist yet"},
		{name: "a bad in-flight TTL is refused", params: `{"inflightTTL":"soon"}`, prefixName: PrefixProducerType, wantErr: "inflightTTL"},
		{name: "unusable calibration samples are refused", params: `{"calibration":{"recompute":[],"pull":[]}}`, prefixName: PrefixProducerType, wantErr: "calibration"},
		{name: "a missing prefix producer is refused", params: `{"prefixMatchInfoProducerName":"nope"}`, prefixName: PrefixProducerType, wantErr: "there is no plugin with the name 'nope'"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			handle := plugin.NewEppHandle(context.Background(), nil)
			if tt.prefixName != "" {
				w := newWorld(t, SourceConfig{})
				handle.AddPlugin(tt.prefixName, w.prefix)
				w.prefix.typedName.Name = tt.prefixName
			}
			parsed, perr := SourceConfigParser(plugin.StrictDecoder(json.RawMessage(tt.params)), handle)
			p, err := SourceFactory("src", plugin.StrictDecoder(json.RawMessage(tt.params)), handle)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				require.ErrorIs(t, err, ErrConfig)
				return
			}
			require.NoError(t, perr)
			require.NoError(t, err)
			require.Equal(t, &tt.want, parsed)
			sp := p.(*SourceProducer)
			require.Equal(t, plugin.TypedName{Type: SourceProducerType, Name: "src"}, sp.TypedName())
			deps := sp.Consumes()
			require.Len(t, deps.Required, 1)
			for k, v := range deps.Required {
				require.Equal(t, tt.wantKey, k.String())
				require.Equal(t, attrprefix.PrefixCacheMatchInfoDataKey.WithNonEmptyProducerName(tt.prefixName), k)
				require.IsType(t, attrprefix.PrefixCacheMatchInfo{}, v)
			}
			require.Empty(t, sp.Produces())
		})
	}
}

// The director's cleanup after an abort may run while the stream's own last
// call does: both ends together release the pull once, without a race.
func TestSourceProducerReleasesOnceUnderConcurrentEnds(t *testing.T) {
	w := newWorld(t, SourceConfig{})
	b, computing := endpoint(ip(2), 0), endpoint(ip(9), 0)
	w.hold(b, index.TierCPU, 0, 3)
	eps := []scheduling.Endpoint{b, computing}
	other := w.decide(w.request("other"), eps, result(computing, nil, ""))
	req := w.decide(w.request("r"), eps, result(computing, nil, ""))
	require.Equal(t, 2, w.src.Inflight(b.GetMetadata()))
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { w.end(req) })
	}
	wg.Wait()
	require.Equal(t, 1, w.src.Inflight(b.GetMetadata()))
	w.end(other)
	require.Zero(t, w.src.Inflight(b.GetMetadata()))
}

// The source producer may be handed other endpoints than the prefix
// producer scored, in another order: each candidate is still named by its
// own address.
func TestSourceProducerNamesCandidatesOfAnotherList(t *testing.T) {
	w := newWorld(t, SourceConfig{})
	a, b, c := endpoint(ip(1), 1), endpoint(ip(2), 2), endpoint(ip(3), 3)
	req := w.request("r")
	require.NoError(t, w.prefix.Produce(context.Background(), req, []scheduling.Endpoint{a, b}))
	require.NoError(t, w.src.Produce(context.Background(), req, []scheduling.Endpoint{c, b, a}))
	st, ok := scheduling.ReadRequestAttribute[*stash](req, w.src.stashKey)
	require.True(t, ok)
	require.Equal(t, []picker.Candidate{
		{Holder: index.Holder{Pod: "10.0.0.3:8080"}, Waiting: 3},
		{Holder: index.Holder{Pod: "10.0.0.2:8080"}, Waiting: 2},
		{Holder: index.Holder{Pod: "10.0.0.1:8080"}, Waiting: 1},
	}, st.cands)
}
