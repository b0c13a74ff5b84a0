package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// world is a plugin on an index fed directly through the events.Sink
// interface (what the subscriber calls), and three endpoints.
type world struct {
	p   *KVSource
	idx *index.Index
	eps []Endpoint
	h   *hashing.Hasher
}

func newWorld(t *testing.T) *world {
	t.Helper()
	idx := index.New(index.Config{})
	p, err := New(Config{Name: "kv", Index: idx, MinCachedTokenDelta: 64, Logger: quiet})
	require.NoError(t, err)
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	w := &world{p: p, idx: idx, h: h}
	for i, name := range []string{"prefill-0", "prefill-1", "decode-0"} {
		w.eps = append(w.eps, NewEndpoint(EndpointMetadata{Name: name, Address: fmt.Sprintf("10.1.0.%d", i+1), Port: "8000"}, Metrics{}))
	}
	return w
}

// hold stores tokens' blocks for endpoint i in tier.
func (w *world) hold(t *testing.T, i int, tier string, tokens []uint32) {
	t.Helper()
	keys, err := w.h.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	w.idx.Store(index.Blocks{Model: model, Holder: holderOf(w.eps[i]), Tier: tier, Keys: keys})
}

func (w *world) request(id string, tokens []uint32) *InferenceRequest {
	return &InferenceRequest{RequestID: id, TargetModel: model, Headers: map[string]string{}, Body: map[string]any{"model": model}, TokenIDs: tokens}
}

func result(primary Endpoint, prefill Endpoint) *SchedulingResult {
	r := &SchedulingResult{PrimaryProfileName: "decode", ProfileResults: map[string]*ProfileRunResult{"decode": {TargetEndpoints: []Endpoint{primary}}}}
	if prefill != nil {
		r.ProfileResults["prefill"] = &ProfileRunResult{TargetEndpoints: []Endpoint{prefill}}
	}
	return r
}

func tokens(seed uint64, n int) []uint32 { return randomTokens(rand.New(rand.NewPCG(seed, 1)), n) }

func TestDataProducerAttachesEachEndpointsPrefix(t *testing.T) {
	w := newWorld(t)
	system := tokens(1, 1024) // 64 blocks
	w.hold(t, 0, index.TierGPU, system)
	w.hold(t, 2, index.TierCPU, system[:512])
	req := w.request("r1", append(slices.Clone(system), tokens(2, 40)...))
	require.NoError(t, w.p.PrepareRequestData(context.Background(), req, w.eps))

	match := func(i int) *PrefixMatch {
		v, ok := w.eps[i].Get(PrefixMatchKey)
		require.True(t, ok)
		return v.(*PrefixMatch)
	}
	require.Equal(t, &PrefixMatch{PromptBlocks: 66, BlockSize: 16, Blocks: 64, GPU: 64, Score: 64}, match(0))
	require.Equal(t, &PrefixMatch{PromptBlocks: 66, BlockSize: 16}, match(1))
	m := match(2)
	require.Equal(t, 32, m.Blocks)
	require.Equal(t, 32, m.CPU)
	require.InDelta(t, 0.8*32, m.Score, 1e-9)

	scores := w.p.Score(context.Background(), &CycleState{}, req, w.eps)
	require.InDelta(t, 64.0/66, scores[w.eps[0]], 1e-9)
	require.Zero(t, scores[w.eps[1]])
	require.InDelta(t, 0.8*32/66, scores[w.eps[2]], 1e-9)
}

func TestPreRequestNamesTheSourceWhenTheComputingEndpointLacksThePrefix(t *testing.T) {
	w := newWorld(t)
	system := tokens(3, 2048)
	w.hold(t, 0, index.TierCPU, system)
	req := w.request("r2", append(slices.Clone(system), tokens(4, 100)...))
	req.Headers[picker.HeaderKVCacheSource] = "203.0.113.9:8000" // a client's forged header
	require.NoError(t, w.p.PrepareRequestData(context.Background(), req, w.eps))
	w.p.PreRequest(context.Background(), req, result(w.eps[1], nil))

	require.Equal(t, "10.1.0.1:8000", req.Headers[picker.HeaderKVCacheSource])
	params := req.Body["kv_transfer_params"].(map[string]any)["remote_kv_source"].(*picker.RemoteKVSource)
	require.Equal(t, &picker.RemoteKVSource{KVRequestID: "r2", RemoteHost: "10.1.0.1", RemotePort: picker.DefaultP2PPort}, params)
	require.Equal(t, 1, w.p.Picker().Inflight(holderOf(w.eps[0])))

	// The end of the response releases the pull.
	w.p.ResponseBody(context.Background(), req, &Response{RequestID: "r2"}, w.eps[1].GetMetadata())
	require.Equal(t, 1, w.p.Picker().Inflight(holderOf(w.eps[0])), "not before the end of the stream")
	w.p.ResponseBody(context.Background(), req, &Response{RequestID: "r2", EndOfStream: true}, w.eps[1].GetMetadata())
	require.Zero(t, w.p.Picker().Inflight(holderOf(w.eps[0])))
}

func TestPreRequestLeavesLocalHitsAlone(t *testing.T) {
	w := newWorld(t)
	system := tokens(5, 2048)
	w.hold(t, 0, index.TierGPU, system)
	w.hold(t, 0, index.TierCPU, system)
	req := w.request("r3", append(slices.Clone(system), tokens(6, 100)...))
	req.Headers[picker.HeaderKVCacheSource] = "203.0.113.9:8000"
	req.Body["kv_transfer_params"] = map[string]any{
		"do_remote_decode": true,
		"remote_kv_source": map[string]any{"kv_request_id": "r3", "remote_host": "203.0.113.9", "remote_port": 5710},
	}
	require.NoError(t, w.p.PrepareRequestData(context.Background(), req, w.eps))
	w.p.PreRequest(context.Background(), req, result(w.eps[0], nil))
	require.NotContains(t, req.Headers, picker.HeaderKVCacheSource, "a forged source header is dropped")
	require.Equal(t, map[string]any{"do_remote_decode": true}, req.Body["kv_transfer_params"], "a forged remote_kv_source is dropped, the rest kept")
}

func TestPreRequestDecidesForThePrefillTargetInPD(t *testing.T) {
	w := newWorld(t)
	system := tokens(7, 2048)
	// Only the decode endpoint holds the prefix (it decoded the previous
	// turn); the prefill endpoint computes this one and pulls from it.
	w.hold(t, 2, index.TierCPU, system)
	req := w.request("r4", append(slices.Clone(system), tokens(8, 100)...))
	require.NoError(t, w.p.PrepareRequestData(context.Background(), req, w.eps))
	w.p.PreRequest(context.Background(), req, result(w.eps[2], w.eps[1]))
	require.Equal(t, "10.1.0.3:8000", req.Headers[picker.HeaderKVCacheSource])
}

func TestPreRequestPullsNothingBelowTheThreshold(t *testing.T) {
	w := newWorld(t)
	system := tokens(9, 48) // 3 blocks: 48 tokens, below the 64-token threshold
	w.hold(t, 0, index.TierCPU, system)
	req := w.request("r5", append(slices.Clone(system), tokens(10, 100)...))
	require.NoError(t, w.p.PrepareRequestData(context.Background(), req, w.eps))
	w.p.PreRequest(context.Background(), req, result(w.eps[1], nil))
	require.NotContains(t, req.Headers, picker.HeaderKVCacheSource)
}

func TestRequestsWithoutTokensAreRefusedAndNotDecided(t *testing.T) {
	w := newWorld(t)
	req := w.request("r6", nil)
	err := w.p.PrepareRequestData(context.Background(), req, w.eps)
	require.ErrorIs(t, err, ErrNoTokens)
	w.p.PreRequest(context.Background(), req, result(w.eps[1], nil))
	require.NotContains(t, req.Headers, picker.HeaderKVCacheSource)
	for _, e := range w.eps {
		_, ok := e.Get(PrefixMatchKey)
		require.False(t, ok)
	}
}

func TestWalkthroughSchedulesAroundTheBusyHolderAndPulls(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, run(context.Background(), nil, &out, io.Discard))
	s := out.String()
	require.Contains(t, s, "scheduled on vllm-0\n  PreRequest: no source header")
	require.Contains(t, s, "scheduled on vllm-2\n  PreRequest: x-kv-cache-source-host-port: 10.0.0.1:8000")
	require.Contains(t, s, "in flight after the responses ended: 0")
}

func TestStaleRequestStateIsSweptAndItsPullReleased(t *testing.T) {
	now := time.Unix(0, 0)
	idx := index.New(index.Config{})
	p, err := New(Config{Index: idx, MinCachedTokenDelta: 16, StateTTL: time.Minute, Now: func() time.Time { return now }, Logger: quiet})
	require.NoError(t, err)
	w := &world{p: p, idx: idx}
	w.h, err = hashing.New(hashing.Config{})
	require.NoError(t, err)
	for i, name := range []string{"a", "b"} {
		w.eps = append(w.eps, NewEndpoint(EndpointMetadata{Name: name, Address: fmt.Sprintf("10.2.0.%d", i+1), Port: "8000"}, Metrics{}))
	}
	system := tokens(11, 256)
	w.hold(t, 0, index.TierCPU, system)
	// A pulled request whose response never ends (the client went away).
	lost := w.request("lost", append(slices.Clone(system), 1, 2, 3))
	require.NoError(t, p.PrepareRequestData(context.Background(), lost, w.eps))
	p.PreRequest(context.Background(), lost, result(w.eps[1], nil))
	require.Equal(t, 1, p.Picker().Inflight(holderOf(w.eps[0])))

	now = now.Add(2 * time.Minute)
	for i := range sweepEvery {
		req := w.request(fmt.Sprintf("r%d", i), tokens(uint64(100+i), 32))
		require.NoError(t, p.PrepareRequestData(context.Background(), req, w.eps))
		p.ResponseBody(context.Background(), req, &Response{EndOfStream: true}, nil)
	}
	_, ok := p.reqs.Load("lost")
	require.False(t, ok, "the lost request's state is swept")
	require.Zero(t, p.Picker().Inflight(holderOf(w.eps[0])), "and its pull released")
}
