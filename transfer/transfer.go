package transfer

import (
	"context"
	"errors"
	"time"
)

// Sentinel errors. Errors returned by Client and Session implementations wrap
// one of these (and, where a context ended the call, the context's error too).
var (
	// ErrUnreachable: the peer could not be reached (nothing accepted the
	// connection before the handshake deadline).
	ErrUnreachable = errors.New("transfer: peer unreachable")
	// ErrHandshake: the peer was reached but did not complete the handshake
	// in time. vLLM answers a connect it rejects (block length, hash seed or
	// config fingerprint mismatch) with silence, so a rejection surfaces as
	// this error after the handshake timeout.
	ErrHandshake = errors.New("transfer: handshake rejected or timed out")
	// ErrPeerLost: an established session died (the peer disconnected, or
	// stopped answering heartbeats).
	ErrPeerLost = errors.New("transfer: peer lost")
	// ErrMissingKeys: a fetched key is not held by the peer, or was not a
	// pinned hit of the current round's lookups.
	ErrMissingKeys = errors.New("transfer: keys missing at peer")
	// ErrFetchFailed: the peer reported that the fetch failed. A vLLM peer
	// reports an unpinned key and a data-plane failure alike.
	ErrFetchFailed = errors.New("transfer: fetch failed at peer")
	// ErrAborted: the fetch was aborted (by Abort or because its context
	// ended) and the peer acknowledged; destination blocks may be reused.
	ErrAborted = errors.New("transfer: fetch aborted")
	// ErrClosed: the session or client was closed.
	ErrClosed = errors.New("transfer: closed")
	// ErrInvalid: the call's arguments are invalid (mismatched lengths, a
	// block index outside the destination region, a malformed key).
	ErrInvalid = errors.New("transfer: invalid argument")
)

// Client opens sessions to peers.
type Client interface {
	// Connect performs the handshake with peer (a "host:port" side-channel
	// address for vLLM peers, a name for fakes) and returns the session.
	Connect(ctx context.Context, peer string) (Session, error)
}

// Session is one consumer-side session with a peer. Lookup and Fetch are
// serialised (one round at a time); Abort and Close may be called
// concurrently with them.
type Session interface {
	// Peer returns the address the session was opened with.
	Peer() string
	// Lookup asks which keys the peer holds; hits[i] answers keys[i]. The
	// peer pins the hits for the current round until a Fetch closes it.
	Lookup(ctx context.Context, keys []Key) (hits []bool, err error)
	// Fetch pulls keys into the consumer's destination blocks: keys[i] is
	// written to block blockIndexes[i]. Every key must be a hit of the
	// current round's lookups. Fetch returns when all blocks are written and
	// closes the round. When ctx ends first, Fetch aborts the round and
	// waits for the peer's acknowledgement before returning an error
	// wrapping ErrAborted and ctx.Err(); a peer that never acknowledges is
	// lost (ErrPeerLost), and its writes may still land.
	//
	// Fetch with no keys ends the request: the peer releases its pins and
	// sends no reply. Call it after a lookup that is not followed by a fetch.
	Fetch(ctx context.Context, keys []Key, blockIndexes []int) (Stats, error)
	// Abort aborts the current round, including a Fetch in progress (which
	// then returns ErrAborted), and waits for the peer's acknowledgement.
	// The destination blocks of the round may be reused once Abort returns
	// nil.
	Abort(ctx context.Context) error
	// Close tells the peer the session ends and releases local resources.
	// Calls after Close return ErrClosed.
	Close() error
}

// Stats describe one call.
type Stats struct {
	Blocks   int           // blocks written into the destination
	Bytes    int64         // bytes written into the destination
	Duration time.Duration // from the request to the peer's completion
}

// Add returns the sum of s and o.
func (s Stats) Add(o Stats) Stats {
	return Stats{Blocks: s.Blocks + o.Blocks, Bytes: s.Bytes + o.Bytes, Duration: s.Duration + o.Duration}
}
