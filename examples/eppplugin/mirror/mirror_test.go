// The mirror's exported surface, listed by reflection, against the
// interfaces, structs and functions that ../shared/spec/llmd-epp.md §1 lists
// for llm-d-router v0.10.0. A mismatch means the mirror drifted from the
// version the plugins claim to be written for, and the port would no longer
// be a change of import paths.
package mirror_test

import (
	"reflect"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/common/routing"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requestcontrol"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requesthandling"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	attrprefix "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/datalayer/attribute/prefix"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer"
)

// surface renders t's method set ("Name signature", sorted) and, for a
// struct, its fields in order ("field Name type").
func surface(t reflect.Type) []string {
	var out []string
	base := t
	if base.Kind() == reflect.Pointer {
		base = base.Elem()
	}
	if base.Kind() == reflect.Struct {
		for f := range base.Fields() {
			out = append(out, "field "+f.Name+" "+f.Type.String())
		}
	}
	var methods []string
	for m := range t.Methods() {
		sig := m.Type
		if t.Kind() != reflect.Interface {
			// Drop the receiver, as an interface's method type has none.
			in := make([]reflect.Type, 0, sig.NumIn()-1)
			for i := 1; i < sig.NumIn(); i++ {
				in = append(in, sig.In(i))
			}
			outs := make([]reflect.Type, 0, sig.NumOut())
			for i := range sig.NumOut() {
				outs = append(outs, sig.Out(i))
			}
			sig = reflect.FuncOf(in, outs, sig.IsVariadic())
		}
		methods = append(methods, m.Name+" "+sig.String())
	}
	slices.Sort(methods)
	return append(out, methods...)
}

// unnamed returns a func type's signature without its name.
func unnamed(t reflect.Type) reflect.Type {
	in := make([]reflect.Type, t.NumIn())
	for i := range in {
		in[i] = t.In(i)
	}
	out := make([]reflect.Type, t.NumOut())
	for i := range out {
		out[i] = t.Out(i)
	}
	return reflect.FuncOf(in, out, t.IsVariadic())
}

func typeOf[T any]() reflect.Type { return reflect.TypeFor[T]() }

func TestMirrorMatchesSpecSurface(t *testing.T) {
	tests := []struct {
		name string
		typ  reflect.Type
		want []string
		// subset: the spec lists some of the type's methods; the others
		// (constructors' chaining setters, Clone) may exist.
		subset bool
	}{
		{"plugin.Plugin", typeOf[plugin.Plugin](), []string{
			"TypedName func() plugin.TypedName",
		}, false},
		{"plugin.TypedName", typeOf[plugin.TypedName](), []string{
			"field Type string", "field Name string", "String func() string",
		}, false},
		{"plugin.ConsumerPlugin", typeOf[plugin.ConsumerPlugin](), []string{
			"Consumes func() plugin.DataDependencies", "TypedName func() plugin.TypedName",
		}, false},
		{"plugin.ProducerPlugin", typeOf[plugin.ProducerPlugin](), []string{
			"Produces func() map[plugin.DataKey]interface {}", "TypedName func() plugin.TypedName",
		}, false},
		{"plugin.DataDependencies", typeOf[plugin.DataDependencies](), []string{
			"field Required map[plugin.DataKey]interface {}", "field Optional map[plugin.DataKey]interface {}",
		}, false},
		{"plugin.DataKey", typeOf[plugin.DataKey](), []string{
			"field dataType string", "field producerName string",
			"String func() string", "WithNonEmptyProducerName func(string) plugin.DataKey",
		}, false},
		{"plugin.Handle", typeOf[plugin.Handle](), []string{
			"AddPlugin func(string, plugin.Plugin)", "Context func() context.Context",
			"GetAllPlugins func() []plugin.Plugin", "GetAllPluginsWithNames func() map[string]plugin.Plugin",
			"Metrics func() plugin.MetricsRecorder", "Plugin func(string) plugin.Plugin",
			"PodList func() []types.NamespacedName",
		}, false},
		{"plugin.HandlePlugins", typeOf[plugin.HandlePlugins](), []string{
			"AddPlugin func(string, plugin.Plugin)", "GetAllPlugins func() []plugin.Plugin",
			"GetAllPluginsWithNames func() map[string]plugin.Plugin", "Plugin func(string) plugin.Plugin",
		}, false},
		{"datalayer.Endpoint", typeOf[datalayer.Endpoint](), []string{
			"GetAttributes func() datalayer.AttributeMap", "GetMetadata func() *datalayer.EndpointMetadata",
			"GetMetrics func() *datalayer.Metrics", "String func() string",
			"UpdateMetadata func(*datalayer.EndpointMetadata)", "UpdateMetrics func(*datalayer.Metrics)",
		}, false},
		{"datalayer.EndpointMetadata", typeOf[datalayer.EndpointMetadata](), []string{
			"field ID types.NamespacedName", "field Name string", "field Address string", "field NodeAddress string",
			"field Port string", "field MetricsHost string", "field Labels map[string]string", "field RankIndex int",
		}, false},
		{"datalayer.Metrics", typeOf[datalayer.Metrics](), []string{
			"field ActiveModels map[string]int", "field WaitingModels map[string]int", "field MaxActiveModels int",
			"field RunningRequestsSize int", "field WaitingQueueSize int", "field KVCacheUsagePercent float64",
			"field KvCacheMaxTokenCapacity int", "field CacheBlockSize int", "field CacheNumBlocks int",
			"field UpdateTime time.Time",
		}, false},
		{"datalayer.Cloneable", typeOf[datalayer.Cloneable](), []string{
			"Clone func() datalayer.Cloneable",
		}, false},
		{"datalayer.AttributeMap", typeOf[datalayer.AttributeMap](), []string{
			"Clone func() datalayer.AttributeMap", "Get func(string) (datalayer.Cloneable, bool)",
			"Keys func() []string", "Put func(string, datalayer.Cloneable)",
		}, false},
		{"datalayer.EndpointExtractor", typeOf[datalayer.EndpointExtractor](), []string{
			"Extract func(context.Context, datalayer.EndpointEvent) error", "TypedName func() plugin.TypedName",
		}, false},
		{"datalayer.EndpointEvent", typeOf[datalayer.EndpointEvent](), []string{
			"field Type datalayer.EventType", "field Endpoint datalayer.Endpoint",
		}, false},
		{"scheduling.InferenceRequest", typeOf[*scheduling.InferenceRequest](), []string{
			"field RequestID string", "field TargetModel string", "field Body *requesthandling.InferenceRequestBody",
			"field Headers map[string]string", "field Objectives scheduling.RequestObjectives", "field FairnessID string",
			"field RequestSizeBytes int", "field SchedulingResult *scheduling.SchedulingResult", "field attributes *sync.Map",
			"GetAttribute func(string) (interface {}, bool)", "PutAttribute func(string, interface {})",
		}, false},
		{"scheduling.Endpoint", typeOf[scheduling.Endpoint](), []string{
			"Clone func() datalayer.AttributeMap", "Get func(string) (datalayer.Cloneable, bool)",
			"GetMetadata func() *datalayer.EndpointMetadata", "GetMetrics func() *datalayer.Metrics",
			"Keys func() []string", "Put func(string, datalayer.Cloneable)", "String func() string",
		}, false},
		{"scheduling.ProfileRunResult", typeOf[scheduling.ProfileRunResult](), []string{
			"field TargetEndpoints []scheduling.Endpoint", "field ScoredCandidates []scheduling.ScoredEndpoint",
		}, false},
		{"scheduling.SchedulingResult", typeOf[scheduling.SchedulingResult](), []string{
			"field ProfileResults map[string]*scheduling.ProfileRunResult", "field PrimaryProfileName string",
		}, false},
		{"requesthandling.TokenizedPrompt", typeOf[requesthandling.TokenizedPrompt](), []string{
			"field PerPromptTokens [][]uint32", "field MultiModalFeatures []requesthandling.MultiModalFeature",
			"field CacheSalt string",
		}, false},
		{"requestcontrol.DataProducer", typeOf[requestcontrol.DataProducer](), []string{
			"Produce func(context.Context, *scheduling.InferenceRequest, []scheduling.Endpoint) error",
			"Produces func() map[plugin.DataKey]interface {}", "TypedName func() plugin.TypedName",
		}, false},
		{"requestcontrol.PreRequest", typeOf[requestcontrol.PreRequest](), []string{
			"PreRequest func(context.Context, *scheduling.InferenceRequest, *scheduling.SchedulingResult) error",
			"TypedName func() plugin.TypedName",
		}, false},
		{"requestcontrol.ResponseBodyProcessor", typeOf[requestcontrol.ResponseBodyProcessor](), []string{
			"ResponseBody func(context.Context, *scheduling.InferenceRequest, *requestcontrol.Response, *datalayer.EndpointMetadata)",
			"TypedName func() plugin.TypedName",
		}, false},
		{"requestcontrol.Response", typeOf[requestcontrol.Response](), []string{
			"field RequestID string", "field Headers map[string]string", "field StartOfStream bool",
			"field EndOfStream bool", "field ReqMetadata map[string]interface {}", "field Usage requesthandling.Usage",
			"field DynamicMetadata *structpb.Struct",
		}, false},
		{"prefix.PrefixCacheMatchInfo", typeOf[*attrprefix.PrefixCacheMatchInfo](), []string{
			"BlockSizeTokens func() int", "CachedBlockCount func() int", "CachedBlocksByTier func() map[string]int",
			"MatchBlocks func() int", "TotalBlocks func() int",
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := surface(tt.typ)
			if tt.subset {
				for _, w := range tt.want {
					require.Contains(t, got, w)
				}
				return
			}
			require.Equal(t, tt.want, got)
		})
	}
}

func TestMirrorFunctionSignaturesMatchSpec(t *testing.T) {
	tests := []struct {
		name string
		typ  reflect.Type
		want string
	}{
		{"plugin.NewDataKey", reflect.TypeOf(plugin.NewDataKey), "func(string, string) plugin.DataKey"},
		{"plugin.Register", reflect.TypeOf(plugin.Register), "func(string, plugin.StabilityLevel, plugin.FactoryFunc)"},
		{"plugin.FactoryFunc", typeOf[plugin.FactoryFunc](), "func(string, *json.Decoder, plugin.Handle) (plugin.Plugin, error)"},
		{"plugin.ConfigParserFunc", typeOf[plugin.ConfigParserFunc](), "func(*json.Decoder, plugin.Handle) (interface {}, error)"},
		{"scheduling.ReadRequestAttribute", reflect.TypeOf(scheduling.ReadRequestAttribute[int]), "func(*scheduling.InferenceRequest, string) (int, bool)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.Equal(t, tt.want, unnamed(tt.typ).String())
		})
	}
}

func TestMirrorConstantsMatchSpec(t *testing.T) {
	tests := []struct {
		name      string
		got, want any
	}{
		{"TypedName.String", plugin.TypedName{Type: "t", Name: "n"}.String(), "n/t"},
		{"DataKey.String", plugin.NewDataKey("D", "p").String(), "D/p"},
		{"DataKey bound", plugin.NewDataKey("D", "p").WithNonEmptyProducerName("q").String(), "D/q"},
		{"DataKey unbound by empty name", plugin.NewDataKey("D", "p").WithNonEmptyProducerName("").String(), "D/p"},
		{"PrefixCacheMatchInfoDataKey", attrprefix.PrefixCacheMatchInfoDataKey.String(), "PrefixCacheMatchInfoDataKey/approx-prefix-cache-producer"},
		{"TokenizedPromptDataKey", tokenizer.TokenizedPromptDataKey.String(), "TokenizedPrompt/token-producer"},
		{"SpeculativeTierKey", attrprefix.SpeculativeTierKey, "speculative"},
		{"KVCacheSourceHeader", routing.KVCacheSourceHeader, "x-kv-cache-source-host-port"},
		{"StabilityAlpha", string(plugin.StabilityAlpha), "Alpha"},
		{"StabilityBeta", string(plugin.StabilityBeta), "Beta"},
		{"StabilityStable", string(plugin.StabilityStable), "Stable"},
		{"EventAddOrUpdate", int(datalayer.EventAddOrUpdate), 0},
		{"EventDelete", int(datalayer.EventDelete), 1},
		{"NewPrefixCacheMatchInfo CachedBlockCount defaults to match", attrprefix.NewPrefixCacheMatchInfo(3, 4, 16).CachedBlockCount(), 3},
		{"CachedBlocksByTier nil without tier data", attrprefix.NewPrefixCacheMatchInfo(3, 4, 16).CachedBlocksByTier() == nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.Equal(t, tt.want, tt.got)
		})
	}
}

// The strict decoder the loader hands factories rejects unknown fields.
func TestStrictDecoderRejectsUnknownFields(t *testing.T) {
	require.Nil(t, plugin.StrictDecoder(nil))
	var v struct{ A int }
	err := plugin.StrictDecoder([]byte(`{"A":1,"B":2}`)).Decode(&v)
	require.ErrorContains(t, err, `unknown field "B"`)
}
