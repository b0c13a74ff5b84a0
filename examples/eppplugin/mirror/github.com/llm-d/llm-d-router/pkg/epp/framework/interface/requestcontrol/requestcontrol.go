// Package requestcontrol mirrors the part of llm-d-router v0.10.0's
// pkg/epp/framework/interface/requestcontrol that kvsource's EPP plugins
// implement: data producers, PreRequest and the response body hook. Names,
// method sets and signatures are upstream's.
package requestcontrol

import (
	"context"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	requesthandling "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requesthandling"
	fwksched "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
)

// DataProducer runs before scheduling, in the order of the data its
// producers and consumers declare, and attaches data to the candidates.
type DataProducer interface {
	plugin.ProducerPlugin
	Produce(ctx context.Context, request *fwksched.InferenceRequest, pods []fwksched.Endpoint) error
}

// PreRequest runs after scheduling, before the request goes to the chosen
// model server. An error fails the request. State it leaves behind must be
// cleaned up in the response body hook, which the director also runs (with
// EndOfStream) for a request that was scheduled but never completed.
type PreRequest interface {
	plugin.Plugin
	PreRequest(ctx context.Context, request *fwksched.InferenceRequest, schedulingResult *fwksched.SchedulingResult) error
}

// ResponseBodyProcessor sees each response chunk; the call with EndOfStream
// is the last, also for an aborted request.
type ResponseBodyProcessor interface {
	plugin.Plugin
	ResponseBody(ctx context.Context, request *fwksched.InferenceRequest, response *Response, targetEndpoint *datalayer.EndpointMetadata)
}

// Response is a model server's response as response plugins see it.
type Response struct {
	RequestID       string
	Headers         map[string]string
	StartOfStream   bool
	EndOfStream     bool
	ReqMetadata     map[string]any
	Usage           requesthandling.Usage
	DynamicMetadata *structpb.Struct
}
