//go:build cgo

package zmqevents

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/examples/eppplugin/kvplugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/common/routing"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requesthandling"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/enginepub"
	"github.com/kvsource/kvsource/internal/testenv"
)

func TestParseTopicNamesPodsAsEndpoints(t *testing.T) {
	tests := []struct {
		topic, pod, model string
		ok                bool
	}{
		{"kv@10.0.0.1:8000@openai/gpt-oss-120b", "10.0.0.1:8000", "openai/gpt-oss-120b", true},
		{"kv@fd00::1:8000@m", "[fd00::1]:8000", "m", true},
		{"kv@[fd00::1]:8000@m", "[fd00::1]:8000", "m", true},
		{"kv@vllm-0@m", "vllm-0", "m", true},
		{"not-a-topic", "", "", false},
	}
	for _, tt := range tests {
		t.Run(tt.topic, func(t *testing.T) {
			pod, model, ok := parseTopic(tt.topic)
			require.Equal(t, tt.ok, ok)
			if ok {
				require.Equal(t, tt.pod, pod)
				require.Equal(t, tt.model, model)
			}
		})
	}
}

// Engines publish over ZMQ to the prefix producer's bound socket; its
// index fills, and the source producer names the holder for a pod that
// computes the prompt.
func TestKVEventsOverZMQReachTheDecision(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	port := testenv.FreePort(t)
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", port)
	handle := plugin.NewEppHandle(ctx, nil)
	params := fmt.Sprintf(`{"tokenProcessorConfig":{"blockSizeTokens":16},"kvEventsConfig":{"zmqEndpoint":%q,"discoverPods":false}}`, ep)
	pl, err := kvplugin.PrefixFactory(Subscribe)(kvplugin.PrefixProducerType, plugin.StrictDecoder(json.RawMessage(params)), handle)
	require.NoError(t, err)
	prefix := pl.(*kvplugin.PrefixProducer)
	handle.AddPlugin(kvplugin.PrefixProducerType, prefix)
	sp, err := kvplugin.SourceFactory(kvplugin.SourceProducerType, nil, handle)
	require.NoError(t, err)
	src := sp.(*kvplugin.SourceProducer)

	rng := rand.New(rand.NewPCG(5, 6))
	tokens := make([]uint32, 20*16)
	for i := range tokens {
		tokens[i] = rng.Uint32N(50000)
	}
	keys, err := prefix.Hasher().BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	pub, err := zmq.NewPublisher(zmq.PublisherConfig{Connect: ep, Topic: "kv@127.0.0.1:8000@m"})
	require.NoError(t, err)
	defer pub.Close()
	batch := &events.Batch{Events: []events.Event{
		{Type: events.EventBlockStored, BlockHashes: keys, TokenIDs: tokens, BlockSize: 16, Medium: "GPU"},
		{Type: events.EventBlockStored, BlockHashes: keys, TokenIDs: tokens, BlockSize: 16, Medium: "CPU"},
	}}
	holder := index.Holder{Pod: "127.0.0.1:8000"}
	// What a publisher sends before the subscription reaches it is lost.
	require.NoError(t, pub.WaitSubscribed(ctx))
	_, err = pub.Publish(batch)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return prefix.Index().HolderBlocks("m", holder)[index.TierCPU] == len(keys)
	}, 10*time.Second, 5*time.Millisecond)

	md := func(addr string) *datalayer.EndpointMetadata {
		return &datalayer.EndpointMetadata{Address: addr, Port: "8000"}
	}
	eps := []scheduling.Endpoint{scheduling.NewEndpoint(md("127.0.0.1"), nil, nil), scheduling.NewEndpoint(md("10.0.0.2"), nil, nil)}
	req := &scheduling.InferenceRequest{RequestID: "r", TargetModel: "m", Headers: map[string]string{},
		Body: &requesthandling.InferenceRequestBody{TokenizedPrompt: &requesthandling.TokenizedPrompt{PerPromptTokens: [][]uint32{tokens}}}}
	require.NoError(t, prefix.Produce(ctx, req, eps))
	require.NoError(t, src.Produce(ctx, req, eps))
	res := &scheduling.SchedulingResult{PrimaryProfileName: "default", ProfileResults: map[string]*scheduling.ProfileRunResult{
		"default": {TargetEndpoints: []scheduling.Endpoint{eps[1]}},
	}}
	require.NoError(t, src.PreRequest(ctx, req, res))
	require.Equal(t, "127.0.0.1:8000", req.Headers[routing.KVCacheSourceHeader])
}

// An SGLang engine's events (signed hashes, one BlockStored per page of
// one token, its own keys) reach the decision with engineType sglang.
func TestSGLangEventsOverZMQReachTheDecision(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	handle := plugin.NewEppHandle(ctx, nil)
	params := fmt.Sprintf(`{"tokenProcessorConfig":{"blockSizeTokens":1},"kvEventsConfig":{"engineType":"sglang","zmqEndpoint":%q,"discoverPods":false}}`, ep)
	pl, err := kvplugin.PrefixFactory(Subscribe)(kvplugin.PrefixProducerType, plugin.StrictDecoder(json.RawMessage(params)), handle)
	require.NoError(t, err)
	prefix := pl.(*kvplugin.PrefixProducer)
	require.Equal(t, hashing.SGLang, prefix.Hasher().Config().Algo)

	rng := rand.New(rand.NewPCG(7, 8))
	tokens := make([]uint32, 40)
	for i := range tokens {
		tokens[i] = rng.Uint32N(50000)
	}
	engine := enginepub.New(enginepub.Config{Engine: enginepub.SGLang, PageSize: 1})
	engine.Serve(tokens)
	_, payload := engine.Flush()
	pub, err := zmq.NewPublisher(zmq.PublisherConfig{Connect: ep, Topic: "kv@127.0.0.1:8000@m"})
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.WaitSubscribed(ctx))
	_, err = pub.PublishPayload(payload)
	require.NoError(t, err)
	holder := index.Holder{Pod: "127.0.0.1:8000"}
	require.Eventually(t, func() bool {
		return prefix.Index().HolderBlocks("m", holder)[index.TierGPU] == len(tokens)
	}, 10*time.Second, 5*time.Millisecond)

	keys, err := prefix.Hasher().BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	require.Equal(t, engine.Keys(tokens), keys)
	var res index.Result
	prefix.Index().Lookup("m", keys, &res)
	require.Equal(t, len(tokens), res.Holder(holder).Prefix)
}

// With speculativeIndexing the events go through the prefix producer's
// speculative entries: a routed request's guess on a pod gives way to the
// blocks its engine then reports over ZMQ.
func TestKVEventsOverZMQStoreBesideSpeculativeEntriesAndEvictThem(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	handle := plugin.NewEppHandle(ctx, nil)
	params := fmt.Sprintf(`{"tokenProcessorConfig":{"blockSizeTokens":16},"speculativeIndexing":true,"speculativeTTL":"1h",`+
		`"kvEventsConfig":{"zmqEndpoint":%q,"discoverPods":false}}`, ep)
	pl, err := kvplugin.PrefixFactory(Subscribe)(kvplugin.PrefixProducerType, plugin.StrictDecoder(json.RawMessage(params)), handle)
	require.NoError(t, err)
	prefix := pl.(*kvplugin.PrefixProducer)

	rng := rand.New(rand.NewPCG(7, 8))
	tokens := make([]uint32, 12*16)
	for i := range tokens {
		tokens[i] = rng.Uint32N(50000)
	}
	keys, err := prefix.Hasher().BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	target := scheduling.NewEndpoint(&datalayer.EndpointMetadata{Address: "127.0.0.1", Port: "8000"}, nil, nil)
	eps := []scheduling.Endpoint{target}
	req := &scheduling.InferenceRequest{RequestID: "r", TargetModel: "m", Headers: map[string]string{},
		Body: &requesthandling.InferenceRequestBody{TokenizedPrompt: &requesthandling.TokenizedPrompt{PerPromptTokens: [][]uint32{tokens}}}}
	require.NoError(t, prefix.Produce(ctx, req, eps))
	require.NoError(t, prefix.PreRequest(ctx, req, &scheduling.SchedulingResult{PrimaryProfileName: "default",
		ProfileResults: map[string]*scheduling.ProfileRunResult{"default": {TargetEndpoints: eps}}}))
	holder := index.Holder{Pod: "127.0.0.1:8000"}
	require.Equal(t, len(keys), prefix.Index().HolderBlocks("m", holder)[index.TierSpeculative])

	pub, err := zmq.NewPublisher(zmq.PublisherConfig{Connect: ep, Topic: "kv@127.0.0.1:8000@m"})
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.WaitSubscribed(ctx))
	_, err = pub.Publish(&events.Batch{Events: []events.Event{
		{Type: events.EventBlockStored, BlockHashes: keys, TokenIDs: tokens, BlockSize: 16, Medium: "GPU"},
	}})
	require.NoError(t, err)
	// The engine's stores stand beside the guesses until their TTL, as
	// upstream's do, so that a prompt partly stored still weighs as GPU
	// throughout; its evictions take both out.
	require.Eventually(t, func() bool {
		return prefix.Index().HolderBlocks("m", holder)[index.TierGPU] == len(keys)
	}, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, len(keys), prefix.Index().HolderBlocks("m", holder)[index.TierSpeculative])
	_, err = pub.Publish(&events.Batch{Events: []events.Event{
		{Type: events.EventBlockRemoved, BlockHashes: keys, Medium: "GPU"},
	}})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return len(prefix.Index().HolderBlocks("m", holder)) == 0
	}, 10*time.Second, 5*time.Millisecond)
}
