//go:build cgo

// Package zmq is the ZMQ transport of package events: a Subscriber that
// receives vLLM's KV events from SUB sockets and applies them through an
// events.Processor, the DEALER client of vLLM's ROUTER replay socket, and a
// vLLM-compatible Publisher for tests, examples and demos. It needs libzmq
// (cgo, through pebbe/zmq4); the decoder and the state machine do not.
//
// Subscriber receives from engines in bind mode (one SUB socket every
// engine connects to; port 0 picks a free port, which Addrs reports),
// connect mode (one SUB socket per pod endpoint, added and removed at run
// time with AddPod and RemovePod, libzmq reconnecting), or both. Ready is
// closed once Run has bound its sockets; WaitApplied and Sync wait until
// events are in the index. Replies to a replay request are read in both of
// vLLM's formats (v0.25's and v0.26's).
//
// A pod's model is its PodConfig.Model, else its topic's (llm-d's
// kv@POD@MODEL). vLLM's default topic is empty, so a bind-mode message
// naming no pod, or any message left without a model, is dropped, counted
// by reason (events.Stats.EmptyTopic, UnknownTopic, NoModel) and logged
// with the fix, each reason at most once a second.
//
// A ZMQ publisher drops what it sends before a subscriber's subscription
// reaches it (the "slow joiner"), whichever side binds. A publisher that
// must not lose its first batches waits for Publisher.WaitSubscribed, or
// has a replay socket registered with the subscriber, which then fetches
// what was lost when the first batch arrives.
package zmq
