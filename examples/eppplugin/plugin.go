package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// PluginType is the plugin's type name in an EPP configuration.
const PluginType = "kvsource"

// PrefixMatchKey names the PrefixMatch the data producer attaches to every
// candidate endpoint.
const PrefixMatchKey DataKey = "kvsource.prefix-match"

// PrefixMatch is how much of a request's prompt an endpoint holds.
type PrefixMatch struct {
	PromptBlocks int     // full blocks of the prompt
	BlockSize    int     // tokens per block
	Blocks       int     // consecutive prefix held in any tier
	GPU, CPU     int     // consecutive prefix held in each tier alone
	Score        float64 // the picker's tier-weighted score (GPU 1.0, CPU 0.8 a block)
}

// Clone implements Cloneable.
func (m *PrefixMatch) Clone() Cloneable { c := *m; return &c }

// ErrNoTokens reports a request without token ids: block hashes can only be
// computed from the tokens the engine sees.
var ErrNoTokens = errors.New("kvsource: request has no token ids")

// Config configures the plugin.
type Config struct {
	// Name is the plugin instance's name.
	Name string
	// Hashing is the engines' block hashing configuration (algorithm, seed,
	// block size); the zero value is vLLM's default.
	Hashing hashing.Config
	// Events configures the KV event subscriber feeding the plugin's index
	// (its Events.Sink and Events.Hasher are set by the plugin). Engines'
	// topics must name each pod by the "address:port" of its endpoint. Nil:
	// the caller feeds Index (for instance through an events.Processor on
	// a transport of its own).
	Events *zmq.SubscriberConfig
	// Index is the index to read; nil creates one.
	Index *index.Index
	// MinCachedTokenDelta is the smallest pull worth making, in tokens;
	// 0 means the picker's default (one block).
	MinCachedTokenDelta int
	// PrefillProfile names the scheduler profile whose target computes the
	// prefill in a P/D deployment; default "prefill". Without it the
	// primary profile's target computes.
	PrefillProfile string
	// P2PPort is the engines' P2P side-channel port for kv_transfer_params;
	// 0 means the picker's default.
	P2PPort int
	// StateTTL bounds how long a request's state waits for the end of its
	// response (a request the EPP drops never gets there); older state is
	// swept and its pull released. Default 10 minutes.
	StateTTL time.Duration
	// Now is the clock StateTTL is measured by; default time.Now.
	Now    func() time.Time
	Logger *slog.Logger
}

// KVSource is an EPP plugin around kvsource's index and picker. As a data
// producer it hashes the prompt once and attaches each endpoint's cached
// prefix (PrefixMatch); as a scorer it turns that into an affinity score;
// after scheduling (PreRequest) it asks the picker whether the chosen
// endpoint should pull the prefix from a peer and, if so, sets llm-d's
// x-kv-cache-source-host-port header and vLLM's kv_transfer_params; when the
// response ends it releases the pull's in-flight count.
type KVSource struct {
	name    string
	hasher  *hashing.Hasher
	idx     *index.Index
	sub     *zmq.Subscriber
	pick    *picker.Picker
	prefill string
	log     *slog.Logger

	reqs     sync.Map // request id -> *requestState
	stateTTL time.Duration
	now      func() time.Time
	admitted atomic.Uint64
}

// sweepEvery is how many requests pass between two sweeps of stale state.
const sweepEvery = 1024

// requestState carries a request from the data producer to the response.
type requestState struct {
	created    time.Time
	model      string
	keys       []uint64
	candidates []picker.Candidate
	decision   *picker.Decision
}

var (
	_ PrepareDataPlugin = (*KVSource)(nil)
	_ Scorer            = (*KVSource)(nil)
	_ PreRequest        = (*KVSource)(nil)
	_ ResponseBody      = (*KVSource)(nil)
)

// New returns the plugin.
func New(cfg Config) (*KVSource, error) {
	h, err := hashing.New(cfg.Hashing)
	if err != nil {
		return nil, err
	}
	idx := cfg.Index
	if idx == nil {
		idx = index.New(index.Config{})
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	p := &KVSource{name: cfg.Name, hasher: h, idx: idx, prefill: cfg.PrefillProfile, log: log, stateTTL: cfg.StateTTL, now: cfg.Now}
	if p.stateTTL <= 0 {
		p.stateTTL = 10 * time.Minute
	}
	if p.now == nil {
		p.now = time.Now
	}
	if p.prefill == "" {
		p.prefill = "prefill"
	}
	if cfg.Events != nil {
		ec := *cfg.Events
		ec.Events.Sink = idx
		ec.Events.Hasher = h
		if ec.Events.Logger == nil {
			ec.Events.Logger = log
		}
		if p.sub, err = zmq.NewSubscriber(ec); err != nil {
			return nil, err
		}
	}
	p.pick, err = picker.New(picker.Config{Index: idx, Hasher: h, MinCachedTokenDelta: cfg.MinCachedTokenDelta, P2PPort: cfg.P2PPort})
	if err != nil {
		return nil, err
	}
	return p, nil
}

// Run runs the KV event subscriber until ctx ends (a no-op without one).
func (p *KVSource) Run(ctx context.Context) error {
	if p.sub == nil {
		<-ctx.Done()
		return nil
	}
	return p.sub.Run(ctx)
}

// Subscriber returns the plugin's subscriber, nil without one.
func (p *KVSource) Subscriber() *zmq.Subscriber { return p.sub }

// Index returns the plugin's index.
func (p *KVSource) Index() *index.Index { return p.idx }

// Picker returns the plugin's picker.
func (p *KVSource) Picker() *picker.Picker { return p.pick }

// TypedName implements Plugin.
func (p *KVSource) TypedName() TypedName { return TypedName{Type: PluginType, Name: p.name} }

// Produces implements PrepareDataPlugin.
func (p *KVSource) Produces() map[DataKey]any { return map[DataKey]any{PrefixMatchKey: PrefixMatch{}} }

// Consumes implements PrepareDataPlugin: the plugin needs only the request's
// token ids.
func (p *KVSource) Consumes() map[DataKey]any { return nil }

func holderOf(e Endpoint) index.Holder { return index.Holder{Pod: e.GetMetadata().HostPort()} }

// PrepareRequestData hashes the prompt and attaches every endpoint's
// PrefixMatch.
func (p *KVSource) PrepareRequestData(_ context.Context, req *InferenceRequest, endpoints []Endpoint) error {
	if len(req.TokenIDs) == 0 {
		return fmt.Errorf("%w: request %s", ErrNoTokens, req.RequestID)
	}
	salt, _ := req.Body["cache_salt"].(string)
	keys, err := p.hasher.BlockKeys(nil, hashing.Request{Tokens: req.TokenIDs, CacheSalt: salt})
	if err != nil {
		return fmt.Errorf("kvsource: request %s: %w", req.RequestID, err)
	}
	st := &requestState{created: p.now(), model: req.TargetModel, keys: keys}
	for _, e := range endpoints {
		st.candidates = append(st.candidates, picker.Candidate{Holder: holderOf(e), Waiting: e.GetMetrics().WaitingQueueSize})
	}
	scores, err := p.pick.Score(picker.Request{Model: st.model, Keys: keys, Candidates: st.candidates}, nil)
	if err != nil {
		return fmt.Errorf("kvsource: request %s: %w", req.RequestID, err)
	}
	bs := p.hasher.Config().BlockSize
	for _, e := range endpoints {
		m := &PrefixMatch{PromptBlocks: len(keys), BlockSize: bs}
		for i := range scores {
			if scores[i].Holder == holderOf(e) {
				s := &scores[i]
				m.Blocks, m.Score = s.Blocks, s.Score
				m.GPU, m.CPU = s.Tier(index.TierGPU), s.Tier(index.TierCPU)
			}
		}
		e.Put(PrefixMatchKey, m)
	}
	p.reqs.Store(req.RequestID, st)
	if p.admitted.Add(1)%sweepEvery == 0 {
		p.sweep()
	}
	return nil
}

// sweep drops the state of requests older than StateTTL, releasing their
// pulls.
func (p *KVSource) sweep() {
	cutoff := p.now().Add(-p.stateTTL)
	p.reqs.Range(func(k, v any) bool {
		if st := v.(*requestState); st.created.Before(cutoff) {
			p.reqs.Delete(k)
			if st.decision != nil {
				st.decision.Done()
			}
		}
		return true
	})
}

// Category implements Scorer.
func (p *KVSource) Category() ScorerCategory { return Affinity }

// Score implements Scorer: an endpoint's tier-weighted cached prefix as a
// fraction of the prompt.
func (p *KVSource) Score(_ context.Context, _ *CycleState, _ *InferenceRequest, endpoints []Endpoint) map[Endpoint]float64 {
	out := make(map[Endpoint]float64, len(endpoints))
	for _, e := range endpoints {
		v, ok := e.Get(PrefixMatchKey)
		m, _ := v.(*PrefixMatch)
		if !ok || m == nil || m.PromptBlocks == 0 {
			out[e] = 0
			continue
		}
		out[e] = min(m.Score/float64(m.PromptBlocks), 1)
	}
	return out
}

// computing returns the endpoint that computes the prefill: the prefill
// profile's target in a P/D deployment, else the primary profile's.
func (p *KVSource) computing(res *SchedulingResult) Endpoint {
	if res == nil {
		return nil
	}
	for _, name := range []string{p.prefill, res.PrimaryProfileName} {
		if r := res.ProfileResults[name]; r != nil && len(r.TargetEndpoints) > 0 {
			return r.TargetEndpoints[0]
		}
	}
	return nil
}

// PreRequest decides the pull for the endpoint that computes the prefill
// and applies it to the request. Any inbound source header or
// kv_transfer_params.remote_kv_source is dropped: only the picker names a
// source.
func (p *KVSource) PreRequest(_ context.Context, req *InferenceRequest, res *SchedulingResult) {
	delete(req.Headers, picker.HeaderKVCacheSource)
	if params, ok := req.Body["kv_transfer_params"].(map[string]any); ok {
		delete(params, "remote_kv_source")
	}
	v, ok := p.reqs.Load(req.RequestID)
	if !ok {
		return
	}
	st := v.(*requestState)
	dest := p.computing(res)
	if dest == nil {
		p.log.Warn("kvsource: no target in the scheduling result", "request", req.RequestID)
		return
	}
	d, err := p.pick.Pick(picker.Request{
		ID: req.RequestID, Model: st.model, Keys: st.keys, Destination: holderOf(dest), Candidates: st.candidates,
	})
	if err != nil {
		p.log.Error("kvsource: pick", "request", req.RequestID, "err", err)
		return
	}
	p.log.Debug("kvsource: decision", "request", req.RequestID, "destination", dest.GetMetadata().HostPort(),
		"reason", d.Reason, "source", d.Source.Pod, "cached_blocks", d.Cached, "pull_blocks", d.Gain)
	if d.Reason != picker.ReasonPull {
		return
	}
	st.decision = &d
	name, value := d.Header()
	if req.Headers == nil {
		req.Headers = map[string]string{}
	}
	req.Headers[name] = value
	if req.Body != nil {
		params, _ := req.Body["kv_transfer_params"].(map[string]any)
		if params == nil {
			params = map[string]any{}
		}
		params["remote_kv_source"] = d.KVTransferParams(req.RequestID).RemoteKVSource
		req.Body["kv_transfer_params"] = params
	}
}

// ResponseBody releases the request's state when its response ends: the
// pull no longer counts against its source.
func (p *KVSource) ResponseBody(_ context.Context, req *InferenceRequest, resp *Response, _ *EndpointMetadata) {
	if !resp.EndOfStream {
		return
	}
	if v, ok := p.reqs.LoadAndDelete(req.RequestID); ok {
		if d := v.(*requestState).decision; d != nil {
			d.Done()
		}
	}
}
