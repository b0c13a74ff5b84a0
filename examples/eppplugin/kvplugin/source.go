package kvplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/common/routing"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requestcontrol"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	attrprefix "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/datalayer/attribute/prefix"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/picker/kvhints"
	"github.com/kvsource/kvsource/transfer"
)

// SourceConfig is the source producer's parameters: upstream
// p2p-source-producer's, plus kvsource's own (PullTiers, InflightTTL,
// Calibration).
type SourceConfig struct {
	// PrefixMatchInfoProducerName names the kvsource prefix producer whose
	// index the decision reads; "" means one named like its type,
	// kvsource-prefix-cache-producer.
	PrefixMatchInfoProducerName string `json:"prefixMatchInfoProducerName,omitempty" pluginRef:"prefixMatchInfoProducerName"`
	// MinCachedTokenDelta is the fewest tokens a pull must add to the
	// computing pod's own prefix; default 1, at least 1.
	MinCachedTokenDelta int `json:"minCachedTokenDelta,omitempty"`
	// PrefillProfileName is the P/D prefill profile, whose target computes
	// the prompt when it has one; default "prefill".
	PrefillProfileName string `json:"prefillProfileName,omitempty"`
	// PullTiers are the tiers a source serves pulls from; default ["cpu"],
	// where vLLM's P2P tier reads.
	PullTiers []string `json:"pullTiers,omitempty"`
	// InflightTTL is how long a pull counts against its source when its
	// response never ends; default 30s.
	InflightTTL string `json:"inflightTTL,omitempty"`
	// Calibration, when set, also requires each pull's predicted saving,
	// from a model fitted to these measurements, to exceed MinSavingMillis.
	Calibration *CalibrationConfig `json:"calibration,omitempty"`
	// KVHints, when set, also attaches a KV hint for vLLM's KVCR tier to
	// each pull whose source and computing endpoint have KVCR endpoints.
	KVHints *KVHintsConfig `json:"kvHints,omitempty"`
}

// KVHintsConfig is the source producer's KV hints (package kvhints): the
// pull's kv.fetch hint, as a JSON merge patch (RFC 7386) of the request
// body in the x-kvsource-kv-hint header, beside the source header, for
// the hop that forwards the body to vLLM to apply.
type KVHintsConfig struct {
	// Placement is where the patch puts the hint: kv_hint
	// (kv_transfer_params.kv_hint, the default), kv_hints (top level) or
	// router_hint (Dynamo's legacy kv_transfer_params.router_hint).
	Placement string `json:"placement,omitempty"`
	// Endpoints are the endpoints' KVCR control endpoints.
	Endpoints []KVCREndpointConfig `json:"endpoints"`
}

// KVCREndpointConfig is one EPP endpoint's KVCR control endpoints: listed,
// or read from its vLLM --kv-transfer-config.
type KVCREndpointConfig struct {
	// Endpoint is the EPP endpoint, host:port as its metadata gives it.
	Endpoint string `json:"endpoint"`
	// ControlEndpoints are tcp://host:port, the k-th for data-parallel rank
	// DPStartRank+k.
	ControlEndpoints []string `json:"controlEndpoints,omitempty"`
	// KVTransferConfig is the pod's --kv-transfer-config, instead.
	KVTransferConfig json.RawMessage `json:"kvTransferConfig,omitempty"`
	// WorkerType is aggregated (default), prefill or decode.
	WorkerType  string `json:"workerType,omitempty"`
	DPStartRank int    `json:"dpStartRank,omitempty"`
}

// KVHintHeader carries a pull's KV hint as a JSON merge patch of the
// request body.
const KVHintHeader = "x-kvsource-kv-hint"

// hinter returns the KV hints of cfg, nil when cfg is.
func (cfg *KVHintsConfig) hinter(contentKeys bool) (*kvhints.Hinter, kvhints.Placement, error) {
	if cfg == nil {
		return nil, "", nil
	}
	p, err := kvhints.ParsePlacement(cfg.Placement)
	if err != nil {
		return nil, "", err
	}
	var eps kvhints.Endpoints
	for _, e := range cfg.Endpoints {
		wt, err := kvhints.ParseWorkerType(e.WorkerType)
		if err != nil {
			return nil, "", fmt.Errorf("endpoint %s: %w", e.Endpoint, err)
		}
		var list []kvhints.Endpoint
		switch {
		case e.Endpoint == "":
			return nil, "", errors.New("a KVCR endpoint entry without endpoint")
		case (len(e.ControlEndpoints) > 0) == (len(e.KVTransferConfig) > 0):
			return nil, "", fmt.Errorf("endpoint %s: give one of controlEndpoints and kvTransferConfig", e.Endpoint)
		case len(e.KVTransferConfig) > 0:
			if list, err = kvhints.FromKVTransferConfig(e.Endpoint, e.DPStartRank, wt, e.KVTransferConfig); err != nil {
				return nil, "", err
			}
		default:
			for k, a := range e.ControlEndpoints {
				list = append(list, kvhints.Endpoint{Holder: index.Holder{Pod: e.Endpoint, Rank: e.DPStartRank + k}, Address: a, WorkerType: wt})
			}
		}
		for _, ep := range list {
			if err := eps.Add(ep); err != nil {
				return nil, "", err
			}
		}
	}
	return kvhints.New(kvhints.Config{Endpoints: &eps, ContentKeys: contentKeys}), p, nil
}

// CalibrationConfig is measured recompute and pull times, the format of
// `kvsource serve --calibration`, and the saving a pull must beat.
type CalibrationConfig struct {
	Recompute []transfer.Sample `json:"recompute"`
	Pull      []transfer.Sample `json:"pull"`
	// Margin is the fraction by which a pull must be predicted faster for
	// the recommended threshold that is logged; default picker.DefaultMargin.
	Margin *float64 `json:"margin,omitempty"`
	// MinSavingMillis is the smallest predicted saving worth a pull.
	MinSavingMillis float64 `json:"minSavingMillis,omitempty"`
}

// defaultPrefillProfile is upstream's default prefill profile name.
const defaultPrefillProfile = "prefill"

// SourceConfigParser parses the source producer's parameters with their
// defaults applied; the EPP's loader reads its pluginRef field to create
// the prefix producer first.
func SourceConfigParser(parameters *json.Decoder, _ plugin.Handle) (any, error) {
	cfg, err := parseSourceConfig(parameters)
	if err != nil {
		return nil, err
	}
	return &cfg, nil
}

func parseSourceConfig(parameters *json.Decoder) (SourceConfig, error) {
	cfg := SourceConfig{MinCachedTokenDelta: picker.DefaultMinCachedTokenDelta}
	if parameters != nil {
		if err := parameters.Decode(&cfg); err != nil {
			return cfg, fmt.Errorf("%w: %s: %w", ErrConfig, SourceProducerType, err)
		}
	}
	if cfg.PrefixMatchInfoProducerName == "" {
		cfg.PrefixMatchInfoProducerName = PrefixProducerType
	}
	if cfg.PrefillProfileName == "" {
		cfg.PrefillProfileName = defaultPrefillProfile
	}
	if cfg.MinCachedTokenDelta < 1 {
		return cfg, fmt.Errorf("%w: %s: minCachedTokenDelta must be >= 1, got %d", ErrConfig, SourceProducerType, cfg.MinCachedTokenDelta)
	}
	return cfg, nil
}

// SourceFactory is the source producer's factory: it finds the prefix
// producer the parameters name among the handle's plugins.
func SourceFactory(name string, parameters *json.Decoder, handle plugin.Handle) (plugin.Plugin, error) {
	cfg, err := parseSourceConfig(parameters)
	if err != nil {
		return nil, err
	}
	if handle == nil {
		return nil, fmt.Errorf("%w: %s %q: no plugin handle", ErrConfig, SourceProducerType, name)
	}
	prefix, err := plugin.PluginByType[*PrefixProducer](handle, cfg.PrefixMatchInfoProducerName)
	if err != nil {
		return nil, fmt.Errorf("%w: %s %q reads a %s: %w", ErrConfig, SourceProducerType, name, PrefixProducerType, err)
	}
	return NewSourceProducer(name, cfg, prefix, handle.Metrics())
}

// SourceProducer is the source producer: a data producer recording the
// candidates and their load, a PreRequest plugin deciding the computing
// pod's pull with kvsource's picker and naming its source in the
// x-kv-cache-source-host-port header, and a response body hook releasing
// the pull's in-flight count.
type SourceProducer struct {
	typedName plugin.TypedName
	prefix    *PrefixProducer
	consumes  plugin.DataKey
	prefill   string
	pick      *picker.Picker
	hints     *kvhints.Hinter // nil without kvHints
	placement kvhints.Placement
	stashKey  string
	pullKey   string
	decisions *prometheus.CounterVec
	log       *slog.Logger
}

var (
	_ requestcontrol.DataProducer          = (*SourceProducer)(nil)
	_ requestcontrol.PreRequest            = (*SourceProducer)(nil)
	_ requestcontrol.ResponseBodyProcessor = (*SourceProducer)(nil)
	_ plugin.ConsumerPlugin                = (*SourceProducer)(nil)
)

// Outcomes the decisions counter counts besides the picker's reasons.
const (
	outcomeNoPrompt    = "no_prompt"    // no single tokenized prompt
	outcomeNoComputing = "no_computing" // no computing endpoint in the result
	outcomeError       = "error"        // the picker refused the request
)

// NewSourceProducer returns a source producer deciding on prefix's index.
// metrics (may be nil) receives the decisions counter.
func NewSourceProducer(name string, cfg SourceConfig, prefix *PrefixProducer, metrics plugin.MetricsRecorder) (*SourceProducer, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s %q: %s", ErrConfig, SourceProducerType, name, fmt.Sprintf(format, args...))
	}
	if prefix == nil {
		return nil, bad("no prefix producer")
	}
	if cfg.MinCachedTokenDelta < 1 {
		return nil, bad("minCachedTokenDelta must be >= 1, got %d", cfg.MinCachedTokenDelta)
	}
	pc := picker.Config{
		Index: prefix.Index(), Hasher: prefix.Hasher(), MinCachedTokenDelta: cfg.MinCachedTokenDelta,
		Sources: prefix.source,
	}
	for _, t := range cfg.PullTiers {
		if t == "" {
			return nil, bad("pullTiers: empty tier")
		}
		if tierOf(t) == index.TierSpeculative {
			return nil, bad("pullTiers: speculative blocks do not exist yet and serve no pull")
		}
		pc.PullTiers = append(pc.PullTiers, strings.ToUpper(t))
	}
	if cfg.InflightTTL != "" {
		d, err := time.ParseDuration(cfg.InflightTTL)
		if err != nil || d <= 0 {
			return nil, bad("inflightTTL %q is not a positive duration", cfg.InflightTTL)
		}
		pc.InflightTTL = d
	}
	log := slog.Default().With("plugin", SourceProducerType, "name", name)
	if c := cfg.Calibration; c != nil {
		margin := picker.DefaultMargin
		if c.Margin != nil {
			margin = *c.Margin
		}
		cal, err := picker.Fit(c.Recompute, c.Pull, margin)
		if err != nil {
			return nil, bad("calibration: %v", err)
		}
		pc.Cost, pc.MinSavingMillis = &cal.Model, c.MinSavingMillis
		log.Info("kvsource: pulls decided by predicted saving", "crossover_tokens", cal.Crossover,
			"recommended_min_cached_token_delta", cal.Threshold)
	}
	pk, err := picker.New(pc)
	if err != nil {
		return nil, bad("%v", err)
	}
	hints, placement, err := cfg.KVHints.hinter(prefix.Hasher().Config().Algo == hashing.Content)
	if err != nil {
		return nil, bad("kvHints: %v", err)
	}
	prefill := cfg.PrefillProfileName
	if prefill == "" {
		prefill = defaultPrefillProfile
	}
	p := &SourceProducer{
		typedName: plugin.TypedName{Type: SourceProducerType, Name: name},
		prefix:    prefix,
		consumes:  attrprefix.PrefixCacheMatchInfoDataKey.WithNonEmptyProducerName(prefix.TypedName().Name),
		prefill:   prefill,
		pick:      pk,
		hints:     hints,
		placement: placement,
		stashKey:  SourceProducerType + "/" + name + "/candidates",
		pullKey:   SourceProducerType + "/" + name + "/pull",
		log:       log,
	}
	p.decisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name:        "kvsource_epp_source_decisions_total",
		Help:        "Source producer decisions by outcome: a picker reason (pull, local_hit, self, no_holder, below_threshold) or no_prompt, no_computing, error.",
		ConstLabels: prometheus.Labels{"plugin": name},
	}, []string{"outcome"})
	if metrics != nil {
		if err := metrics.Register(p.decisions); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return nil, fmt.Errorf("%s %q: registering metrics: %w", SourceProducerType, name, err)
			}
			p.decisions = are.ExistingCollector.(*prometheus.CounterVec)
		}
	}
	// Only a source producer that exists takes the recording over.
	prefix.sourced.Store(true)
	return p, nil
}

// TypedName implements plugin.Plugin.
func (p *SourceProducer) TypedName() plugin.TypedName { return p.typedName }

// Produces implements plugin.ProducerPlugin: nothing other plugins read.
func (p *SourceProducer) Produces() map[plugin.DataKey]any { return map[plugin.DataKey]any{} }

// Consumes implements plugin.ConsumerPlugin: the prefix producer's match,
// which orders this producer after it.
func (p *SourceProducer) Consumes() plugin.DataDependencies {
	return plugin.DataDependencies{Required: map[plugin.DataKey]any{p.consumes: attrprefix.PrefixCacheMatchInfo{}}}
}

// stash is what Produce leaves for PreRequest: the prompt and the candidate
// sources with their load. A holder's Pod is the endpoint's host:port.
type stash struct {
	prompt *prompt
	cands  []picker.Candidate
}

// Produce implements requestcontrol.DataProducer: it records the candidate
// endpoints with metadata as possible sources, with their waiting queues.
func (p *SourceProducer) Produce(_ context.Context, request *scheduling.InferenceRequest, endpoints []scheduling.Endpoint) error {
	pr, ok := p.prefix.promptOf(request)
	if !ok {
		return nil
	}
	st := &stash{prompt: pr, cands: make([]picker.Candidate, 0, len(endpoints))}
	for i, ep := range endpoints {
		md := ep.GetMetadata()
		if md == nil {
			continue
		}
		waiting := 0
		if m := ep.GetMetrics(); m != nil {
			waiting = m.WaitingQueueSize
		}
		st.cands = append(st.cands, picker.Candidate{Holder: pr.holderAt(i, md), Waiting: waiting})
	}
	// No candidates would let the picker consider every holder it knows,
	// endpoints of this request or not.
	if len(st.cands) > 0 {
		request.PutAttribute(p.stashKey, st)
	}
	return nil
}

// computing returns the endpoint that computes the prompt: the prefill
// profile's first target under P/D, else the primary profile's.
func (p *SourceProducer) computing(res *scheduling.SchedulingResult) scheduling.Endpoint {
	if res == nil {
		return nil
	}
	r := res.ProfileResults[res.PrimaryProfileName]
	if pr := res.ProfileResults[p.prefill]; pr != nil && len(pr.TargetEndpoints) > 0 {
		r = pr
	}
	if r == nil || len(r.TargetEndpoints) == 0 {
		return nil
	}
	return r.TargetEndpoints[0]
}

// PreRequest implements requestcontrol.PreRequest: it removes any inbound
// source header, asks the picker whether the computing endpoint should pull
// its missing prefix and from which candidate, and names that candidate in
// the header. It never fails the request: without a decision the prompt is
// computed, as without the plugin.
func (p *SourceProducer) PreRequest(ctx context.Context, request *scheduling.InferenceRequest, res *scheduling.SchedulingResult) error {
	// The request's own speculative entries, recorded after the decision,
	// must not make its computing pod look as if it held the prompt.
	defer p.prefix.speculate(request, res)
	delete(request.Headers, routing.KVCacheSourceHeader)
	delete(request.Headers, KVHintHeader)
	// A request scheduled again gives its earlier pull back.
	if old, ok := scheduling.ReadRequestAttribute[*inflight](request, p.pullKey); ok {
		old.release()
	}
	st, ok := scheduling.ReadRequestAttribute[*stash](request, p.stashKey)
	if !ok {
		p.decisions.WithLabelValues(outcomeNoPrompt).Inc()
		return nil
	}
	ep := p.computing(res)
	if ep == nil || ep.GetMetadata() == nil {
		p.decisions.WithLabelValues(outcomeNoComputing).Inc()
		return nil
	}
	md := ep.GetMetadata()
	d, err := p.pick.Pick(picker.Request{
		ID: request.RequestID, Model: st.prompt.model, Keys: st.prompt.keys,
		Destination: holderOf(md), Candidates: st.cands,
	})
	if err != nil {
		p.decisions.WithLabelValues(outcomeError).Inc()
		p.log.Warn("kvsource: no pull decision", "request", request.RequestID, "err", err)
		return nil
	}
	p.decisions.WithLabelValues(string(d.Reason)).Inc()
	if p.log.Enabled(ctx, slog.LevelDebug) {
		p.log.Debug("kvsource: pull decision", "request", request.RequestID, "computing", hostPort(md),
			"reason", d.Reason, "source", d.Source.String(), "cached_blocks", d.Cached, "pull_blocks", d.Gain)
	}
	if d.Reason != picker.ReasonPull {
		return nil
	}
	// Sources are among the candidates: the source's Pod is its endpoint's
	// host:port, net.JoinHostPort(Address, Port).
	addr := d.Source.Pod
	if request.Headers == nil {
		request.Headers = map[string]string{}
	}
	request.Headers[routing.KVCacheSourceHeader] = addr
	request.PutAttribute(p.pullKey, &inflight{d: &d})
	if p.hints != nil {
		p.attachHint(request, &d, st.prompt.keys)
	}
	return nil
}

// attachHint sets the pull's KV hint header, when the decision is eligible
// for one; a failure leaves the pull to the source header alone.
func (p *SourceProducer) attachHint(request *scheduling.InferenceRequest, d *picker.Decision, keys []uint64) {
	if request.RequestID == "" {
		// The envelope's message_id must not be empty; the EPP names
		// every request it schedules.
		return
	}
	h, reason, err := p.hints.Hint(d, keys, request.RequestID)
	if err == nil && reason == kvhints.ReasonHinted {
		var patch []byte
		if patch, err = kvhints.MergeIntoBody(nil, nil, &h, p.placement); err == nil {
			request.Headers[KVHintHeader] = string(patch)
			return
		}
	}
	if err != nil {
		p.log.Warn("kvsource: no KV hint", "request", request.RequestID, "err", err)
		return
	}
	p.log.Debug("kvsource: no KV hint", "request", request.RequestID, "reason", reason)
}

// ResponseBody implements requestcontrol.ResponseBodyProcessor: the last
// call of a response, ended or aborted (the director calls it with
// EndOfStream for a scheduled request that never completed), releases the
// request's pull, so its source no longer counts it in flight.
func (p *SourceProducer) ResponseBody(_ context.Context, request *scheduling.InferenceRequest, response *requestcontrol.Response, _ *datalayer.EndpointMetadata) {
	if response == nil || !response.EndOfStream || request == nil {
		return
	}
	if f, ok := scheduling.ReadRequestAttribute[*inflight](request, p.pullKey); ok {
		f.release()
	}
}

// Inflight returns how many pulls from the endpoint serving on host:port
// with rank are in flight: directed and not released or expired.
func (p *SourceProducer) Inflight(md *datalayer.EndpointMetadata) int {
	return p.pick.Inflight(holderOf(md))
}

// inflight is a pull whose response has not ended.
type inflight struct {
	d    *picker.Decision
	done atomic.Bool
}

// release marks the pull done once, however often the hooks run.
func (f *inflight) release() {
	if f != nil && f.done.CompareAndSwap(false, true) {
		f.d.Done()
	}
}
