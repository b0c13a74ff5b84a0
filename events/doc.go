// Package events turns vLLM's KV-cache events into index updates, losing
// nothing it could have known and saying loudly when it cannot trust its
// state.
//
// vLLM publishes one ZMQ message per scheduler step, [topic, seq, payload],
// where payload is a msgpack EventBatch. Decoder reads every layout vLLM has
// used (tagged positional arrays of each field generation, tagged maps with
// omitted defaults and unknown fields), integer or raw-digest block hashes,
// with or without a data-parallel rank. A malformed payload is an error
// wrapping ErrMalformed, never a panic; an event of unknown type is skipped
// and the rest of its batch applies. The decoder walks the payload with
// msgpack's streaming Decoder and reads integer arrays (token ids, block
// hashes) straight from the same buffer: with msgpack's per-value calls a
// core decodes about 2.3M blocks/s, with the direct path over 5M.
//
// Subscriber receives from engines (binding a SUB socket they connect to,
// connecting one SUB socket per pod endpoint, or both), keeps each holder's
// (pod, data-parallel rank) events in order on one of N workers, detects
// sequence gaps and engine restarts, fetches missed batches from an engine's
// replay endpoint, and applies events to a Sink, normally an *index.Index.
// Publisher is a vLLM-compatible publisher for tests, examples and demos.
package events
