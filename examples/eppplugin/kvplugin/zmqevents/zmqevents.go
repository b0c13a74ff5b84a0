//go:build cgo

// Package zmqevents is the prefix producer's KV event transport: vLLM's
// ZMQ publishers, received by kvsource's zmq.Subscriber. It is the one
// part of the plugins that needs cgo (libzmq), and builds only with it, so
// that `CGO_ENABLED=0 go test ./examples/eppplugin/...` tests the rest. The
// EPP's main registers the plugins with it:
//
//	kvplugin.Register(zmqevents.Subscribe)
package zmqevents

import (
	"net"
	"strings"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/examples/eppplugin/kvplugin"
	"github.com/kvsource/kvsource/hashing"
)

var _ kvplugin.SubscribeFunc = Subscribe

// Subscribe returns a zmq.Subscriber applying vLLM's KV events to
// cfg.Sink, else cfg.Index, keyed by content when cfg.Hasher uses hashing.Content and by
// the engines' keys, checked against cfg.Hasher, otherwise.
func Subscribe(cfg kvplugin.SubscriptionConfig) (kvplugin.Subscription, error) {
	var sink events.Sink = cfg.Index
	if cfg.Sink != nil {
		sink = cfg.Sink
	}
	sc := zmq.SubscriberConfig{
		Events: events.Config{
			Sink:    sink,
			Workers: cfg.Workers,
			Logger:  cfg.Logger,
		},
		TopicPrefix: cfg.TopicFilter,
		Topic:       parseTopic,
		Engine:      cfg.Engine,
	}
	if cfg.Bind != "" {
		sc.Bind = []string{cfg.Bind}
	}
	if cfg.Hasher != nil && cfg.Hasher.Config().Algo == hashing.Content {
		sc.Events.ContentKeys = cfg.Hasher
	} else {
		sc.Events.Hasher = cfg.Hasher
	}
	s, err := zmq.NewSubscriber(sc)
	if err != nil {
		return nil, err
	}
	return subscription{s, cfg.Engine}, nil
}

// subscription adds discovered pods with the configured engine.
type subscription struct {
	*zmq.Subscriber
	engine events.Engine
}

func (s subscription) AddPod(pod, endpoint, replayEndpoint string) error {
	return s.AddPodConfig(zmq.PodConfig{Pod: pod, Endpoint: endpoint, Replay: replayEndpoint, Engine: s.engine})
}

// parseTopic reads llm-d's topic "kv@<host:port>@<model>" and names the pod
// as the plugins name endpoints, net.JoinHostPort(host, port): engines
// write "$(POD_IP):$(POD_PORT)", an IPv6 host without brackets.
func parseTopic(topic string) (pod, model string, ok bool) {
	pod, model, ok = events.ParseTopic(topic)
	if !ok {
		return pod, model, ok
	}
	if host, port, err := net.SplitHostPort(pod); err == nil {
		return net.JoinHostPort(host, port), model, true
	}
	if i := strings.LastIndexByte(pod, ':'); i > 0 && strings.Count(pod, ":") > 1 && !strings.HasPrefix(pod, "[") {
		return net.JoinHostPort(pod[:i], pod[i+1:]), model, true
	}
	return pod, model, true
}
