//go:build cgo

// Package p2p implements both sides of vLLM's P2P KV-offload tier control
// protocol (vllm/v1/kv_offload/tiering/p2p, as of vLLM PR #51875) over ZMQ,
// and the data planes that move the bytes.
//
// A Client is the consumer: it binds a ROUTER, dials a peer's side channel
// with a DEALER whose identity is its own "host:port", and pulls blocks into
// its registered memory. A Producer serves blocks from a BlockStore to such
// consumers, Go or vLLM. Each side sends on its own DEALER and receives on
// its own ROUTER: two one-way channels per pair of peers.
//
// # Wire format
//
// Every message is one ZMQ frame holding a msgpack map with a "type" key.
// Strings are str, keys and agent metadata bin, integers in their smallest
// form, hits and success bools. vLLM decodes maps untyped, so key order is
// free; this package encodes "type" first and then the fields in this
// table's order, which makes encodings deterministic (testdata holds byte
// fixtures written by an independent Python generator):
//
//	connect        peer_id, agent_metadata, base_addr, num_blocks, block_len, config_fingerprint, hash_seed
//	connect_ack    peer_id
//	lookup         kv_request_id, keys, round_seq
//	lookup_resp    kv_request_id, keys, hits
//	fetch          kv_request_id, keys, block_indexes, round_seq
//	transfer_done  kv_request_id, success, round_seq
//	abort_fetch    kv_request_id, round_seq
//	abort_ack      kv_request_id, round_seq
//	disconnect     (none)
//
// round_seq is always sent; a received message without it reads as round 0,
// so peers from before rounds existed interoperate. Unknown keys are
// skipped and unknown types ignored with a warning, as vLLM does. A frame
// over 64 MiB is refused by the socket (the sender's connection drops).
//
// # Protocol
//
// Both sides send connect at once; each answers the other's connect with
// connect_ack, and the producer queues replies until its connect is
// acknowledged. A connect is rejected when block_len or hash_seed differ,
// or when both config fingerprints are set and differ (so "" always
// passes), or when the data plane cannot load the peer's agent metadata.
// The producer rejects with silence, so a consumer sees its handshake time
// out (transfer.ErrHandshake); a Go client also checks the producer's
// connect and fails at once with the reason when it can, as vLLM's consumer
// does (its lookups then miss). That connect, sent before the check, is
// therefore delivered before the producer closes the connection to a
// rejected consumer, within ProducerConfig.RejectLinger.
//
// A connect from a consumer that already has a session (it closed the old
// one and connected again at once, or restarted at the same address)
// replaces that session, without a disconnect (ProducerStats.Replaced);
// vLLM's producer drops both instead. Both sides' ROUTERs set
// ZMQ_ROUTER_HANDOVER, so the new connection takes the identity while the
// old one is still closing; what the old one delivers after that arrives
// under an identity that is not "host:port" and reaches no session. A
// vLLM consumer's ROUTER has no handover: when one reconnects at once, the
// producer's new connect to it may be dropped while the old connection
// closes, and its handshake then times out.
//
// A lookup pins its hits for (kv_request_id, round_seq) and gets exactly
// one lookup_resp with every key in the original order. A fetch names hits
// of its round and destination block indexes; the producer writes each
// block into the consumer's memory (descriptor index = block index) and
// then sends transfer_done. A fetch naming a key not pinned in its round
// gets transfer_done success=false at once. One fetch per open round: a
// second one while its transfer runs drops the session, but a round that
// ended (transfer_done, abort_ack) is forgotten and its round_seq may open
// a new round, as vLLM's consumer does on a request's next load (it starts
// again at 0). The Go client moves to the next round after each fetch. An
// empty fetch ends the request and releases its pins, with no reply. abort_fetch cancels the
// round's writes and is always answered by abort_ack. Pins not claimed
// within ProducerConfig.PinTimeout are released.
//
// Sockets carry ZMTP heartbeats (2 s interval, 10 s timeout and TTL) and a
// monitor on each DEALER: EVENT_DISCONNECTED ends the session
// (transfer.ErrPeerLost on the client; pins released on the producer).
//
// # Data planes
//
// DataPlane moves the bytes; the consumer only registers memory. InProcess,
// the default, lets a producer and a consumer in one process copy memory
// through a process-wide registry of agents named in agent_metadata, so the
// protocol runs end to end over real sockets without NIXL. Built with
// -tags nixl, NewNIXL returns a data plane over NIXL's C API (UCX backend,
// DRAM registration, WRITE transfers by block index), interoperable with
// vLLM's NIXL agents. Memory registered with NIXL must live outside the Go
// heap: allocate it with AllocRegion.
//
// # Building with NIXL
//
// NIXL v1.4.0 builds libnixl_capi.so (src/bindings/rust, meson target
// nixl_capi) but installs no header or pkg-config file for it, so the
// declarations the package needs are in nixl.go; where wrapper.h is on the
// include path as <nixl_capi/wrapper.h> they are checked against it. With
// NIXL and UCX installed under $NIXL_PREFIX:
//
//	LIB=$NIXL_PREFIX/lib/x86_64-linux-gnu
//	export CGO_CFLAGS="-O2 -g -I$NIXL_PREFIX/include" CGO_LDFLAGS="-L$LIB"
//	export LD_LIBRARY_PATH=$LIB   # also finds libnixl_capi.so's own dependencies
//	go test -tags nixl -race ./transfer/...
//
// make test does this with the relocatable build in ../shared/nixl
// (scripts/nixl.sh extracts it into a cache outside the checkout and prints
// that environment), and says it skipped the NIXL tests where there is
// none. NIXL finds its UCX plugin beside libnixl.so: NIXL_PLUGIN_DIR is not
// needed.
//
// The nixl tests run two agents in one process over UCX loopback: raw
// WRITEs by block index, two Remotes of one peer, idle agents' CPU, and the
// protocol end to end with both sides on NIXL, including a consumer that
// reconnects while its old session is reaped. NIXLConfig.ProgressDelay
// keeps the backend's progress thread from spinning (NIXL's default agent
// spins a core per idle agent). Without the tag nothing refers to NIXL and
// the package builds anywhere libzmq does.
package p2p
