package kvplugin

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/common/routing"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requestcontrol"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requesthandling"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/k8s.io/apimachinery/pkg/types"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// The setting of upstream's p2psource tests: 16-token blocks, port 8080.
const (
	testBlockSize = 16
	testModel     = "m"
	promptBlocks  = 8
)

// world is a prefix producer over an index the test fills directly, a
// source producer on top of it, and one prompt of promptBlocks full blocks
// (plus a partial one) whose keys the test stores for chosen endpoints.
type world struct {
	t      testing.TB
	idx    *index.Index
	prefix *PrefixProducer
	src    *SourceProducer
	tokens []uint32
	keys   []uint64
}

func newWorld(t testing.TB, cfg SourceConfig) *world {
	t.Helper()
	return newWorldWith(t, func(*PrefixConfig) {}, cfg)
}

// newWorldWith is newWorld with the prefix producer's parameters changed
// by set.
func newWorldWith(t testing.TB, set func(*PrefixConfig), cfg SourceConfig) *world {
	t.Helper()
	pcfg := DefaultPrefixConfig()
	pcfg.TokenProcessorConfig = &TokenProcessorConfig{BlockSizeTokens: testBlockSize}
	pcfg.KVEventsConfig = nil
	set(&pcfg)
	idx := index.New(index.Config{})
	prefix, err := NewPrefixProducer(PrefixProducerType, pcfg, idx)
	require.NoError(t, err)
	if cfg.MinCachedTokenDelta == 0 {
		cfg.MinCachedTokenDelta = 1
	}
	src, err := NewSourceProducer("test", cfg, prefix, nil)
	require.NoError(t, err)
	w := &world{t: t, idx: idx, prefix: prefix, src: src}
	rng := rand.New(rand.NewPCG(1, 2))
	for range promptBlocks*testBlockSize + 5 {
		w.tokens = append(w.tokens, rng.Uint32N(50000))
	}
	w.keys, err = prefix.Hasher().BlockKeys(nil, hashing.Request{Tokens: w.tokens})
	require.NoError(t, err)
	require.Len(t, w.keys, promptBlocks)
	return w
}

// endpoint is a candidate at 10.0.0.<n>:8080 (or host, when it has a colon)
// with a waiting queue; queue < 0 means no metrics at all.
func endpoint(host string, queue int) scheduling.Endpoint {
	var m *datalayer.Metrics
	if queue >= 0 {
		m = datalayer.NewMetrics()
		m.WaitingQueueSize = queue
	}
	return scheduling.NewEndpoint(&datalayer.EndpointMetadata{
		ID: types.NamespacedName{Namespace: "ns", Name: "pod-" + host}, Address: host, Port: "8080",
	}, m, nil)
}

func ip(n int) string { return fmt.Sprintf("10.0.0.%d", n) }

// hold stores blocks [from, from+n) of the prompt for ep in tier.
func (w *world) hold(ep scheduling.Endpoint, tier string, from, n int) {
	w.t.Helper()
	require.LessOrEqual(w.t, from+n, len(w.keys))
	var parent index.Parent
	if from > 0 {
		parent = index.ParentKey(w.keys[from-1])
	}
	w.idx.Store(index.Blocks{Model: testModel, Holder: holderOf(ep.GetMetadata()), Tier: tier, Parent: parent, Keys: w.keys[from : from+n]})
}

func (w *world) request(id string) *scheduling.InferenceRequest {
	return &scheduling.InferenceRequest{
		RequestID: id, TargetModel: testModel, Headers: map[string]string{},
		Body: &requesthandling.InferenceRequestBody{TokenizedPrompt: &requesthandling.TokenizedPrompt{PerPromptTokens: [][]uint32{w.tokens}}},
	}
}

// result is a scheduling result whose primary profile "decode" chose
// primary and, when prefill is not nil, profile prefillName chose prefill.
func result(primary, prefill scheduling.Endpoint, prefillName string) *scheduling.SchedulingResult {
	r := &scheduling.SchedulingResult{PrimaryProfileName: "decode", ProfileResults: map[string]*scheduling.ProfileRunResult{
		"decode": {TargetEndpoints: []scheduling.Endpoint{primary}},
	}}
	if prefill != nil {
		r.ProfileResults[prefillName] = &scheduling.ProfileRunResult{TargetEndpoints: []scheduling.Endpoint{prefill}}
	}
	return r
}

// decide runs a request through both producers and their PreRequest hooks,
// as the director does, and returns the request.
func (w *world) decide(req *scheduling.InferenceRequest, eps []scheduling.Endpoint, res *scheduling.SchedulingResult) *scheduling.InferenceRequest {
	w.t.Helper()
	ctx := context.Background()
	require.NoError(w.t, w.prefix.Produce(ctx, req, eps))
	require.NoError(w.t, w.src.Produce(ctx, req, eps))
	// The prefix producer's hook first: its speculative entries must not
	// precede the pull decision whatever the order.
	require.NoError(w.t, w.prefix.PreRequest(ctx, req, res))
	require.NoError(w.t, w.src.PreRequest(ctx, req, res))
	return req
}

// header returns the source header the request carries, "" for none.
func header(req *scheduling.InferenceRequest) string { return req.Headers[routing.KVCacheSourceHeader] }

// pulled returns the tokens the request's pull brings, 0 without one.
func (w *world) pulled(req *scheduling.InferenceRequest) int {
	f, ok := scheduling.ReadRequestAttribute[*inflight](req, w.src.pullKey)
	if !ok {
		return 0
	}
	return f.d.Gain * f.d.BlockSize
}

// end runs the response body hook's last call for the request.
func (w *world) end(req *scheduling.InferenceRequest) {
	w.src.ResponseBody(context.Background(), req, &requestcontrol.Response{RequestID: req.RequestID, EndOfStream: true}, nil)
}
