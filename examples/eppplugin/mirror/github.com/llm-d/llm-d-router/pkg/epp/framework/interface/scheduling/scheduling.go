// Package scheduling mirrors the part of llm-d-router v0.10.0's
// pkg/epp/framework/interface/scheduling that kvsource's EPP plugins use:
// the request as plugins see it, with its attribute store, the candidate
// endpoints of a scheduling cycle and the cycle's result. Names, method sets
// and signatures are upstream's.
package scheduling

import (
	"fmt"
	"sync"

	fwkdl "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	fwkrh "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requesthandling"
)

// TokenizedPrompt is the token producer's result.
type TokenizedPrompt = fwkrh.TokenizedPrompt

// MultiModalFeature is one multimodal item of a prompt.
type MultiModalFeature = fwkrh.MultiModalFeature

// RequestObjectives are the request's scheduling objectives.
type RequestObjectives struct {
	Priority int
}

// InferenceRequest is a request as the director hands it to plugins.
type InferenceRequest struct {
	RequestID   string
	TargetModel string
	Body        *fwkrh.InferenceRequestBody
	// Headers are the request headers, lower-case names; PreRequest plugins
	// set and delete entries to steer the model server's sidecar.
	Headers          map[string]string
	Objectives       RequestObjectives
	FairnessID       string
	RequestSizeBytes int
	SchedulingResult *SchedulingResult

	attributes *sync.Map
}

// PutAttribute stores value under key in the request's attribute store,
// which carries data from one plugin (or extension point) to another.
func (r *InferenceRequest) PutAttribute(key string, value any) {
	if r.attributes == nil {
		r.attributes = &sync.Map{}
	}
	r.attributes.Store(key, value)
}

// GetAttribute returns the value stored under key.
func (r *InferenceRequest) GetAttribute(key string) (any, bool) {
	if r.attributes == nil {
		return nil, false
	}
	return r.attributes.Load(key)
}

// ReadRequestAttribute returns the value under key as a T; false when it is
// missing or another type.
func ReadRequestAttribute[T any](r *InferenceRequest, key string) (T, bool) {
	var zero T
	v, ok := r.GetAttribute(key)
	if !ok {
		return zero, false
	}
	t, ok := v.(T)
	if !ok {
		return zero, false
	}
	return t, true
}

// Endpoint is a candidate endpoint in one scheduling cycle: a snapshot of
// the data layer's endpoint with its own attributes, where producers put
// per-request data for scorers and other consumers.
type Endpoint interface {
	GetMetadata() *fwkdl.EndpointMetadata
	GetMetrics() *fwkdl.Metrics
	String() string
	Get(string) (fwkdl.Cloneable, bool)
	Put(string, fwkdl.Cloneable)
	Keys() []string
	Clone() fwkdl.AttributeMap
}

type endpoint struct {
	*fwkdl.EndpointMetadata
	*fwkdl.Metrics
	fwkdl.AttributeMap
}

// NewEndpoint returns a cycle's endpoint holding copies of meta, metrics
// and attr (nil attr: none).
func NewEndpoint(meta *fwkdl.EndpointMetadata, metrics *fwkdl.Metrics, attr fwkdl.AttributeMap) Endpoint {
	if attr == nil {
		attr = fwkdl.NewAttributes()
	}
	return &endpoint{EndpointMetadata: meta.Clone(), Metrics: metrics.Clone(), AttributeMap: attr.Clone()}
}

func (ep *endpoint) String() string {
	if ep == nil {
		return "<nil>"
	}
	return fmt.Sprintf("%+v", *ep)
}
func (ep *endpoint) GetMetadata() *fwkdl.EndpointMetadata { return ep.EndpointMetadata }
func (ep *endpoint) GetMetrics() *fwkdl.Metrics           { return ep.Metrics }
func (ep *endpoint) Clone() fwkdl.AttributeMap            { return ep.AttributeMap.Clone() }

// ScoredEndpoint is an endpoint with its weighted score in a profile.
type ScoredEndpoint struct {
	Endpoint
	Score float64
}

// ProfileRunResult is what one scheduling profile chose.
type ProfileRunResult struct {
	TargetEndpoints  []Endpoint
	ScoredCandidates []ScoredEndpoint
}

// SchedulingResult is a scheduling cycle's outcome: a result per profile
// (e.g. "prefill" and "decode" under P/D) and the profile whose target
// receives the request.
type SchedulingResult struct {
	ProfileResults     map[string]*ProfileRunResult
	PrimaryProfileName string
}
