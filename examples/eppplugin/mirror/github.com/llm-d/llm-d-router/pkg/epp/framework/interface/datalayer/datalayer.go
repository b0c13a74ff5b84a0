// Package datalayer mirrors the part of llm-d-router v0.10.0's
// pkg/epp/framework/interface/datalayer that kvsource's EPP plugins use:
// endpoints with their metadata, metrics and attributes, and the endpoint
// lifecycle events an extractor receives. Names, method sets and signatures
// are upstream's.
package datalayer

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/k8s.io/apimachinery/pkg/types"
)

// Cloneable is a value endpoints and requests can carry: the scheduler
// clones endpoints per cycle.
type Cloneable interface {
	Clone() Cloneable
}

// AttributeMap holds an endpoint's named data.
type AttributeMap interface {
	Put(string, Cloneable)
	Get(string) (Cloneable, bool)
	Keys() []string
	Clone() AttributeMap
}

// Attributes is a goroutine-safe AttributeMap; Get returns clones.
type Attributes struct {
	data sync.Map
}

// NewAttributes returns an empty AttributeMap.
func NewAttributes() AttributeMap { return &Attributes{} }

// Put stores value under key; a nil value is ignored.
func (a *Attributes) Put(key string, value Cloneable) {
	if value != nil {
		a.data.Store(key, value)
	}
}

// Get returns a clone of the value under key.
func (a *Attributes) Get(key string) (Cloneable, bool) {
	v, ok := a.data.Load(key)
	if !ok {
		return nil, false
	}
	return v.(Cloneable).Clone(), true
}

// Keys returns the keys, in no particular order.
func (a *Attributes) Keys() []string {
	var keys []string
	a.data.Range(func(k, _ any) bool {
		keys = append(keys, k.(string))
		return true
	})
	return keys
}

// Clone returns a copy of the map holding the same values.
func (a *Attributes) Clone() AttributeMap {
	c := &Attributes{}
	a.data.Range(func(k, v any) bool {
		c.data.Store(k, v)
		return true
	})
	return c
}

// ID identifies an endpoint uniquely.
type ID = types.NamespacedName

// EndpointMetadata describes an inference endpoint. A pod serving several
// data-parallel ranks on several ports is one endpoint per rank, RankIndex
// being the rank's position in the pool's target ports.
type EndpointMetadata struct {
	ID          ID
	Name        string
	Address     string
	NodeAddress string
	Port        string
	MetricsHost string
	Labels      map[string]string
	RankIndex   int
}

// String renders the metadata's fields.
func (epm *EndpointMetadata) String() string {
	if epm == nil {
		return ""
	}
	return fmt.Sprintf("%+v", *epm)
}

// Clone returns a deep copy.
func (epm *EndpointMetadata) Clone() *EndpointMetadata {
	if epm == nil {
		return nil
	}
	c := *epm
	c.Labels = maps.Clone(epm.Labels)
	return &c
}

// GetRankIndex returns RankIndex, 0 for nil metadata.
func (epm *EndpointMetadata) GetRankIndex() int {
	if epm == nil {
		return 0
	}
	return epm.RankIndex
}

// Metrics are an endpoint's scraped metrics.
type Metrics struct {
	ActiveModels            map[string]int
	WaitingModels           map[string]int
	MaxActiveModels         int
	RunningRequestsSize     int
	WaitingQueueSize        int
	KVCacheUsagePercent     float64
	KvCacheMaxTokenCapacity int
	CacheBlockSize          int
	CacheNumBlocks          int
	UpdateTime              time.Time
}

// NewMetrics returns empty metrics.
func NewMetrics() *Metrics {
	return &Metrics{ActiveModels: map[string]int{}, WaitingModels: map[string]int{}}
}

// String renders the metrics' fields.
func (m *Metrics) String() string {
	if m == nil {
		return ""
	}
	return fmt.Sprintf("%+v", *m)
}

// Clone returns a deep copy, nil for nil.
func (m *Metrics) Clone() *Metrics {
	if m == nil {
		return nil
	}
	c := *m
	c.ActiveModels = maps.Clone(m.ActiveModels)
	c.WaitingModels = maps.Clone(m.WaitingModels)
	return &c
}

// EndpointMetaState is an endpoint's metadata and attributes.
type EndpointMetaState interface {
	GetMetadata() *EndpointMetadata
	UpdateMetadata(*EndpointMetadata)
	GetAttributes() AttributeMap
}

// EndpointMetricsState is an endpoint's metrics.
type EndpointMetricsState interface {
	GetMetrics() *Metrics
	UpdateMetrics(*Metrics)
}

// Endpoint is an inference endpoint as the data layer keeps it.
type Endpoint interface {
	fmt.Stringer
	EndpointMetaState
	EndpointMetricsState
}

// ModelServer is the data layer's Endpoint.
type ModelServer struct {
	pod        atomic.Pointer[EndpointMetadata]
	metrics    atomic.Pointer[Metrics]
	attributes AttributeMap
}

// NewEndpoint returns a ModelServer; nil metadata or metrics become empty
// ones.
func NewEndpoint(meta *EndpointMetadata, metrics *Metrics) *ModelServer {
	if meta == nil {
		meta = &EndpointMetadata{}
	}
	if metrics == nil {
		metrics = NewMetrics()
	}
	s := &ModelServer{attributes: NewAttributes()}
	s.pod.Store(meta)
	s.metrics.Store(metrics)
	return s
}

func (s *ModelServer) String() string {
	return fmt.Sprintf("Metadata: %v; Metrics: %v; Attributes: %v", s.GetMetadata(), s.GetMetrics(), s.attributes.Keys())
}
func (s *ModelServer) GetMetadata() *EndpointMetadata       { return s.pod.Load() }
func (s *ModelServer) UpdateMetadata(pod *EndpointMetadata) { s.pod.Store(pod) }
func (s *ModelServer) GetMetrics() *Metrics                 { return s.metrics.Load() }
func (s *ModelServer) UpdateMetrics(m *Metrics)             { s.metrics.Store(m) }
func (s *ModelServer) GetAttributes() AttributeMap          { return s.attributes }

// Extractor turns input T into endpoint attributes or other state.
type Extractor[T any] interface {
	plugin.Plugin
	Extract(ctx context.Context, in T) error
}

// EndpointExtractor receives endpoint lifecycle events, e.g. from an
// endpoint-notification-source.
type EndpointExtractor = Extractor[EndpointEvent]

// EventType is the kind of change an event reports.
type EventType int

// Event types.
const (
	EventAddOrUpdate EventType = iota
	EventDelete
)

// EndpointEvent reports an endpoint added, updated or deleted.
type EndpointEvent struct {
	Type     EventType
	Endpoint Endpoint
}
