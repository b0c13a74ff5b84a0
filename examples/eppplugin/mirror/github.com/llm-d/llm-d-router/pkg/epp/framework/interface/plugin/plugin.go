// Package plugin mirrors the part of llm-d-router v0.10.0's
// pkg/epp/framework/interface/plugin that kvsource's EPP plugins use: typed
// names, data keys and dependencies, the plugin registry and the handle.
// Names, method sets and signatures are upstream's, so that replacing this
// package's import path by upstream's is the whole port.
package plugin

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/k8s.io/apimachinery/pkg/types"
)

// Plugin is what every plugin implements.
type Plugin interface {
	TypedName() TypedName
}

// TypedName is a plugin's type and instance name.
type TypedName struct {
	Type string
	Name string
}

// String renders the typed name as "name/type".
func (tn TypedName) String() string { return tn.Name + "/" + tn.Type }

// DataKey identifies a piece of data by its type and the name of the
// producer instance that writes it.
type DataKey struct {
	dataType     string
	producerName string
}

// NewDataKey returns the key of dataType written by defaultProducerName.
func NewDataKey(dataType, defaultProducerName string) DataKey {
	return DataKey{dataType: dataType, producerName: defaultProducerName}
}

// WithNonEmptyProducerName returns the key bound to producer name, or the
// key unchanged when name is empty.
func (dk DataKey) WithNonEmptyProducerName(name string) DataKey {
	if name != "" {
		dk.producerName = name
	}
	return dk
}

// String renders the key as "dataType/producerName", the attribute name
// endpoints store the data under.
func (dk DataKey) String() string { return fmt.Sprintf("%s/%s", dk.dataType, dk.producerName) }

// DataDependencies are the keys a consumer needs: the framework refuses to
// start when nobody produces a Required key and warns for an Optional one.
type DataDependencies struct {
	Required map[DataKey]any
	Optional map[DataKey]any
}

// ConsumerPlugin declares the data it consumes.
type ConsumerPlugin interface {
	Plugin
	Consumes() DataDependencies
}

// ProducerPlugin declares the data it produces, each key with a zero value
// of its type.
type ProducerPlugin interface {
	Plugin
	Produces() map[DataKey]any
}

// StabilityLevel is a registered plugin type's stability.
type StabilityLevel string

// Stability levels. Alpha plugins need the EPP's --allow-experimental-plugins.
const (
	StabilityAlpha  StabilityLevel = "Alpha"
	StabilityBeta   StabilityLevel = "Beta"
	StabilityStable StabilityLevel = "Stable"
)

// PluginMetadata is what the registry records about a plugin type.
type PluginMetadata struct {
	Type               string
	Stability          StabilityLevel
	Deprecated         bool
	DeprecatedIn       string
	ScheduledRemovalIn string
	ReplacementType    string
}

// FactoryFunc builds a plugin instance from its configured name and
// parameters. parameters is a decoder that rejects unknown fields, or nil
// when the configuration gave none.
type FactoryFunc func(name string, parameters *json.Decoder, handle Handle) (Plugin, error)

// ConfigParserFunc parses the parameters of a plugin registered with plugin
// dependencies; the loader reads the fields tagged pluginRef of its result
// to instantiate the referenced plugins first.
type ConfigParserFunc func(parameters *json.Decoder, handle Handle) (any, error)

// Registry maps plugin types to their factories.
var Registry = map[string]FactoryFunc{}

// RegistryMetadata maps plugin types to their metadata.
var RegistryMetadata = map[string]PluginMetadata{}

// PluginsWithPluginDependencies maps plugin types to their parameter parsers.
var PluginsWithPluginDependencies = map[string]ConfigParserFunc{}

// Register registers factory for pluginType.
func Register(pluginType string, stability StabilityLevel, factory FactoryFunc) {
	Registry[pluginType] = factory
	RegistryMetadata[pluginType] = PluginMetadata{Type: pluginType, Stability: stability}
}

// RegisterWithPluginDependencies registers factory for pluginType, and the
// parser the loader uses to order instantiation after the plugins the
// parameters reference.
func RegisterWithPluginDependencies(pluginType string, stability StabilityLevel, factory FactoryFunc, parser ConfigParserFunc) {
	Register(pluginType, stability, factory)
	PluginsWithPluginDependencies[pluginType] = parser
}

// StrictDecoder returns a decoder over raw that rejects unknown fields, or
// nil for empty raw: what the loader hands factories.
func StrictDecoder(raw json.RawMessage) *json.Decoder {
	if len(raw) == 0 {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	return dec
}

// MetricsRecorder is where plugins register their metrics.
type MetricsRecorder interface {
	prometheus.Registerer
}

// Handle gives plugins the EPP's context, the other plugins, the pod list
// and the metrics registry.
type Handle interface {
	Context() context.Context
	HandlePlugins
	PodList() []types.NamespacedName
	Metrics() MetricsRecorder
}

// HandlePlugins is the set of instantiated plugins.
type HandlePlugins interface {
	Plugin(name string) Plugin
	AddPlugin(name string, plugin Plugin)
	GetAllPlugins() []Plugin
	GetAllPluginsWithNames() map[string]Plugin
}

// PodListFunc lists the pods a handle reports.
type PodListFunc func() []types.NamespacedName

// HandleOption configures NewEppHandle.
type HandleOption func(*eppHandle)

// WithMetricsRecorder sets the handle's metrics recorder; nil is ignored.
func WithMetricsRecorder(recorder MetricsRecorder) HandleOption {
	return func(h *eppHandle) {
		if recorder != nil {
			h.metrics = recorder
		}
	}
}

// NewEppHandle returns a handle with no plugins.
func NewEppHandle(ctx context.Context, podList PodListFunc, opts ...HandleOption) Handle {
	h := &eppHandle{ctx: ctx, plugins: map[string]Plugin{}, podList: podList}
	for _, o := range opts {
		o(h)
	}
	return h
}

type eppHandle struct {
	ctx     context.Context
	plugins map[string]Plugin
	podList PodListFunc
	metrics MetricsRecorder
}

func (h *eppHandle) Context() context.Context             { return h.ctx }
func (h *eppHandle) Plugin(name string) Plugin            { return h.plugins[name] }
func (h *eppHandle) AddPlugin(name string, plugin Plugin) { h.plugins[name] = plugin }
func (h *eppHandle) Metrics() MetricsRecorder             { return h.metrics }

func (h *eppHandle) GetAllPlugins() []Plugin {
	out := make([]Plugin, 0, len(h.plugins))
	for _, p := range h.plugins {
		out = append(out, p)
	}
	return out
}

func (h *eppHandle) GetAllPluginsWithNames() map[string]Plugin { return h.plugins }

func (h *eppHandle) PodList() []types.NamespacedName {
	if h.podList == nil {
		return nil
	}
	return h.podList()
}

// PluginByType returns the plugin named name as a P, or an error when there
// is none or it is another type.
func PluginByType[P Plugin](handlePlugins HandlePlugins, name string) (P, error) {
	var zero P
	raw := handlePlugins.Plugin(name)
	if raw == nil {
		return zero, fmt.Errorf("there is no plugin with the name '%s' defined", name)
	}
	p, ok := raw.(P)
	if !ok {
		return zero, fmt.Errorf("the plugin with the name '%s' is not an instance of %T", name, zero)
	}
	return p, nil
}
