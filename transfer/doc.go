// Package transfer moves KV-cache blocks between vLLM pods, in the vocabulary
// of vLLM's P2P offload tier.
//
// A router's picker claims that a peer holds a prefix; a pull is the proof.
// This package gives routers, simulators and tests one client interface for
// that pull, independent of how the blocks travel:
//
//	transfer       Key, Client, Session, Stats, sentinel errors, Probe and MeasurePull
//	transfer/fake  an in-memory transport with simulated latency, bandwidth and faults
//	transfer/p2p   vLLM's P2P control protocol over ZMQ (both sides) and its data planes;
//	               the NIXL data plane is built with -tags nixl
//
// A pull follows vLLM's P2P tier. The consumer connects to a peer, looks up
// keys (the peer answers which it holds and pins the hits for the current
// round), then fetches hit keys into destination block indexes. The peer
// writes the blocks into the consumer's memory; block index i is the i-th
// block of the consumer's registered region. A fetch closes its round. A
// Fetch with no keys ends the request without a reply and releases the
// peer's pins; vLLM sends one whenever a lookup was not followed by a fetch,
// so a caller that looks up and then decides not to pull must do the same
// (Probe does).
//
// Keys are vLLM OffloadKeys: a block-hash digest followed by the 4-byte
// big-endian KV-cache group index. When the offload tier stores several
// blocks per chunk, chunk k is named by the hash of its last block
// (OffloadKeys).
//
// Errors wrap the sentinel errors below, so callers branch with errors.Is:
// ErrUnreachable and ErrPeerLost mean the peer is gone; ErrHandshake means it
// refused the session (vLLM rejects a connect with silence, so this also
// covers a handshake timeout); ErrMissingKeys means the peer no longer holds
// what the router thought; ErrFetchFailed means the peer failed the transfer;
// ErrAborted means the fetch was cancelled and the destination blocks may be
// reused.
package transfer
