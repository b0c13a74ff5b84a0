package kvplugin

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requesthandling"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	attrprefix "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/datalayer/attribute/prefix"
	tokenproducer "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/k8s.io/apimachinery/pkg/types"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

func matchOf(t *testing.T, p *PrefixProducer, ep scheduling.Endpoint) *attrprefix.PrefixCacheMatchInfo {
	t.Helper()
	v, ok := ep.Get(p.dk.String())
	require.True(t, ok, "no match info on %s", ep.GetMetadata())
	return v.(*attrprefix.PrefixCacheMatchInfo)
}

// The match every candidate gets has the shape upstream's consumers read:
// the tier-weighted match, the unweighted consecutive prefix in any tier,
// and each tier's own consecutive prefix under its lower-case name, never a
// nil map.
func TestPrefixProducerWritesEachCandidatesMatch(t *testing.T) {
	const cpu, gpu = index.TierCPU, index.TierGPU
	type want struct {
		match, cached int
		byTier        map[string]int
	}
	tests := []struct {
		name    string
		weights []*KVCacheBackendConfig // nil: the defaults, gpu 1.0 and cpu 0.8
		hold    func(w *world, ep scheduling.Endpoint)
		want    want
	}{
		{"GPU and CPU", nil, func(w *world, ep scheduling.Endpoint) {
			w.hold(ep, gpu, 0, promptBlocks)
			w.hold(ep, cpu, 0, 4)
		}, want{8, 8, map[string]int{"gpu": 8, "cpu": 4}}},
		{"CPU only weighs 0.8 a block", nil, func(w *world, ep scheduling.Endpoint) {
			w.hold(ep, cpu, 0, 5)
		}, want{4, 5, map[string]int{"cpu": 5}}},
		{"CPU weighs as configured", []*KVCacheBackendConfig{{Name: "gpu", Weight: 1}, {Name: "cpu", Weight: 0.4}}, func(w *world, ep scheduling.Endpoint) {
			w.hold(ep, cpu, 0, 5)
		}, want{2, 5, map[string]int{"cpu": 5}}},
		{"a prefix continued in another tier counts whole, each tier its own", nil, func(w *world, ep scheduling.Endpoint) {
			w.hold(ep, gpu, 0, 2)
			w.hold(ep, cpu, 2, 4)
		}, want{5, 6, map[string]int{"gpu": 2}}},
		{"nothing held", nil, func(*world, scheduling.Endpoint) {}, want{0, 0, map[string]int{}}},
		{"blocks after a gap do not count", nil, func(w *world, ep scheduling.Endpoint) {
			w.hold(ep, gpu, 1, 3)
		}, want{0, 0, map[string]int{}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t, SourceConfig{})
			if tt.weights != nil {
				cfg := DefaultPrefixConfig()
				cfg.TokenProcessorConfig = &TokenProcessorConfig{BlockSizeTokens: testBlockSize}
				cfg.IndexerConfig.BackendConfigs = tt.weights
				p, err := NewPrefixProducer("weighted", cfg, w.idx)
				require.NoError(t, err)
				w.prefix = p
			}
			ep, other := endpoint(ip(1), 0), endpoint(ip(2), 0)
			tt.hold(w, ep)
			w.hold(other, gpu, 0, promptBlocks)
			nilMeta := scheduling.NewEndpoint(nil, nil, nil)
			require.NoError(t, w.prefix.Produce(context.Background(), w.request("r"), []scheduling.Endpoint{ep, nilMeta, other}))
			m := matchOf(t, w.prefix, ep)
			require.Equal(t, tt.want.match, m.MatchBlocks())
			require.Equal(t, tt.want.cached, m.CachedBlockCount())
			require.Equal(t, tt.want.byTier, m.CachedBlocksByTier())
			require.Equal(t, promptBlocks, m.TotalBlocks())
			require.Equal(t, testBlockSize, m.BlockSizeTokens())
			require.Empty(t, nilMeta.Keys(), "an endpoint without metadata gets no match")
			require.Equal(t, promptBlocks, matchOf(t, w.prefix, other).CachedBlockCount())
		})
	}
}

// Produce leaves a request without token ids alone, as upstream does.
func TestPrefixProducerSkipsRequestsWithoutTokens(t *testing.T) {
	tests := []struct {
		name string
		body *requesthandling.InferenceRequestBody
	}{
		{"no body", nil},
		{"not tokenized", &requesthandling.InferenceRequestBody{}},
		{"no prompt", &requesthandling.InferenceRequestBody{TokenizedPrompt: &requesthandling.TokenizedPrompt{}}},
		{"shorter than a block", &requesthandling.InferenceRequestBody{TokenizedPrompt: &requesthandling.TokenizedPrompt{PerPromptTokens: [][]uint32{{1, 2, 3}}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t, SourceConfig{})
			ep := endpoint(ip(1), 0)
			w.hold(ep, index.TierGPU, 0, 3)
			req := &scheduling.InferenceRequest{RequestID: "r", TargetModel: testModel, Body: tt.body}
			require.NoError(t, w.prefix.Produce(context.Background(), req, []scheduling.Endpoint{ep}))
			require.Empty(t, ep.Keys())
			_, ok := w.prefix.promptOf(req)
			require.False(t, ok)
		})
	}
}

// Several prompts add up, as upstream sums them; the cache salt and the
// model are part of the keys.
func TestPrefixProducerKeysPromptsSaltAndModel(t *testing.T) {
	tests := []struct {
		name       string
		edit       func(w *world, req *scheduling.InferenceRequest)
		wantCached int
		wantTotal  int
		wantPrompt bool
	}{
		{"one prompt", func(*world, *scheduling.InferenceRequest) {}, 3, promptBlocks, true},
		{"two prompts sum", func(w *world, req *scheduling.InferenceRequest) {
			tp := req.Body.TokenizedPrompt
			tp.PerPromptTokens = append(tp.PerPromptTokens, w.tokens[:4*testBlockSize])
		}, 6, promptBlocks + 4, false},
		{"a cache salt keys other blocks", func(_ *world, req *scheduling.InferenceRequest) {
			req.Body.TokenizedPrompt.CacheSalt = "tenant-a"
		}, 0, promptBlocks, true},
		{"another model has its own blocks", func(_ *world, req *scheduling.InferenceRequest) {
			req.TargetModel = "other"
		}, 0, promptBlocks, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t, SourceConfig{})
			ep := endpoint(ip(1), 0)
			w.hold(ep, index.TierGPU, 0, 3)
			req := w.request("r")
			tt.edit(w, req)
			require.NoError(t, w.prefix.Produce(context.Background(), req, []scheduling.Endpoint{ep}))
			m := matchOf(t, w.prefix, ep)
			require.Equal(t, tt.wantCached, m.CachedBlockCount())
			require.Equal(t, tt.wantTotal, m.TotalBlocks())
			_, ok := w.prefix.promptOf(req)
			require.Equal(t, tt.wantPrompt, ok)
		})
	}
}

func TestPrefixProducerDeclaresItsData(t *testing.T) {
	w := newWorld(t, SourceConfig{})
	require.Equal(t, plugin.TypedName{Type: PrefixProducerType, Name: PrefixProducerType}, w.prefix.TypedName())
	require.Equal(t, map[plugin.DataKey]any{
		attrprefix.PrefixCacheMatchInfoDataKey.WithNonEmptyProducerName(PrefixProducerType): attrprefix.PrefixCacheMatchInfo{},
	}, w.prefix.Produces())
	require.Equal(t, plugin.DataDependencies{Required: map[plugin.DataKey]any{
		tokenproducer.TokenizedPromptDataKey: scheduling.TokenizedPrompt{},
	}}, w.prefix.Consumes())
}

// fakeSub records what the prefix producer asks of its subscription.
type fakeSub struct {
	cfg     SubscriptionConfig
	mu      sync.Mutex
	calls   []string
	running chan context.Context
	down    map[string]bool // pods Source reports disconnected
}

func (f *fakeSub) AddPod(pod, endpoint, replay string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmt.Sprintf("add %s %s %s", pod, endpoint, replay))
	return nil
}

func (f *fakeSub) RemovePod(pod string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "remove "+pod)
}

func (f *fakeSub) Source(h index.Holder) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.down[h.Pod] {
		return events.StateDisconnected, false
	}
	return events.StateLive, true
}

func (f *fakeSub) Run(ctx context.Context) error {
	f.running <- ctx
	<-ctx.Done()
	return nil
}

func (f *fakeSub) takeCalls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := f.calls
	f.calls = nil
	return c
}

// newFakeSubscribe returns a SubscribeFunc handing out one fakeSub.
func newFakeSubscribe() (*fakeSub, SubscribeFunc) {
	f := &fakeSub{running: make(chan context.Context, 1)}
	return f, func(cfg SubscriptionConfig) (Subscription, error) {
		f.cfg = cfg
		return f, nil
	}
}

// The factory's parameters: upstream's names and defaults, kvsource's
// refusals of what it does not do.
func TestPrefixFactory(t *testing.T) {
	tests := []struct {
		name      string
		params    string
		noSub     bool // register without a subscription
		wantErr   string
		wantBlock int
		wantAlgo  hashing.Algo
		wantSub   *SubscriptionConfig // Index, Sink and Hasher not compared
		wantTTL   time.Duration       // speculative entries' TTL; 0: speculative indexing off
	}{
		{name: "defaults subscribe per discovered pod", wantBlock: 16, wantAlgo: hashing.SHA256,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4}},
		{name: "defaults without a subscription are refused", noSub: true, wantErr: "registered without a subscription"},
		{name: "no KV events need no subscription", noSub: true,
			params: `{"kvEventsConfig":{"discoverPods":false}}`, wantBlock: 16, wantAlgo: hashing.SHA256},
		{name: "blockSizeTokens", params: `{"tokenProcessorConfig":{"blockSizeTokens":64,"hashSeed":"0"}}`, wantBlock: 64, wantAlgo: hashing.SHA256,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4}},
		{name: "the deprecated blockSize applies when blockSizeTokens is 0", params: `{"tokenProcessorConfig":{"blockSize":32}}`, wantBlock: 32, wantAlgo: hashing.SHA256,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4}},
		{name: "no block size is refused", params: `{"tokenProcessorConfig":{"hashSeed":"0"}}`, wantErr: "blockSizeTokens must be positive"},
		{name: "a negative block size is refused", params: `{"tokenProcessorConfig":{"blockSizeTokens":-1}}`, wantErr: "blockSizeTokens must be positive"},
		{name: "a bound socket and kvsource's hash settings", params: `{"hashAlgo":"xxhash","tokenProcessorConfig":{"blockSizeTokens":16,"hashSeed":"0"},` +
			`"kvEventsConfig":{"zmqEndpoint":"tcp://*:5557","topicFilter":"kv@10.","concurrency":2,"discoverPods":false}}`,
			wantBlock: 16, wantAlgo: hashing.XXHash, wantSub: &SubscriptionConfig{Bind: "tcp://*:5557", TopicFilter: "kv@10.", Workers: 2}},
		{name: "content keys", params: `{"contentKeys":true}`, wantBlock: 16, wantAlgo: hashing.Content,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4}},
		{name: "content keys and an algorithm are refused", params: `{"contentKeys":true,"hashAlgo":"sha256"}`, wantErr: "contentKeys replaces hashAlgo"},
		{name: "content as an algorithm is refused", params: `{"hashAlgo":"content"}`, wantErr: "set contentKeys: true instead"},
		{name: "an xxhash algorithm without a seed is refused", params: `{"hashAlgo":"xxhash"}`, wantErr: "seed"},
		{name: "an unknown algorithm is refused", params: `{"hashAlgo":"md5"}`, wantErr: "unknown algorithm"},
		{name: "speculative indexing is off by default, as upstream", params: `{"speculativeTTL":"5s"}`, wantBlock: 16, wantAlgo: hashing.SHA256,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4}},
		{name: "speculative indexing with upstream's default TTL of 2s", params: `{"speculativeIndexing":true}`, wantBlock: 16, wantAlgo: hashing.SHA256,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4}, wantTTL: 2 * time.Second},
		{name: "speculative indexing with a TTL", params: `{"speculativeIndexing":true,"speculativeTTL":"750ms"}`, wantBlock: 16, wantAlgo: hashing.SHA256,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4}, wantTTL: 750 * time.Millisecond},
		{name: "a zero speculativeTTL means 2s, as upstream", params: `{"speculativeIndexing":true,"speculativeTTL":"0s"}`, wantBlock: 16, wantAlgo: hashing.SHA256,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4}, wantTTL: 2 * time.Second},
		{name: "a negative speculativeTTL means 2s, as upstream", params: `{"speculativeIndexing":true,"speculativeTTL":"-1s"}`, wantBlock: 16, wantAlgo: hashing.SHA256,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4}, wantTTL: 2 * time.Second},
		{name: "a speculativeTTL under 1ms is refused", params: `{"speculativeIndexing":true,"speculativeTTL":"3ns"}`, wantErr: `speculativeTTL "3ns" is below 1ms`},
		{name: "a malformed speculativeTTL is refused", params: `{"speculativeTTL":"soon"}`, wantErr: `speculativeTTL "soon" is not a duration`},
		{name: "a speculativeTTL without a unit is refused", params: `{"speculativeIndexing":true,"speculativeTTL":"2"}`, wantErr: `speculativeTTL "2" is not a duration`},
		{name: "a speculativeTTL that is a number is refused", params: `{"speculativeTTL":2}`, wantErr: "speculativeTTL"},
		{name: "a speculativeIndexing that is a string is refused", params: `{"speculativeIndexing":"yes"}`, wantErr: "speculativeIndexing"},
		{name: "a null indexerConfig is refused", params: `{"indexerConfig":null}`, wantErr: "indexerConfig is required"},
		{name: "a tokenizers pool is refused", params: `{"indexerConfig":{"tokenizersPoolConfig":{}}}`, wantErr: "tokenizersPoolConfig is not supported"},
		{name: "another index backend is refused", params: `{"indexerConfig":{"kvBlockIndexConfig":{"redisConfig":{}}}}`, wantErr: `unknown field "redisConfig"`},
		{name: "sglang keys by SGLang's pages", params: `{"tokenProcessorConfig":{"blockSizeTokens":1},"kvEventsConfig":{"engineType":"sglang","discoverPods":true,` +
			`"topicFilter":"kv@","concurrency":4,"podDiscoveryConfig":{"socketPort":5557}}}`, wantBlock: 1, wantAlgo: hashing.SGLang,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4, Engine: events.EngineSGLang}},
		{name: "sglang with content keys", params: `{"contentKeys":true,"kvEventsConfig":{"engineType":"sglang","topicFilter":"kv@","concurrency":4,` +
			`"discoverPods":true,"podDiscoveryConfig":{"socketPort":5557}}}`, wantBlock: 16, wantAlgo: hashing.Content,
			wantSub: &SubscriptionConfig{TopicFilter: "kv@", Workers: 4, Engine: events.EngineSGLang}},
		{name: "another engine is refused", params: `{"kvEventsConfig":{"engineType":"trtllm"}}`, wantErr: "want vllm or sglang"},
		{name: "a bad socket port is refused", params: `{"kvEventsConfig":{"discoverPods":true,"podDiscoveryConfig":{"socketPort":0}}}`, wantErr: "socketPort 0"},
		{name: "a negative tier weight is refused", params: `{"indexerConfig":{"kvCacheBackendConfigs":[{"name":"cpu","weight":-1}]}}`, wantErr: "non-negative weight"},
		{name: "unknown fields are refused", params: `{"tokenProcessorConfig":{"blockSizeTokens":16,"bogus":1}}`, wantErr: `unknown field "bogus"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			sub, subscribe := newFakeSubscribe()
			if tt.noSub {
				subscribe = nil
			}
			handle := plugin.NewEppHandle(ctx, nil)
			p, err := PrefixFactory(subscribe)("pp", plugin.StrictDecoder(json.RawMessage(tt.params)), handle)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				require.ErrorIs(t, err, ErrConfig)
				return
			}
			require.NoError(t, err)
			pp := p.(*PrefixProducer)
			require.Equal(t, tt.wantBlock, pp.Hasher().Config().BlockSize)
			require.Equal(t, tt.wantAlgo, pp.Hasher().Config().Algo)
			if tt.wantTTL == 0 {
				require.Nil(t, pp.Speculative())
			} else {
				require.NotNil(t, pp.Speculative())
				require.Equal(t, tt.wantTTL, pp.specTTL)
			}
			if tt.wantSub == nil {
				require.Nil(t, pp.sub)
				return
			}
			require.Same(t, pp.Index(), sub.cfg.Index)
			require.Same(t, pp.Hasher(), sub.cfg.Hasher)
			// Events go through the speculative entries when there are
			// any, so that the engines' evictions take them out.
			if pp.Speculative() != nil {
				require.Same(t, pp.Speculative(), sub.cfg.Sink)
			} else {
				require.Same(t, pp.Index(), sub.cfg.Sink)
			}
			got := sub.cfg
			got.Index, got.Sink, got.Hasher, got.Logger = nil, nil, nil, nil
			require.Equal(t, *tt.wantSub, got)
			// The subscription runs for the EPP's lifetime: the handle's
			// context, which ends it.
			require.Equal(t, ctx, <-sub.running)
		})
	}
}

// Endpoint lifecycle events subscribe to and forget pods: the event socket
// is the endpoint's address at socketPort plus its rank, bracketed for
// IPv6, with replay at replaySocketPort plus its rank when that is set.
func TestPrefixProducerFollowsEndpointEvents(t *testing.T) {
	type ev struct {
		typ  datalayer.EventType
		md   *datalayer.EndpointMetadata
		want []string // subscription calls
	}
	meta := func(name, addr, port string, rank int) *datalayer.EndpointMetadata {
		return &datalayer.EndpointMetadata{ID: types.NamespacedName{Namespace: "ns", Name: name}, Address: addr, Port: port, RankIndex: rank}
	}
	tests := []struct {
		name   string
		params string
		events []ev
		// holders left in the index, of those the test stores for each
		// added endpoint
		wantHolders []index.Holder
	}{
		{
			name: "an added endpoint is subscribed to, a deleted one forgotten",
			events: []ev{
				{datalayer.EventAddOrUpdate, meta("a", "10.0.0.1", "8080", 0), []string{"add 10.0.0.1:8080 tcp://10.0.0.1:5557 "}},
				{datalayer.EventAddOrUpdate, meta("b", "10.0.0.2", "8080", 0), []string{"add 10.0.0.2:8080 tcp://10.0.0.2:5557 "}},
				{datalayer.EventDelete, meta("a", "10.0.0.1", "8080", 0), []string{"remove 10.0.0.1:8080"}},
			},
			wantHolders: []index.Holder{{Pod: "10.0.0.2:8080"}},
		},
		{
			name:   "a rank's sockets are offset by its rank, replay too",
			params: `{"kvEventsConfig":{"discoverPods":true,"podDiscoveryConfig":{"socketPort":5556,"replaySocketPort":5600}}}`,
			events: []ev{
				{datalayer.EventAddOrUpdate, meta("a-2", "10.0.0.1", "8002", 2), []string{"add 10.0.0.1:8002 tcp://10.0.0.1:5558 tcp://10.0.0.1:5602"}},
			},
			wantHolders: []index.Holder{{Pod: "10.0.0.1:8002", Rank: 2}},
		},
		{
			name: "IPv6 addresses are bracketed",
			events: []ev{
				{datalayer.EventAddOrUpdate, meta("a", "fd00::1", "8080", 0), []string{"add [fd00::1]:8080 tcp://[fd00::1]:5557 "}},
			},
			wantHolders: []index.Holder{{Pod: "[fd00::1]:8080"}},
		},
		{
			name: "an endpoint that moves is forgotten at its old address",
			events: []ev{
				{datalayer.EventAddOrUpdate, meta("a", "10.0.0.1", "8080", 0), []string{"add 10.0.0.1:8080 tcp://10.0.0.1:5557 "}},
				{datalayer.EventAddOrUpdate, meta("a", "10.0.0.5", "8080", 0), []string{"remove 10.0.0.1:8080", "add 10.0.0.5:8080 tcp://10.0.0.5:5557 "}},
			},
			wantHolders: []index.Holder{{Pod: "10.0.0.5:8080"}},
		},
		{
			name: "an update in place subscribes again, which the subscription treats as a replacement",
			events: []ev{
				{datalayer.EventAddOrUpdate, meta("a", "10.0.0.1", "8080", 0), []string{"add 10.0.0.1:8080 tcp://10.0.0.1:5557 "}},
				{datalayer.EventAddOrUpdate, meta("a", "10.0.0.1", "8080", 0), []string{"add 10.0.0.1:8080 tcp://10.0.0.1:5557 "}},
			},
			wantHolders: []index.Holder{{Pod: "10.0.0.1:8080"}},
		},
		{
			name: "endpoints without an id or an address are ignored",
			events: []ev{
				{datalayer.EventAddOrUpdate, meta("", "10.0.0.1", "8080", 0), nil},
				{datalayer.EventAddOrUpdate, meta("a", "", "8080", 0), nil},
				{datalayer.EventDelete, meta("a", "", "8080", 0), nil},
			},
			wantHolders: []index.Holder{{Pod: "10.0.0.1:8080"}},
		},
		{
			name:   "without pod discovery nothing is subscribed",
			params: `{"kvEventsConfig":{"zmqEndpoint":"tcp://*:5557","discoverPods":false}}`,
			events: []ev{
				{datalayer.EventAddOrUpdate, meta("a", "10.0.0.1", "8080", 0), nil},
				{datalayer.EventDelete, meta("a", "10.0.0.1", "8080", 0), nil},
			},
			wantHolders: []index.Holder{{Pod: "10.0.0.1:8080"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			sub, subscribe := newFakeSubscribe()
			p, err := PrefixFactory(subscribe)("pp", plugin.StrictDecoder(json.RawMessage(tt.params)), plugin.NewEppHandle(ctx, nil))
			require.NoError(t, err)
			pp := p.(*PrefixProducer)
			<-sub.running
			for _, e := range tt.events {
				if e.md.Address != "" && e.typ == datalayer.EventAddOrUpdate {
					// What the endpoint's engine would have reported.
					pp.Index().Store(index.Blocks{Model: testModel, Holder: holderOf(e.md), Tier: index.TierGPU, Keys: []uint64{1, 2}})
				}
				require.NoError(t, pp.Extract(ctx, datalayer.EndpointEvent{Type: e.typ, Endpoint: datalayer.NewEndpoint(e.md, nil)}))
				require.Equal(t, e.want, sub.takeCalls())
			}
			var holders []index.Holder
			for _, hm := range pp.Index().HolderList() {
				holders = append(holders, hm.Holder)
			}
			require.Equal(t, tt.wantHolders, holders)
		})
	}
}
