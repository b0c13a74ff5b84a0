// Package kvplugin puts kvsource's index and picker into llm-d's endpoint
// picker (EPP) as drop-in replacements for llm-d-router v0.10.0's
// precise-prefix-cache-producer and p2p-source-producer.
//
// PrefixProducer (type kvsource-prefix-cache-producer) keeps an index of
// every pod's KV cache, fed by the pods' KV events, and writes each
// candidate endpoint's PrefixCacheMatchInfo: the data shape upstream's
// prefix-cache-scorer and p2p-source-producer read, cached blocks by tier
// included. It learns pods from endpoint lifecycle events. With
// speculativeIndexing it also records each scheduled request's blocks on
// the pods chosen for it, as index.TierSpeculative entries that the next
// requests on the prefix score at once, weighed as GPU blocks, until their
// TTL passes or the engine evicts the blocks; the engine's own stores add
// beside them, as upstream's do.
//
// SourceProducer (type kvsource-p2p-source-producer) decides, after
// scheduling, whether the pod computing the prompt should pull its missing
// prefix from a peer, by kvsource's rule, and names the peer in llm-d's
// x-kv-cache-source-host-port header; with kvHints it also sets the pull's
// KV hint for vLLM's KVCR tier, as a JSON merge patch of the request body,
// in the x-kvsource-kv-hint header. The response body hook releases the
// pull's in-flight count.
//
// The decision path is pure Go. Receiving KV events over ZMQ needs cgo and
// lives in the subpackage zmqevents, handed to Register as its
// SubscribeFunc.
package kvplugin

import (
	"context"
	"github.com/kvsource/kvsource/events"
	"log/slog"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// Plugin types, as an EPP configuration names them.
const (
	PrefixProducerType = "kvsource-prefix-cache-producer"
	SourceProducerType = "kvsource-p2p-source-producer"
)

// Subscription receives KV events and applies them to an index: pods are
// added and removed as the EPP discovers them.
type Subscription interface {
	// AddPod connects to a pod's KV event endpoint; events received there
	// belong to pod. replayEndpoint ("" for none) serves missed batches.
	AddPod(pod, endpoint, replayEndpoint string) error
	// RemovePod disconnects every endpoint added for pod.
	RemovePod(pod string)
	// Run receives until ctx ends.
	Run(ctx context.Context) error
	// Source reports whether holder h may serve a pull now, and its
	// state, as zmq.Subscriber.Source does: only holders heard from, with
	// their connection up, are pull sources.
	Source(h index.Holder) (state string, ok bool)
}

// SubscriptionConfig is what a Subscription is built from.
type SubscriptionConfig struct {
	// Index is the index the events are for.
	Index *index.Index
	// Sink, when set, receives the events in Index's place: the prefix
	// producer's index.Speculative with speculativeIndexing, so that an
	// engine's evictions take its entries' guesses out.
	Sink events.Sink
	// Hasher is the request side's hasher. With hashing.Content it keys the
	// index by content (events are re-keyed from their token ids);
	// otherwise the index holds the engines' keys and Hasher checks that
	// they agree with what requests hash to.
	Hasher *hashing.Hasher
	// Bind is an endpoint to bind a SUB socket on that engines connect to
	// ("" for none); a topic "kv@<host:port>@<model>" names the pod.
	Bind string
	// TopicFilter is the subscription's topic prefix.
	TopicFilter string
	// Workers is the number of goroutines applying events.
	Workers int
	Logger  *slog.Logger
	// Engine is the engines' kind (kvEventsConfig.engineType), for bound
	// sockets' pods and those AddPod adds.
	Engine events.Engine
}

// SubscribeFunc builds a Subscription; zmqevents.Subscribe is one.
type SubscribeFunc func(SubscriptionConfig) (Subscription, error)

// Register registers both plugin types with the EPP's plugin registry, as
// the EPP's runner registers its own plugins. subscribe receives KV events
// for prefix producers configured to (nil: such a configuration is refused).
//
// The source producer is registered with its plugin dependency, the prefix
// producer it reads, so that the loader instantiates that one first.
func Register(subscribe SubscribeFunc) {
	plugin.Register(PrefixProducerType, plugin.StabilityAlpha, PrefixFactory(subscribe))
	plugin.RegisterWithPluginDependencies(SourceProducerType, plugin.StabilityAlpha, SourceFactory, SourceConfigParser)
}
