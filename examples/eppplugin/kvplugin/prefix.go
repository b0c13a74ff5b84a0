package kvplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requestcontrol"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	attrprefix "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/datalayer/attribute/prefix"
	tokenproducer "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/k8s.io/apimachinery/pkg/types"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// PrefixConfig is the prefix producer's parameters: those of upstream's
// precise-prefix-cache-producer that kvsource implements, under the same
// names, plus kvsource's own (HashAlgo, ContentKeys).
type PrefixConfig struct {
	TokenProcessorConfig *TokenProcessorConfig `json:"tokenProcessorConfig"`
	IndexerConfig        *IndexerConfig        `json:"indexerConfig"`
	KVEventsConfig       *KVEventsConfig       `json:"kvEventsConfig"`
	// SpeculativeIndexing records each routed request's blocks on the pods
	// chosen for it (PreRequest), in tier index.TierSpeculative, so that
	// the requests that follow it on the same prefix see them before the
	// engine's KV events arrive; default false, upstream's.
	SpeculativeIndexing bool `json:"speculativeIndexing"`
	// SpeculativeTTL is how long a speculative entry lasts unless the
	// engine evicts its blocks first, a Go duration; default "2s",
	// upstream's, which zero or a negative one also means. A malformed one
	// is an error.
	SpeculativeTTL string `json:"speculativeTTL"`
	// HashAlgo is the engines' --prefix-caching-hash-algo ("sha256",
	// "sha256_cbor", "xxhash", "xxhash_cbor", "sha256_cbor_64bit");
	// default "sha256", vLLM's. The index holds the engines' own block
	// keys, and events are checked against requests' hashes.
	HashAlgo string `json:"hashAlgo"`
	// ContentKeys keys the index by content instead: blocks are re-keyed
	// from the token ids in the events, so the engines' algorithm and
	// PYTHONHASHSEED need not be known (HashAlgo must then be empty). It
	// needs events that carry token ids.
	ContentKeys bool `json:"contentKeys"`
}

// TokenProcessorConfig is how prompts are cut and hashed.
type TokenProcessorConfig struct {
	// BlockSizeTokens is the engines' --block-size; default 16.
	BlockSizeTokens int `json:"blockSizeTokens"`
	// BlockSize is the deprecated name of BlockSizeTokens, used when
	// BlockSizeTokens is 0.
	BlockSize int `json:"blockSize,omitempty"`
	// HashSeed is the engines' PYTHONHASHSEED; "" is vLLM's default for
	// the sha256 algorithms. The xxhash algorithms need it set.
	HashSeed string `json:"hashSeed"`
}

// IndexerConfig bounds the index and weighs its tiers.
type IndexerConfig struct {
	KVBlockIndexConfig *KVBlockIndexConfig `json:"kvBlockIndexConfig"`
	// BackendConfigs are the tiers' score weights (names as llm-d writes
	// them, lower-case); default gpu 1.0, cpu 0.8.
	BackendConfigs []*KVCacheBackendConfig `json:"kvCacheBackendConfigs"`
	// TokenizersPoolConfig is refused: prompts come tokenized from the
	// token-producer.
	TokenizersPoolConfig json.RawMessage `json:"tokenizersPoolConfig,omitempty"`
}

// KVBlockIndexConfig selects the index backend; kvsource's is in memory.
type KVBlockIndexConfig struct {
	InMemoryConfig *InMemoryIndexConfig `json:"inMemoryConfig"`
}

// InMemoryIndexConfig bounds the in-memory index.
type InMemoryIndexConfig struct {
	// Size bounds the index's holdings, (block, tier, pod) entries, over
	// all pods; past it the largest pod's oldest are evicted. 0 means
	// kvsource's default (index.DefaultMaxHolderBlocks).
	Size int64 `json:"size"`
	// PodCacheSize is accepted and has no effect: kvsource keeps every
	// holder of a block, memory being bounded by Size.
	PodCacheSize int `json:"podCacheSize"`
}

// KVCacheBackendConfig is one tier's score weight.
type KVCacheBackendConfig struct {
	Name   string  `json:"name"`
	Weight float64 `json:"weight"`
}

// KVEventsConfig is where KV events come from.
type KVEventsConfig struct {
	// ZMQEndpoint, when set, is bound by a SUB socket that engines connect
	// to; the topic "kv@<host:port>@<model>" names each engine's endpoint.
	ZMQEndpoint string `json:"zmqEndpoint,omitempty"`
	// TopicFilter is the subscription's topic prefix; default "kv@".
	TopicFilter string `json:"topicFilter"`
	// Concurrency is the number of goroutines applying events; default 4.
	Concurrency int `json:"concurrency"`
	// EngineType is the engines' kind, as upstream's engine adapters name
	// them: "vllm" (or empty) or "sglang". With "sglang" the index holds
	// SGLang's own page keys (hashing.SGLang) unless HashAlgo or
	// ContentKeys say otherwise, and tokenProcessorConfig.blockSizeTokens
	// must be SGLang's --page-size.
	EngineType string `json:"engineType,omitempty"`
	// DiscoverPods subscribes to each endpoint the EPP discovers (Extract);
	// default true.
	DiscoverPods       bool                `json:"discoverPods"`
	PodDiscoveryConfig *PodDiscoveryConfig `json:"podDiscoveryConfig,omitempty"`
}

// PodDiscoveryConfig is how a discovered endpoint's event sockets are found.
type PodDiscoveryConfig struct {
	// PodLabelSelector and PodNamespace are accepted for upstream's
	// configurations; endpoints come from the EPP's own discovery.
	PodLabelSelector string `json:"podLabelSelector"`
	PodNamespace     string `json:"podNamespace,omitempty"`
	// SocketPort is the engines' KV event PUB port, rank r's being
	// SocketPort+r; default 5557.
	SocketPort int `json:"socketPort"`
	// ReplaySocketPort is the engines' replay ROUTER port (rank r's
	// ReplaySocketPort+r); replay is off when it is 0 or negative.
	ReplaySocketPort int `json:"replaySocketPort,omitempty"`
}

// DefaultPrefixConfig returns the defaults the factory overlays
// parameters on: upstream's where the parameter means the same.
func DefaultPrefixConfig() PrefixConfig {
	return PrefixConfig{
		IndexerConfig: &IndexerConfig{
			KVBlockIndexConfig: &KVBlockIndexConfig{InMemoryConfig: &InMemoryIndexConfig{PodCacheSize: 10}},
			BackendConfigs:     []*KVCacheBackendConfig{{Name: "gpu", Weight: 1.0}, {Name: "cpu", Weight: 0.8}},
		},
		KVEventsConfig: &KVEventsConfig{
			TopicFilter:        "kv@",
			Concurrency:        4,
			DiscoverPods:       true,
			PodDiscoveryConfig: &PodDiscoveryConfig{SocketPort: 5557},
		},
		SpeculativeTTL: index.DefaultSpeculativeTTL.String(),
	}
}

// minSpeculativeTTL is the shortest speculativeTTL taken: the entries are
// expired every quarter TTL, and a guess that lasts less than a KV event's
// trip is no use.
const minSpeculativeTTL = time.Millisecond

// ErrConfig reports parameters the prefix or source producer refuses.
var ErrConfig = errors.New("kvplugin: bad configuration")

// PrefixProducer is the prefix producer: a data producer writing each
// candidate's PrefixCacheMatchInfo from kvsource's index, and an endpoint
// extractor subscribing to each discovered pod's KV events.
type PrefixProducer struct {
	typedName plugin.TypedName
	dk        plugin.DataKey
	dkName    string // dk.String(), the attribute endpoints carry the match under
	promptKey string
	hasher    *hashing.Hasher
	idx       *index.Index
	spec      *index.Speculative // nil without speculativeIndexing
	specTTL   time.Duration      // spec's TTL
	scorer    *picker.Picker
	sub       Subscription
	discovery *PodDiscoveryConfig
	engine    events.Engine // kvEventsConfig.engineType
	log       *slog.Logger

	// sourced is set once a source producer reads this producer: it then
	// records the speculative entries after its own decision, so that a
	// request's entries on its computing pod never count against its pull.
	sourced atomic.Bool

	mu   sync.Mutex
	pods map[types.NamespacedName]index.Holder // discovered endpoints' holders
}

var (
	_ requestcontrol.DataProducer = (*PrefixProducer)(nil)
	_ requestcontrol.PreRequest   = (*PrefixProducer)(nil)
	_ plugin.ConsumerPlugin       = (*PrefixProducer)(nil)
	_ datalayer.EndpointExtractor = (*PrefixProducer)(nil)
)

// PrefixFactory returns the prefix producer's factory; subscribe receives
// KV events when the parameters ask for them.
func PrefixFactory(subscribe SubscribeFunc) plugin.FactoryFunc {
	return func(name string, parameters *json.Decoder, handle plugin.Handle) (plugin.Plugin, error) {
		cfg := DefaultPrefixConfig()
		if parameters != nil {
			if err := parameters.Decode(&cfg); err != nil {
				return nil, fmt.Errorf("%w: %s: %w", ErrConfig, PrefixProducerType, err)
			}
		}
		if handle == nil {
			return nil, fmt.Errorf("%w: %s %q: no plugin handle", ErrConfig, PrefixProducerType, name)
		}
		p, err := NewPrefixProducer(name, cfg, nil)
		if err != nil {
			return nil, err
		}
		if m := handle.Metrics(); p.spec != nil && m != nil {
			if err := registerSpeculativeMetrics(m, name, p.spec); err != nil {
				return nil, fmt.Errorf("%s %q: registering metrics: %w", PrefixProducerType, name, err)
			}
		}
		if err := p.subscribe(handle.Context(), cfg.KVEventsConfig, subscribe); err != nil {
			return nil, err
		}
		if p.spec != nil {
			// Expiry, like the subscription, lasts as long as the EPP.
			go func() { _ = p.spec.Run(handle.Context()) }()
		}
		return p, nil
	}
}

// registerSpeculativeMetrics exports spec's counters: how many requests
// were recorded, how many entries expired (or went for the byte bound),
// and how often the engines' events met the guesses.
func registerSpeculativeMetrics(m plugin.MetricsRecorder, name string, spec *index.Speculative) error {
	labels := prometheus.Labels{"plugin": name}
	stat := func(f func(index.SpeculativeStats) float64) func() float64 {
		return func() float64 { return f(spec.Stats()) }
	}
	for _, c := range []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsource_epp_speculative_recorded_total", ConstLabels: labels,
			Help: "Scheduled requests whose blocks were recorded as speculative entries of their pods."},
			stat(func(s index.SpeculativeStats) float64 { return float64(s.Recorded) })),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsource_epp_speculative_expired_total", ConstLabels: labels,
			Help: "Speculative entries removed for their TTL or the byte bound."},
			stat(func(s index.SpeculativeStats) float64 { return float64(s.Expired) })),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsource_epp_speculative_replaced_total", ConstLabels: labels,
			Help: "Engine stores that met a pod's guessed blocks, and evictions that took guesses out."},
			stat(func(s index.SpeculativeStats) float64 { return float64(s.Replaced) })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsource_epp_speculative_entries", ConstLabels: labels,
			Help: "Speculative entries kept."},
			stat(func(s index.SpeculativeStats) float64 { return float64(s.Entries) })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsource_epp_speculative_bytes", ConstLabels: labels,
			Help: "Bytes of the speculative entries kept."},
			stat(func(s index.SpeculativeStats) float64 { return float64(s.Bytes) })),
	} {
		err := m.Register(c)
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			// A producer of the same name made again (a reloaded
			// configuration): the newest one's entries are the ones kept.
			m.Unregister(are.ExistingCollector)
			err = m.Register(c)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// NewPrefixProducer returns a prefix producer reading idx (nil: a new
// index bounded as cfg says), without a KV event subscription: the factory
// adds it, a test or embedding program feeds idx itself (through
// Speculative with speculativeIndexing, and runs its expiry).
func NewPrefixProducer(name string, cfg PrefixConfig, idx *index.Index) (*PrefixProducer, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s %q: %s", ErrConfig, PrefixProducerType, name, fmt.Sprintf(format, args...))
	}
	specTTL := index.DefaultSpeculativeTTL
	if cfg.SpeculativeTTL != "" {
		d, err := time.ParseDuration(cfg.SpeculativeTTL)
		if err != nil {
			return nil, bad("speculativeTTL %q is not a duration: %v", cfg.SpeculativeTTL, err)
		}
		if d > 0 && d < minSpeculativeTTL {
			return nil, bad("speculativeTTL %q is below %v", cfg.SpeculativeTTL, minSpeculativeTTL)
		}
		if d > 0 {
			specTTL = d
		}
	}
	tp := TokenProcessorConfig{BlockSizeTokens: hashing.DefaultBlockSize}
	if cfg.TokenProcessorConfig != nil {
		tp = *cfg.TokenProcessorConfig
		if tp.BlockSizeTokens == 0 {
			tp.BlockSizeTokens = tp.BlockSize
		}
	}
	if tp.BlockSizeTokens <= 0 {
		return nil, bad("tokenProcessorConfig.blockSizeTokens must be positive, got %d", tp.BlockSizeTokens)
	}
	engine := events.EngineVLLM
	if kv := cfg.KVEventsConfig; kv != nil {
		switch kv.EngineType {
		case "", "vllm":
		case "sglang":
			engine = events.EngineSGLang
		default:
			return nil, bad("engineType %q: want vllm or sglang, as upstream's engine adapters", kv.EngineType)
		}
	}
	hc := hashing.Config{Algo: hashing.Algo(cfg.HashAlgo), Seed: tp.HashSeed, BlockSize: tp.BlockSizeTokens}
	if engine == events.EngineSGLang && cfg.HashAlgo == "" {
		hc.Algo = hashing.SGLang
	}
	if cfg.ContentKeys {
		if cfg.HashAlgo != "" {
			return nil, bad("contentKeys replaces hashAlgo %q: set one of them", cfg.HashAlgo)
		}
		hc.Algo = hashing.Content
	} else if hc.Algo == hashing.Content {
		return nil, bad("hashAlgo %q: set contentKeys: true instead", cfg.HashAlgo)
	}
	h, err := hashing.New(hc)
	if err != nil {
		return nil, bad("%v", err)
	}
	ic := cfg.IndexerConfig
	if ic == nil {
		return nil, bad("indexerConfig is required")
	}
	if len(ic.TokenizersPoolConfig) > 0 && string(ic.TokenizersPoolConfig) != "null" {
		return nil, bad("tokenizersPoolConfig is not supported; configure a token-producer plugin instead")
	}
	var mem InMemoryIndexConfig
	if ic.KVBlockIndexConfig != nil && ic.KVBlockIndexConfig.InMemoryConfig != nil {
		mem = *ic.KVBlockIndexConfig.InMemoryConfig
	}
	if mem.Size < 0 || mem.PodCacheSize < 0 {
		return nil, bad("inMemoryConfig size and podCacheSize must not be negative")
	}
	weights := map[string]float64{}
	for _, b := range ic.BackendConfigs {
		if b == nil || b.Name == "" || b.Weight < 0 {
			return nil, bad("kvCacheBackendConfigs: every entry needs a name and a non-negative weight")
		}
		weights[tierOf(b.Name)] = b.Weight
	}
	if _, ok := weights[index.TierSpeculative]; cfg.SpeculativeIndexing && !ok {
		// Upstream weighs a tier without a configured weight 1, as the GPU
		// blocks a routed request is computing; kvsource's picker would
		// weigh it as the lowest configured tier.
		weights[index.TierSpeculative] = 1
	}
	if idx == nil {
		idx = index.New(index.Config{MaxHolderBlocks: mem.Size})
	}
	sc, err := picker.New(picker.Config{Index: idx, Hasher: h, Weights: weights})
	if err != nil {
		return nil, bad("%v", err)
	}
	p := &PrefixProducer{
		typedName: plugin.TypedName{Type: PrefixProducerType, Name: name},
		dk:        attrprefix.PrefixCacheMatchInfoDataKey.WithNonEmptyProducerName(name),
		dkName:    attrprefix.PrefixCacheMatchInfoDataKey.WithNonEmptyProducerName(name).String(),
		promptKey: PrefixProducerType + "/" + name + "/prompt",
		hasher:    h,
		idx:       idx,
		scorer:    sc,
		log:       slog.Default().With("plugin", PrefixProducerType, "name", name),
		engine:    engine,
		pods:      map[types.NamespacedName]index.Holder{},
	}
	if cfg.SpeculativeIndexing {
		p.spec, p.specTTL = index.NewSpeculative(idx, index.SpeculativeConfig{TTL: specTTL}), specTTL
	}
	if kv := cfg.KVEventsConfig; kv != nil && kv.DiscoverPods && kv.PodDiscoveryConfig != nil {
		d := *kv.PodDiscoveryConfig
		if d.SocketPort <= 0 || d.SocketPort > 65535 {
			return nil, bad("podDiscoveryConfig.socketPort %d is not a port", d.SocketPort)
		}
		p.discovery = &d
	}
	return p, nil
}

// subscribe starts the KV event subscription cfg asks for: a bound socket,
// per-pod connections as endpoints are discovered, or both.
func (p *PrefixProducer) subscribe(ctx context.Context, cfg *KVEventsConfig, subscribe SubscribeFunc) error {
	if cfg == nil || (cfg.ZMQEndpoint == "" && p.discovery == nil) {
		return nil
	}
	if subscribe == nil {
		return fmt.Errorf("%w: %s %q: kvEventsConfig asks for KV events but the plugins were registered without a subscription (kvplugin.Register(zmqevents.Subscribe))",
			ErrConfig, PrefixProducerType, p.typedName.Name)
	}
	var sink events.Sink = p.idx
	if p.spec != nil {
		sink = p.spec
	}
	sub, err := subscribe(SubscriptionConfig{
		Index: p.idx, Sink: sink, Hasher: p.hasher, Bind: cfg.ZMQEndpoint, TopicFilter: cfg.TopicFilter,
		Workers: cfg.Concurrency, Logger: p.log, Engine: p.engine,
	})
	if err != nil {
		return fmt.Errorf("%s %q: %w", PrefixProducerType, p.typedName.Name, err)
	}
	p.sub = sub
	// The subscription lives as long as the EPP: the handle's context, not
	// a request's.
	go func() {
		if err := sub.Run(ctx); err != nil {
			p.log.Error("kvsource: KV event subscription stopped", "err", err)
		}
	}()
	return nil
}

// source is the picker's Config.Sources: the subscription's, or, when the
// index is fed otherwise, every holder.
func (p *PrefixProducer) source(h index.Holder) (string, bool) {
	if p.sub == nil {
		return events.StateLive, true
	}
	return p.sub.Source(h)
}

// TypedName implements plugin.Plugin.
func (p *PrefixProducer) TypedName() plugin.TypedName { return p.typedName }

// Index returns the index the producer reads.
func (p *PrefixProducer) Index() *index.Index { return p.idx }

// Speculative returns the producer's speculative entries, nil without
// speculativeIndexing: the Sink its index is fed through, whose Run
// expires them.
func (p *PrefixProducer) Speculative() *index.Speculative { return p.spec }

// Hasher returns the hasher requests are keyed with.
func (p *PrefixProducer) Hasher() *hashing.Hasher { return p.hasher }

// Produces implements plugin.ProducerPlugin: PrefixCacheMatchInfo, bound to
// the instance's name.
func (p *PrefixProducer) Produces() map[plugin.DataKey]any {
	return map[plugin.DataKey]any{p.dk: attrprefix.PrefixCacheMatchInfo{}}
}

// Consumes implements plugin.ConsumerPlugin: the token producer's prompt.
func (p *PrefixProducer) Consumes() plugin.DataDependencies {
	return plugin.DataDependencies{
		Required: map[plugin.DataKey]any{tokenproducer.TokenizedPromptDataKey: scheduling.TokenizedPrompt{}},
	}
}

// prompt is a single-prompt request's block keys, stashed on the request for
// the source producer, with the candidates they were scored for and their
// holders, which the source producer reuses when it sees the same ones.
type prompt struct {
	model   string
	keys    []uint64
	metas   []*datalayer.EndpointMetadata // per endpoint
	holders []index.Holder                // per endpoint; zero for one without metadata
	// speculated is set once the keys are recorded as speculative, so a
	// request is recorded once however many PreRequest hooks run.
	speculated atomic.Bool
}

// holderAt returns the holder of endpoint i of a list the source producer
// sees, reusing the one computed here when it is the same endpoint.
func (pr *prompt) holderAt(i int, md *datalayer.EndpointMetadata) index.Holder {
	if i < len(pr.metas) && pr.metas[i] == md {
		return pr.holders[i]
	}
	return holderOf(md)
}

// Produce implements requestcontrol.DataProducer: it hashes the request's
// prompts and writes every candidate endpoint's match. A request without
// token ids is left alone.
func (p *PrefixProducer) Produce(_ context.Context, request *scheduling.InferenceRequest, endpoints []scheduling.Endpoint) error {
	if request == nil || request.Body == nil || request.Body.TokenizedPrompt == nil {
		return nil
	}
	tp := request.Body.TokenizedPrompt
	// One accumulator per endpoint with metadata, found by holder.
	cands := make([]picker.Candidate, 0, len(endpoints))
	accs := make([]match, len(endpoints))
	slot := make(map[index.Holder]int, len(endpoints))
	holders := make([]index.Holder, len(endpoints))
	metas := make([]*datalayer.EndpointMetadata, len(endpoints))
	for i, ep := range endpoints {
		if md := ep.GetMetadata(); md != nil {
			h := holderOf(md)
			cands = append(cands, picker.Candidate{Holder: h})
			slot[h] = i
			holders[i], metas[i] = h, md
		}
	}
	total := 0
	var single *prompt
	sp := scoresPool.Get().(*[]picker.Score)
	defer scoresPool.Put(sp)
	for i, tokens := range tp.PerPromptTokens {
		hr := hashing.Request{Tokens: tokens, CacheSalt: tp.CacheSalt}
		if len(tp.PerPromptTokens) == 1 {
			for _, f := range tp.MultiModalFeatures {
				hr.MM = append(hr.MM, hashing.MMItem{ID: f.Hash, Offset: f.Offset, Length: f.Length})
			}
		}
		keys, err := p.hasher.BlockKeys(nil, hr)
		if err != nil {
			return fmt.Errorf("%s: request %s prompt %d: %w", p.typedName, request.RequestID, i, err)
		}
		if len(keys) == 0 {
			continue
		}
		total += len(keys)
		*sp, err = p.scorer.Score(picker.Request{Model: request.TargetModel, Keys: keys, Candidates: cands}, *sp)
		if errors.Is(err, picker.ErrUnknownModel) {
			// As for a cold prompt: every endpoint gets an empty match.
			*sp, err = (*sp)[:0], nil
		}
		if err != nil {
			return fmt.Errorf("%s: request %s: %w", p.typedName, request.RequestID, err)
		}
		for j := range *sp {
			s := &(*sp)[j]
			if k, ok := slot[s.Holder]; ok {
				accs[k].add(s)
			}
		}
		if len(tp.PerPromptTokens) == 1 {
			single = &prompt{model: request.TargetModel, keys: keys, metas: metas, holders: holders}
		}
	}
	if total == 0 {
		return nil
	}
	bs := p.hasher.Config().BlockSize
	for i, ep := range endpoints {
		if ep.GetMetadata() == nil {
			continue
		}
		a := &accs[i]
		if a.byTier == nil {
			a.byTier = map[string]int{}
		}
		ep.Put(p.dkName, attrprefix.NewPrefixCacheMatchInfo(int(a.score), total, bs).
			WithCachedBlockCount(a.blocks).
			WithCachedBlocksByTier(a.byTier))
	}
	if single != nil {
		request.PutAttribute(p.promptKey, single)
	}
	return nil
}

// scoresPool recycles Score's result slices, and their Tiers, across
// requests.
var scoresPool = sync.Pool{New: func() any { return new([]picker.Score) }}

// match sums one endpoint's match over a request's prompts.
type match struct {
	score  float64
	blocks int
	byTier map[string]int // owned by the PrefixCacheMatchInfo it ends in
}

func (a *match) add(s *picker.Score) {
	a.score += s.Score
	a.blocks += s.Blocks
	for _, t := range s.Tiers {
		if t.Blocks == 0 {
			continue
		}
		if a.byTier == nil {
			a.byTier = make(map[string]int, len(s.Tiers))
		}
		a.byTier[lowerTier(t.Tier)] += t.Blocks
	}
}

// tierOf is the index tier of a tier name as llm-d writes it: vLLM's
// upper-case, the speculative tier as the index names it.
func tierOf(name string) string {
	if t := strings.ToUpper(name); t != strings.ToUpper(index.TierSpeculative) {
		return t
	}
	return index.TierSpeculative
}

// lowerTier is a tier's name as llm-d writes it, without allocating for
// vLLM's two.
func lowerTier(t string) string {
	switch t {
	case index.TierGPU:
		return "gpu"
	case index.TierCPU:
		return "cpu"
	}
	return strings.ToLower(t)
}

// promptOf returns the keys Produce stashed on a single-prompt request.
func (p *PrefixProducer) promptOf(request *scheduling.InferenceRequest) (*prompt, bool) {
	return scheduling.ReadRequestAttribute[*prompt](request, p.promptKey)
}

// PreRequest implements requestcontrol.PreRequest: with speculativeIndexing,
// the request's block keys become speculative entries of the primary
// profile's first target and, under P/D, of profile "prefill"'s (upstream's
// fixed name). When a source producer reads this producer, it records them
// instead, after its pull decision. It never fails the request.
func (p *PrefixProducer) PreRequest(_ context.Context, request *scheduling.InferenceRequest, res *scheduling.SchedulingResult) error {
	if !p.sourced.Load() {
		p.speculate(request, res)
	}
	return nil
}

// speculate records a scheduled request's keys as speculative blocks of
// the pods chosen for it, once per request.
func (p *PrefixProducer) speculate(request *scheduling.InferenceRequest, res *scheduling.SchedulingResult) {
	if p.spec == nil || request == nil || res == nil {
		return
	}
	pr, ok := p.promptOf(request)
	if !ok || !pr.speculated.CompareAndSwap(false, true) {
		return
	}
	var done index.Holder
	for i, profile := range [2]string{res.PrimaryProfileName, defaultPrefillProfile} {
		r := res.ProfileResults[profile]
		if r == nil || len(r.TargetEndpoints) == 0 || r.TargetEndpoints[0] == nil {
			continue
		}
		md := r.TargetEndpoints[0].GetMetadata()
		if md == nil {
			continue
		}
		h := holderOf(md)
		if i == 1 && h == done {
			continue
		}
		p.spec.Record(pr.model, h, pr.keys)
		done = h
	}
}

// Extract implements datalayer.EndpointExtractor: a discovered endpoint's
// KV event socket is subscribed to, a deleted endpoint's unsubscribed and
// its cache forgotten. Without pod discovery it does nothing.
func (p *PrefixProducer) Extract(_ context.Context, event datalayer.EndpointEvent) error {
	if p.discovery == nil || p.sub == nil || event.Endpoint == nil {
		return nil
	}
	md := event.Endpoint.GetMetadata()
	if md == nil || md.ID.Name == "" {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	old, known := p.pods[md.ID]
	switch event.Type {
	case datalayer.EventAddOrUpdate:
		if md.Address == "" {
			return nil
		}
		h := holderOf(md)
		if known && old != h {
			p.forget(md.ID, old)
		}
		rank := md.GetRankIndex()
		pub := "tcp://" + net.JoinHostPort(md.Address, strconv.Itoa(p.discovery.SocketPort+rank))
		replay := ""
		if p.discovery.ReplaySocketPort > 0 {
			replay = "tcp://" + net.JoinHostPort(md.Address, strconv.Itoa(p.discovery.ReplaySocketPort+rank))
		}
		if err := p.sub.AddPod(h.Pod, pub, replay); err != nil {
			return fmt.Errorf("%s: subscribe to %s at %s: %w", p.typedName, md.ID, pub, err)
		}
		p.pods[md.ID] = h
	case datalayer.EventDelete:
		h := old
		if !known {
			if md.Address == "" {
				return nil
			}
			h = holderOf(md)
		}
		p.forget(md.ID, h)
	}
	return nil
}

// forget unsubscribes from an endpoint and drops its cache from the index.
func (p *PrefixProducer) forget(id types.NamespacedName, h index.Holder) {
	p.sub.RemovePod(h.Pod)
	p.idx.RemoveHolder(h)
	delete(p.pods, id)
}

// holderOf is the index holder of an endpoint: the engine serving on
// host:port, IPv6 hosts bracketed, and its data-parallel rank, which is the
// endpoint's rank index (vLLM reports the rank in its events, and offsets a
// rank's event port by it as the EPP offsets its serving port).
func holderOf(md *datalayer.EndpointMetadata) index.Holder {
	return index.Holder{Pod: net.JoinHostPort(md.Address, md.Port), Rank: md.GetRankIndex()}
}

// hostPort is the address the source header names an endpoint by.
func hostPort(md *datalayer.EndpointMetadata) string { return net.JoinHostPort(md.Address, md.Port) }
