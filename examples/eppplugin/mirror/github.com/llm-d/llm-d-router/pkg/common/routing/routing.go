// Package routing mirrors the header name of llm-d-router v0.10.0's
// pkg/common/routing that the KV-source plugins set.
package routing

// KVCacheSourceHeader names the peer, host:port, that the routing sidecar
// of the pod computing the prompt pulls KV blocks from.
const KVCacheSourceHeader = "x-kv-cache-source-host-port"
