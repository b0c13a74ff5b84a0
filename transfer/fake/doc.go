// Package fake is an in-memory transfer.Client: a network of named peers
// holding block contents, with simulated latency and bandwidth and injected
// faults, for tests and simulations that have no GPUs and no vLLM.
//
// Sessions follow the rules of vLLM's P2P tier, so code that works against
// the fake works against a real peer: a fetch may only name keys that were
// hits of the same round's lookups, a fetch closes its round, an empty fetch
// ends the request, and Abort waits for the peer's acknowledgement.
//
// Time is charged through Config.Sleep: every call that waits for the peer
// costs Config.Latency, and a fetch adds its bytes over Config.Bandwidth. The
// default sleeps on a real timer; a simulator on virtual time supplies its
// own Sleep and reads the model with Network.FetchCost. Stats.Duration of a
// fetch is the modelled cost, not wall time.
//
// Faults are set per peer with Peer.SetFaults and take effect on the next
// call: an unreachable peer (new connects fail, live sessions are lost), a
// peer that rejects handshakes (silence until the handshake timeout), a
// stalled peer (drops every message), partial hits, eviction between lookup
// and fetch, and failed transfers.
package fake
