package kvplugin

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"os"
	"os/exec"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/common/routing"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requestcontrol"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requesthandling"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/k8s.io/apimachinery/pkg/types"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// The plugins section of the README's EPP configuration, as the loader
// hands it to factories (YAML becomes JSON), the source producer listed
// first: the loader orders it after the prefix producer it references.
var readmePlugins = []struct{ typ, params string }{
	{SourceProducerType, `{"prefixMatchInfoProducerName":"kvsource-prefix-cache-producer","prefillProfileName":"default","minCachedTokenDelta":2048}`},
	{PrefixProducerType, `{"tokenProcessorConfig":{"blockSize":64,"hashSeed":"0"},` +
		`"indexerConfig":{"kvBlockIndexConfig":{"inMemoryConfig":{"podCacheSize":32}},"kvCacheBackendConfigs":[{"name":"gpu","weight":1.0},{"name":"cpu","weight":0.4}]},` +
		`"speculativeIndexing":true,` +
		`"kvEventsConfig":{"topicFilter":"kv@","discoverPods":true,"podDiscoveryConfig":{"socketPort":5556}}}`},
}

// guidePrefixParams are the precise-prefix-cache-producer parameters of
// llm-d's P2P KV cache sharing guide (router/p2p-kv-cache-sharing.values.yaml,
// ../shared/spec/llmd-epp.md §4) as the loader hands them over, verbatim.
const guidePrefixParams = `{"tokenProcessorConfig":{"blockSize":64},` +
	`"indexerConfig":{"kvBlockIndexConfig":{"inMemoryConfig":{"podCacheSize":32}},"kvCacheBackendConfigs":[{"name":"gpu","weight":1.0},{"name":"cpu","weight":0.4}]},` +
	`"speculativeIndexing":true,` +
	`"kvEventsConfig":{"topicFilter":"kv@","discoverPods":true,"podDiscoveryConfig":{"socketPort":5556}}}`

// The guide's own parameters load into kvsource's prefix producer
// unchanged, speculative indexing on with upstream's 2s TTL, events fed
// through the speculative entries.
func TestPrefixFactoryLoadsTheP2PGuidesParameters(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub, subscribe := newFakeSubscribe()
	pl, err := PrefixFactory(subscribe)("precise-prefix-cache-producer", plugin.StrictDecoder(json.RawMessage(guidePrefixParams)), plugin.NewEppHandle(ctx, nil))
	require.NoError(t, err)
	p := pl.(*PrefixProducer)
	require.Equal(t, hashing.SHA256, p.Hasher().Config().Algo)
	require.Equal(t, 64, p.Hasher().Config().BlockSize)
	require.NotNil(t, p.Speculative())
	require.Equal(t, 2*time.Second, p.specTTL)
	require.Same(t, p.Speculative(), sub.cfg.Sink)
	require.Equal(t, SubscriptionConfig{TopicFilter: "kv@", Workers: 4}, SubscriptionConfig{TopicFilter: sub.cfg.TopicFilter, Workers: sub.cfg.Workers, Bind: sub.cfg.Bind})
	require.Equal(t, ctx, <-sub.running)
}

// pluginRefs returns the values of a parsed configuration's fields tagged
// pluginRef: the plugins the loader creates first.
func pluginRefs(cfg any) []string {
	v := reflect.ValueOf(cfg).Elem()
	var refs []string
	for i := range v.NumField() {
		if _, ok := v.Type().Field(i).Tag.Lookup("pluginRef"); ok && v.Field(i).String() != "" {
			refs = append(refs, v.Field(i).String())
		}
	}
	return refs
}

// The README's configuration loads through the registry as the EPP's loader
// does it, and the loaded plugins discover a pod and decide a pull.
func TestRegisteredPluginsLoadTheREADMEConfiguration(t *testing.T) {
	sub, subscribe := newFakeSubscribe()
	Register(subscribe)
	for _, typ := range []string{PrefixProducerType, SourceProducerType} {
		require.Contains(t, plugin.Registry, typ)
		require.Equal(t, plugin.StabilityAlpha, plugin.RegistryMetadata[typ].Stability)
	}
	require.Contains(t, plugin.PluginsWithPluginDependencies, SourceProducerType)
	require.NotContains(t, plugin.PluginsWithPluginDependencies, PrefixProducerType)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	handle := plugin.NewEppHandle(ctx, nil)
	// The loader's order: a plugin after those its parameters reference.
	deps := map[string][]string{}
	for _, p := range readmePlugins {
		if parse, ok := plugin.PluginsWithPluginDependencies[p.typ]; ok {
			cfg, err := parse(plugin.StrictDecoder(json.RawMessage(p.params)), handle)
			require.NoError(t, err)
			deps[p.typ] = pluginRefs(cfg)
		}
	}
	require.Equal(t, map[string][]string{SourceProducerType: {PrefixProducerType}}, deps)
	for _, p := range []int{1, 0} {
		spec := readmePlugins[p]
		// Names default to types in an EPP configuration.
		pl, err := plugin.Registry[spec.typ](spec.typ, plugin.StrictDecoder(json.RawMessage(spec.params)), handle)
		require.NoError(t, err)
		handle.AddPlugin(spec.typ, pl)
	}
	<-sub.running
	prefix, err := plugin.PluginByType[*PrefixProducer](handle, PrefixProducerType)
	require.NoError(t, err)
	src, err := plugin.PluginByType[*SourceProducer](handle, SourceProducerType)
	require.NoError(t, err)
	require.Equal(t, hashing.Config{Algo: hashing.SHA256, Seed: "0", BlockSize: 64}, prefix.Hasher().Config())
	require.NotNil(t, prefix.Speculative(), "the guide turns speculativeIndexing on")
	require.Same(t, prefix.Speculative(), sub.cfg.Sink)
	var _ requestcontrol.ResponseBodyProcessor = src

	// The endpoint-notification-source relays a new pod.
	holder := &datalayer.EndpointMetadata{ID: types.NamespacedName{Namespace: "ns", Name: "vllm-0"}, Address: "10.0.0.1", Port: "8000"}
	computing := &datalayer.EndpointMetadata{ID: types.NamespacedName{Namespace: "ns", Name: "vllm-1"}, Address: "10.0.0.2", Port: "8000"}
	for _, md := range []*datalayer.EndpointMetadata{holder, computing} {
		require.NoError(t, prefix.Extract(ctx, datalayer.EndpointEvent{Type: datalayer.EventAddOrUpdate, Endpoint: datalayer.NewEndpoint(md, nil)}))
	}
	require.Equal(t, []string{"add 10.0.0.1:8000 tcp://10.0.0.1:5556 ", "add 10.0.0.2:8000 tcp://10.0.0.2:5556 "}, sub.takeCalls())

	// vllm-0 reports a 40-block prompt offloaded to CPU; vllm-1 is chosen
	// to compute it: 2560 tokens to pull, above the 2048 delta.
	rng := rand.New(rand.NewPCG(3, 4))
	tokens := make([]uint32, 40*64+7)
	for i := range tokens {
		tokens[i] = rng.Uint32N(50000)
	}
	keys, err := prefix.Hasher().BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	prefix.Index().Store(index.Blocks{Model: "gpt", Holder: holderOf(holder), Tier: index.TierCPU, Keys: keys})

	eps := []scheduling.Endpoint{scheduling.NewEndpoint(holder, nil, nil), scheduling.NewEndpoint(computing, nil, nil)}
	req := &scheduling.InferenceRequest{RequestID: "r1", TargetModel: "gpt", Headers: map[string]string{},
		Body: &requesthandling.InferenceRequestBody{TokenizedPrompt: &requesthandling.TokenizedPrompt{PerPromptTokens: [][]uint32{tokens}}}}
	for _, dp := range []requestcontrol.DataProducer{prefix, src} {
		require.NoError(t, dp.Produce(ctx, req, eps))
	}
	res := &scheduling.SchedulingResult{PrimaryProfileName: "default", ProfileResults: map[string]*scheduling.ProfileRunResult{
		"default": {TargetEndpoints: []scheduling.Endpoint{eps[1]}},
	}}
	// The director runs every PreRequest plugin, the prefix producer's too.
	require.NoError(t, prefix.PreRequest(ctx, req, res))
	require.NoError(t, src.PreRequest(ctx, req, res))
	require.Equal(t, "10.0.0.1:8000", req.Headers[routing.KVCacheSourceHeader])
	require.Equal(t, 1, src.Inflight(holder))
	src.ResponseBody(ctx, req, &requestcontrol.Response{RequestID: "r1", EndOfStream: true}, computing)
	require.Zero(t, src.Inflight(holder))

	// vllm-1 now holds the prompt speculatively: the next request on it
	// scores there at once, at the GPU's weight.
	next := &scheduling.InferenceRequest{RequestID: "r2", TargetModel: "gpt", Headers: map[string]string{},
		Body: &requesthandling.InferenceRequestBody{TokenizedPrompt: &requesthandling.TokenizedPrompt{PerPromptTokens: [][]uint32{tokens}}}}
	require.NoError(t, prefix.Produce(ctx, next, eps))
	m := matchOf(t, prefix, eps[1])
	require.Equal(t, map[string]int{"speculative": 40}, m.CachedBlocksByTier())
	require.Equal(t, 40, m.MatchBlocks())
	// Its engine's own event, through the subscription's sink, adds the
	// blocks beside the guess, which stays until its TTL, as upstream's.
	sub.cfg.Sink.Store(index.Blocks{Model: "gpt", Holder: holderOf(computing), Tier: index.TierGPU, Keys: keys})
	require.NoError(t, prefix.Produce(ctx, next, eps))
	require.Equal(t, map[string]int{"gpu": 40, "speculative": 40}, matchOf(t, prefix, eps[1]).CachedBlocksByTier())
	require.Equal(t, uint64(1), prefix.Speculative().Stats().Replaced)
}

// The decision path, this package and the mirror, builds without cgo, and
// neither it nor its tests depend on libzmq; only zmqevents may.
func TestDecisionPathBuildsWithoutCgo(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the go tool")
	}
	env := append(os.Environ(), "CGO_ENABLED=0")
	// Only the plugins: the porting recipe deletes the mirror, whose
	// packages "." imports (and so checks) as long as it is here.
	pkgs := []string{"."}
	out, err := runGo(env, append([]string{"list", "-deps", "-test", "-f", "{{.ImportPath}}"}, pkgs...)...)
	require.NoError(t, err, "%s", out)
	for _, dep := range strings.Fields(out) {
		require.NotEqual(t, "github.com/pebbe/zmq4", dep, "the decision path must not depend on libzmq")
	}
	out, err = runGo(env, append([]string{"build"}, pkgs...)...)
	require.NoError(t, err, "%s", out)
}

func runGo(env []string, args ...string) (string, error) {
	cmd := exec.Command("go", args...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	return string(out), err
}
