package main

// This file mirrors, in reduced form, the plugin interfaces of the
// endpoint picker (EPP) of llm-d's inference scheduler and the Gateway API
// Inference Extension, so that the example compiles without that module.
// The names follow upstream's so the plugin ports by changing imports; the
// types carry only what a KV-source plugin reads and writes. Upstream
// (mid-2026) has, in pkg/epp/framework/interface:
//
//   - plugin: every plugin has a typed name; producers and consumers of
//     per-endpoint data declare which data keys they produce and consume.
//   - requestcontrol.PrepareDataPlugin ("data producer"): called by the
//     director before scheduling with the request and the candidate
//     endpoints; it attaches data to the endpoints for scorers to read.
//   - scheduling.Scorer: scores each candidate in [0, 1] within a
//     scheduling cycle; a Category says whether it pulls toward locality
//     (Affinity) or spreads load (Distribution).
//   - requestcontrol.PreRequest: called after scheduling with the
//     scheduling result (one target per scheduler profile, e.g. "prefill"
//     and "decode"), before the request goes to the chosen model server; it
//     may set request headers (and, on body-aware parsers, the body).
//   - requestcontrol.ResponseBody: called per response chunk, the last one
//     with EndOfStream set: where per-request state is released.

import (
	"context"
	"sync"
)

// TypedName is a plugin's type and instance name.
type TypedName struct {
	Type string
	Name string
}

// Plugin is what every EPP plugin implements.
type Plugin interface {
	TypedName() TypedName
}

// DataKey names a piece of per-endpoint data one plugin produces and others
// consume.
type DataKey string

// Cloneable is per-endpoint data: the scheduler clones endpoints per cycle.
type Cloneable interface {
	Clone() Cloneable
}

// EndpointMetadata identifies a model server.
type EndpointMetadata struct {
	Name    string // the pod's name
	Address string // the pod's IP
	Port    string // the serving port
}

// HostPort returns "address:port", how llm-d's headers name an endpoint.
func (m *EndpointMetadata) HostPort() string { return m.Address + ":" + m.Port }

// Metrics are an endpoint's scraped metrics.
type Metrics struct {
	WaitingQueueSize    int     // vLLM's num_requests_waiting
	RunningRequestsSize int     // vLLM's num_requests_running
	KVCacheUsagePercent float64 // vLLM's kv_cache_usage_perc
}

// Endpoint is a candidate model server in one scheduling cycle.
type Endpoint interface {
	GetMetadata() *EndpointMetadata
	GetMetrics() *Metrics
	Get(key DataKey) (Cloneable, bool)
	Put(key DataKey, v Cloneable)
}

// InferenceRequest is a request as the director hands it to plugins.
type InferenceRequest struct {
	RequestID   string
	TargetModel string
	// Headers are the request headers, lower-case names; PreRequest
	// plugins may set and delete entries.
	Headers map[string]string
	// Body is the parsed request body; PreRequest plugins may modify it
	// where the deployment's parser writes the body back.
	Body map[string]any
	// TokenIDs are the prompt's token ids, when a token producer (or the
	// client) supplied them.
	TokenIDs []uint32
}

// CycleState is scratch state of one scheduling cycle.
type CycleState struct {
	mu sync.Mutex
	m  map[string]any
}

// Read returns the value stored under key.
func (c *CycleState) Read(key string) (any, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.m[key]
	return v, ok
}

// Write stores v under key.
func (c *CycleState) Write(key string, v any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]any{}
	}
	c.m[key] = v
}

// ScorerCategory is the preference a scorer applies.
type ScorerCategory string

// Scorer categories.
const (
	Affinity     ScorerCategory = "Affinity"
	Distribution ScorerCategory = "Distribution"
)

// ProfileRunResult is the targets one scheduler profile chose.
type ProfileRunResult struct {
	TargetEndpoints []Endpoint
}

// SchedulingResult is the outcome of a scheduling cycle: a result per
// profile, and which profile's target receives the request.
type SchedulingResult struct {
	ProfileResults     map[string]*ProfileRunResult
	PrimaryProfileName string
}

// Response is a model server's response as response plugins see it.
type Response struct {
	RequestID   string
	Headers     map[string]string
	EndOfStream bool
}

// PrepareDataPlugin is a data producer: it runs before scheduling and
// attaches data to the candidate endpoints.
type PrepareDataPlugin interface {
	Plugin
	Produces() map[DataKey]any
	Consumes() map[DataKey]any
	PrepareRequestData(ctx context.Context, req *InferenceRequest, endpoints []Endpoint) error
}

// Scorer scores candidate endpoints in [0, 1].
type Scorer interface {
	Plugin
	Category() ScorerCategory
	Score(ctx context.Context, cycle *CycleState, req *InferenceRequest, endpoints []Endpoint) map[Endpoint]float64
}

// PreRequest runs after scheduling, before the request is sent.
type PreRequest interface {
	Plugin
	PreRequest(ctx context.Context, req *InferenceRequest, result *SchedulingResult)
}

// ResponseBody sees the response; the call with EndOfStream is the last.
type ResponseBody interface {
	Plugin
	ResponseBody(ctx context.Context, req *InferenceRequest, resp *Response, target *EndpointMetadata)
}

// endpoint is a plain Endpoint, what the director builds per cycle.
type endpoint struct {
	meta    EndpointMetadata
	metrics Metrics
	mu      sync.Mutex
	attrs   map[DataKey]Cloneable
}

// NewEndpoint returns an endpoint with no data attached.
func NewEndpoint(meta EndpointMetadata, m Metrics) Endpoint {
	return &endpoint{meta: meta, metrics: m, attrs: map[DataKey]Cloneable{}}
}

func (e *endpoint) GetMetadata() *EndpointMetadata { return &e.meta }
func (e *endpoint) GetMetrics() *Metrics           { return &e.metrics }

func (e *endpoint) Get(k DataKey) (Cloneable, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	v, ok := e.attrs[k]
	return v, ok
}

func (e *endpoint) Put(k DataKey, v Cloneable) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.attrs[k] = v
}
