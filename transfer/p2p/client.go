//go:build cgo

package p2p

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvsource/kvsource/internal/ctxlock"
	"github.com/kvsource/kvsource/transfer"
)

// ClientConfig configures a Client: the consumer side of vLLM's P2P tier.
type ClientConfig struct {
	Endpoint
	// Memory is the destination region peers write into: block i is
	// Memory[i*BlockLen:(i+1)*BlockLen]. For a data plane that hands the
	// address to C (NIXL) it must come from AllocRegion.
	Memory []byte
	// BlockLen is the block size; it must equal the peers' block_len.
	BlockLen int
	// AbortTimeout bounds the wait for abort_ack after an abort_fetch;
	// a peer that does not acknowledge in time is considered lost.
	// Default 10 s, vLLM's _ABORT_ACK_TIMEOUT_S.
	AbortTimeout time.Duration
}

// ClientStats counts what a Client dropped.
type ClientStats struct {
	Malformed uint64 // messages that did not decode; the session was dropped
	Frames    uint64 // messages of more than one frame, dropped unread
	Unmatched uint64 // messages from an identity no session expects
	Stale     uint64 // replies for a request or round no call waits for
	Overflow  uint64 // replies dropped because a session's inbox was full
}

// Client is the consumer side of vLLM's P2P tier: it binds a ROUTER, dials
// peers, and receives their writes into its registered memory. It is safe
// for concurrent use; it holds at most one session per peer.
type Client struct {
	cfg ClientConfig
	reg region
	ep  *endpoint

	mu       sync.Mutex
	closed   bool
	sessions map[string]*session // by dialed address and by the peer's own identity

	malformed, unmatched, stale, overflow atomic.Uint64
}

var _ transfer.Client = (*Client)(nil)

// NewClient registers cfg.Memory with the data plane and binds the side
// channel.
func NewClient(cfg ClientConfig) (*Client, error) {
	cfg.Endpoint = cfg.Endpoint.withDefaults()
	if cfg.AbortTimeout <= 0 {
		cfg.AbortTimeout = 10 * time.Second
	}
	reg, err := register(cfg.DataPlane, cfg.Memory, cfg.BlockLen)
	if err != nil {
		return nil, fmt.Errorf("p2p client: %w", err)
	}
	c := &Client{cfg: cfg, reg: reg, sessions: make(map[string]*session)}
	c.ep, err = listen(cfg.Host, cfg.Port, cfg.Heartbeat, cfg.Logger)
	if err != nil {
		_ = cfg.DataPlane.Close()
		return nil, fmt.Errorf("p2p client: %w", err)
	}
	c.ep.start(c.onMessage)
	return c, nil
}

// ID returns the client's identity, "host:port" of its bound ROUTER.
func (c *Client) ID() string { return c.ep.id }

// NumBlocks returns the number of destination blocks.
func (c *Client) NumBlocks() int { return c.reg.numBlocks }

// Stats returns the client's counters.
func (c *Client) Stats() ClientStats {
	return ClientStats{Malformed: c.malformed.Load(), Frames: c.ep.dropped.Load(), Unmatched: c.unmatched.Load(), Stale: c.stale.Load(), Overflow: c.overflow.Load()}
}

// Close closes every session (each sends disconnect), the sockets and the
// data plane registration.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	var ss []*session
	for _, s := range c.sessions {
		ss = append(ss, s)
	}
	c.mu.Unlock()
	for _, s := range ss {
		_ = s.Close()
	}
	c.ep.close()
	return c.cfg.DataPlane.Close()
}

// Connect dials peer ("host:port" of its side channel), sends connect,
// answers the peer's connect with connect_ack, and returns once the peer
// acknowledged ours. A peer that never accepted the TCP connection fails
// with transfer.ErrUnreachable, one that did but stayed silent (vLLM's
// rejection) with transfer.ErrHandshake, after HandshakeTimeout or when ctx
// ends.
func (c *Client) Connect(ctx context.Context, peer string) (transfer.Session, error) {
	if _, _, ok := splitHostPort(peer); !ok {
		return nil, fmt.Errorf("p2p connect: %w: peer %q is not host:port", transfer.ErrInvalid, peer)
	}
	s := &session{
		c: c, addr: peer,
		inbox: make(chan message, 64),
		ready: make(chan struct{}),
		dead:  make(chan struct{}),
	}
	s.newRequest()
	c.mu.Lock()
	switch {
	case c.closed:
		c.mu.Unlock()
		return nil, fmt.Errorf("p2p connect %s: %w", peer, transfer.ErrClosed)
	case c.sessions[peer] != nil:
		c.mu.Unlock()
		return nil, fmt.Errorf("p2p connect %s: %w: a session to this peer is open", peer, transfer.ErrInvalid)
	}
	c.sessions[peer] = s
	c.mu.Unlock()

	d, err := c.ep.dial(peer, s.onEvent)
	if err != nil {
		c.forget(s)
		return nil, fmt.Errorf("p2p connect %s: %w: %w", peer, transfer.ErrUnreachable, err)
	}
	s.d.Store(d)
	if err := s.send(c.reg.connect(c.ep.id, c.cfg.Endpoint)); err != nil {
		s.shutdown(transfer.ErrClosed, false)
		return nil, fmt.Errorf("p2p connect %s: %w: %w", peer, transfer.ErrUnreachable, err)
	}
	timer := time.NewTimer(c.cfg.HandshakeTimeout)
	defer timer.Stop()
	var cause error
	select {
	case <-s.ready:
		return s, nil
	case <-s.dead:
		err := s.deadErr
		s.shutdown(transfer.ErrClosed, false)
		return nil, fmt.Errorf("p2p connect %s: %w: %w", peer, transfer.ErrHandshake, err)
	case <-timer.C:
		cause = fmt.Errorf("no connect_ack after %v", c.cfg.HandshakeTimeout)
	case <-ctx.Done():
		cause = ctx.Err()
	}
	sentinel := transfer.ErrHandshake
	if !s.connected.Load() {
		sentinel = transfer.ErrUnreachable
	}
	// A best-effort disconnect: a peer that accepted us late must not keep
	// the session.
	s.shutdown(transfer.ErrClosed, true)
	return nil, fmt.Errorf("p2p connect %s: %w: %w", peer, sentinel, cause)
}

func (c *Client) forget(s *session) {
	c.mu.Lock()
	for k, v := range c.sessions {
		if v == s {
			delete(c.sessions, k)
		}
	}
	c.mu.Unlock()
}

// match finds the session a message from identity from belongs to. A peer's
// replies carry its configured identity, which may differ from the address
// we dialed (a name for an IP, another host alias): an unknown identity is
// bound to the handshaking session with the same port, else to the only
// handshaking session.
func (c *Client) match(from string) *session {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s := c.sessions[from]; s != nil {
		if s.remoteID.Load() == nil {
			s.remoteID.Store(&from)
		}
		return s
	}
	_, port, ok := splitHostPort(from)
	if !ok {
		// Peers name themselves "host:port"; anything else is a connection
		// a reconnecting peer replaced (see listen), or a stranger.
		return nil
	}
	var byPort, pending []*session
	for k, s := range c.sessions {
		// Only a session still waiting for its peer's first message can
		// take a new identity.
		if k != s.addr || s.remoteID.Load() != nil {
			continue
		}
		pending = append(pending, s)
		if _, p, _ := splitHostPort(s.addr); p == port {
			byPort = append(byPort, s)
		}
	}
	var s *session
	switch {
	case len(byPort) == 1:
		s = byPort[0]
	case len(pending) == 1:
		s = pending[0]
	default:
		return nil
	}
	s.remoteID.Store(&from)
	c.sessions[from] = s
	return s
}

func (c *Client) onMessage(from string, data []byte) {
	s := c.match(from)
	if s == nil {
		c.unmatched.Add(1)
		c.cfg.Logger.Warn("p2p client: message from unknown peer", "peer", from)
		return
	}
	m, err := decodeMessage(data)
	if err != nil {
		c.malformed.Add(1)
		c.cfg.Logger.Warn("p2p client: malformed message, dropping session", "peer", from, "err", err)
		s.shutdown(fmt.Errorf("%w: %w", transfer.ErrPeerLost, err), true)
		return
	}
	switch m.Type {
	case TypeConnect:
		s.onConnect(m)
	case TypeConnectAck:
		s.hsMu.Lock()
		s.gotAck = true
		s.hsMu.Unlock()
		s.checkReady()
	case TypeLookupResp, TypeTransferDone, TypeAbortAck:
		select {
		case s.inbox <- m:
		default:
			c.overflow.Add(1)
			c.cfg.Logger.Warn("p2p client: inbox full, dropped reply", "peer", from, "type", m.Type, "kv_request_id", m.KVRequestID)
		}
	case TypeDisconnect:
		s.shutdown(fmt.Errorf("%w: peer sent disconnect", transfer.ErrPeerLost), false)
	default:
		c.cfg.Logger.Warn("p2p client: ignored message", "peer", from, "type", m.Type)
	}
}

// session is a consumer session with one peer.
type session struct {
	c        *Client
	addr     string
	remoteID atomic.Pointer[string]
	d        atomic.Pointer[dealer] // nil until dialed

	inbox     chan message
	connected atomic.Bool // the monitor saw the TCP connection

	hsMu       sync.Mutex
	gotAck     bool // the peer acknowledged our connect
	gotConnect bool // we acknowledged the peer's connect
	ready      chan struct{}

	deadOnce sync.Once
	dead     chan struct{}
	deadErr  error

	// callMu serialises Lookup, Fetch and a standalone Abort; it guards the
	// request state below.
	callMu    sync.Mutex
	reqID     string
	round     uint64
	roundHits map[string]bool

	st       sync.Mutex
	closed   bool
	inflight context.CancelCauseFunc
	fetchEnd chan struct{}
	abortErr error
}

var _ transfer.Session = (*session)(nil)

func (s *session) Peer() string { return s.addr }

func (s *session) newRequest() {
	var b [8]byte
	_, _ = rand.Read(b[:])
	s.reqID = "kvsource-" + hex.EncodeToString(b[:])
	s.round = 0
	s.roundHits = make(map[string]bool)
}

func (s *session) send(m message) error {
	b, err := m.encode()
	if err != nil {
		return err
	}
	d := s.d.Load()
	if d == nil {
		return errDealerClosed
	}
	return d.send(b)
}

func (s *session) onEvent(ev zmq.Event) {
	switch ev {
	case zmq.EVENT_CONNECTED:
		s.connected.Store(true)
	case zmq.EVENT_DISCONNECTED:
		s.shutdown(fmt.Errorf("%w: connection to %s lost", transfer.ErrPeerLost, s.addr), false)
	}
}

func (s *session) onConnect(m message) {
	c := s.c
	if err := checkConnect(m, c.reg, c.cfg.Endpoint); err != nil {
		c.cfg.Logger.Warn("p2p client: rejecting peer connect", "peer", s.addr, "err", err)
		s.shutdown(fmt.Errorf("peer's connect rejected: %w", err), false)
		return
	}
	s.hsMu.Lock()
	dup := s.gotConnect
	s.gotConnect = true
	s.hsMu.Unlock()
	if dup {
		c.cfg.Logger.Warn("p2p client: duplicate connect after handshake", "peer", s.addr)
		s.shutdown(fmt.Errorf("%w: duplicate connect after handshake", transfer.ErrPeerLost), true)
		return
	}
	if err := s.send(message{Type: TypeConnectAck, PeerID: c.ep.id}); err != nil {
		s.shutdown(fmt.Errorf("%w: %w", transfer.ErrPeerLost, err), false)
		return
	}
	s.checkReady()
}

func (s *session) checkReady() {
	s.hsMu.Lock()
	defer s.hsMu.Unlock()
	if s.gotAck && s.gotConnect {
		select {
		case <-s.ready:
		default:
			close(s.ready)
		}
	}
}

// shutdown ends the session once: waiters see err at once, the peer gets a
// disconnect when sendDisconnect, and the dealer is closed in the
// background (it waits for the monitor goroutine, which may be the caller).
func (s *session) shutdown(err error, sendDisconnect bool) {
	s.deadOnce.Do(func() {
		s.deadErr = err
		close(s.dead)
		s.c.forget(s)
		if d := s.d.Load(); d != nil {
			if sendDisconnect {
				_ = s.send(message{Type: TypeDisconnect})
			}
			go d.close()
		}
	})
}

// failure returns the error a call sees when the session ended.
func (s *session) failure() error {
	s.st.Lock()
	closed := s.closed
	s.st.Unlock()
	if closed {
		return transfer.ErrClosed
	}
	return s.deadErr
}

func (s *session) alive() error {
	select {
	case <-s.dead:
		return s.failure()
	default:
		return nil
	}
}

// await returns the first inbox message accept takes, discarding the rest
// as stale.
func (s *session) await(ctx context.Context, accept func(message) bool) (message, error) {
	for {
		select {
		case m := <-s.inbox:
			if accept(m) {
				return m, nil
			}
			s.c.stale.Add(1)
		case <-s.dead:
			return message{}, s.failure()
		case <-ctx.Done():
			return message{}, context.Cause(ctx)
		}
	}
}

// endRequest closes the current request with an empty fetch (no reply) and
// starts a new one, so late replies to it are recognisably stale.
func (s *session) endRequest() error {
	err := s.send(message{Type: TypeFetch, KVRequestID: s.reqID, Keys: [][]byte{}, BlockIndexes: []uint64{}, RoundSeq: s.round})
	s.newRequest()
	return err
}

func (s *session) Lookup(ctx context.Context, keys []transfer.Key) ([]bool, error) {
	wire := make([][]byte, len(keys))
	for i, k := range keys {
		if !k.Valid() {
			return nil, fmt.Errorf("lookup at %s: %w: key %d is %d bytes", s.addr, transfer.ErrInvalid, i, len(k))
		}
		wire[i] = k
	}
	s.callMu.Lock()
	defer s.callMu.Unlock()
	if err := s.alive(); err != nil {
		return nil, fmt.Errorf("lookup at %s: %w", s.addr, err)
	}
	req := s.reqID
	if err := s.send(message{Type: TypeLookup, KVRequestID: req, Keys: wire, RoundSeq: s.round}); err != nil {
		return nil, fmt.Errorf("lookup at %s: %w: %w", s.addr, transfer.ErrPeerLost, err)
	}
	m, err := s.await(ctx, func(m message) bool { return m.Type == TypeLookupResp && m.KVRequestID == req })
	if err != nil {
		if ctx.Err() != nil {
			// The answer may still come and its pins must go: end the request.
			_ = s.endRequest()
		}
		return nil, fmt.Errorf("lookup at %s: %w", s.addr, err)
	}
	if len(m.Keys) != len(keys) {
		err := fmt.Errorf("%w: lookup_resp with %d keys for %d", ErrMalformed, len(m.Keys), len(keys))
		s.shutdown(fmt.Errorf("%w: %w", transfer.ErrPeerLost, err), true)
		return nil, fmt.Errorf("lookup at %s: %w", s.addr, err)
	}
	for i, k := range m.Keys {
		if string(k) != string(keys[i]) {
			err := fmt.Errorf("%w: lookup_resp key %d differs from the lookup's", ErrMalformed, i)
			s.shutdown(fmt.Errorf("%w: %w", transfer.ErrPeerLost, err), true)
			return nil, fmt.Errorf("lookup at %s: %w", s.addr, err)
		}
		if m.Hits[i] {
			s.roundHits[string(k)] = true
		}
	}
	return m.Hits, nil
}

func (s *session) Fetch(ctx context.Context, keys []transfer.Key, blockIndexes []int) (transfer.Stats, error) {
	if len(keys) != len(blockIndexes) {
		return transfer.Stats{}, fmt.Errorf("fetch from %s: %w: %d keys, %d block indexes", s.addr, transfer.ErrInvalid, len(keys), len(blockIndexes))
	}
	wire := make([][]byte, len(keys))
	idx := make([]uint64, len(keys))
	for i, k := range keys {
		if !k.Valid() {
			return transfer.Stats{}, fmt.Errorf("fetch from %s: %w: key %d is %d bytes", s.addr, transfer.ErrInvalid, i, len(k))
		}
		b := blockIndexes[i]
		if b < 0 || b >= s.c.reg.numBlocks {
			return transfer.Stats{}, fmt.Errorf("fetch from %s: %w: block index %d outside 0..%d", s.addr, transfer.ErrInvalid, b, s.c.reg.numBlocks-1)
		}
		wire[i], idx[i] = k, uint64(b)
	}
	s.callMu.Lock()
	defer s.callMu.Unlock()
	if err := s.alive(); err != nil {
		return transfer.Stats{}, fmt.Errorf("fetch from %s: %w", s.addr, err)
	}
	if len(keys) == 0 {
		if err := s.endRequest(); err != nil {
			return transfer.Stats{}, fmt.Errorf("fetch from %s: %w: %w", s.addr, transfer.ErrPeerLost, err)
		}
		return transfer.Stats{}, nil
	}

	fctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	end := make(chan struct{})
	s.st.Lock()
	s.inflight, s.fetchEnd, s.abortErr = cancel, end, nil
	s.st.Unlock()
	defer func() {
		s.st.Lock()
		s.inflight = nil
		s.st.Unlock()
		close(end)
	}()

	req, round := s.reqID, s.round
	start := time.Now()
	if err := s.send(message{Type: TypeFetch, KVRequestID: req, Keys: wire, BlockIndexes: idx, RoundSeq: round}); err != nil {
		return transfer.Stats{}, fmt.Errorf("fetch from %s: %w: %w", s.addr, transfer.ErrPeerLost, err)
	}
	m, err := s.await(fctx, func(m message) bool {
		return m.Type == TypeTransferDone && m.KVRequestID == req && m.RoundSeq == round
	})
	if err != nil {
		if fctx.Err() == nil {
			return transfer.Stats{}, fmt.Errorf("fetch from %s: %w", s.addr, err)
		}
		err = s.abortRound(req, round, context.Cause(fctx))
		s.st.Lock()
		s.abortErr = err
		s.st.Unlock()
		return transfer.Stats{}, fmt.Errorf("fetch from %s: %w", s.addr, err)
	}
	hits := s.roundHits
	s.round++
	s.roundHits = make(map[string]bool)
	if !m.Success {
		for i, k := range keys {
			if !hits[string(k)] {
				return transfer.Stats{}, fmt.Errorf("fetch from %s: %w: key %d (%v) was not a hit of round %d", s.addr, transfer.ErrMissingKeys, i, k, round)
			}
		}
		return transfer.Stats{}, fmt.Errorf("fetch from %s: %w: round %d", s.addr, transfer.ErrFetchFailed, round)
	}
	s.c.cfg.DataPlane.Sync()
	return transfer.Stats{Blocks: len(keys), Bytes: int64(len(keys)) * int64(s.c.reg.blockLen), Duration: time.Since(start)}, nil
}

// abortRound sends abort_fetch for (req, round) and waits for its
// abort_ack. It returns an error wrapping transfer.ErrAborted (and cause),
// or transfer.ErrPeerLost when the peer does not acknowledge in time.
// callMu is held.
func (s *session) abortRound(req string, round uint64, cause error) error {
	s.round++
	s.roundHits = make(map[string]bool)
	if err := s.send(message{Type: TypeAbortFetch, KVRequestID: req, RoundSeq: round}); err != nil {
		return fmt.Errorf("%w: abort_fetch: %w", transfer.ErrPeerLost, err)
	}
	actx, cancel := context.WithTimeout(context.Background(), s.c.cfg.AbortTimeout)
	defer cancel()
	_, err := s.await(actx, func(m message) bool {
		return m.Type == TypeAbortAck && m.KVRequestID == req && m.RoundSeq == round
	})
	if err != nil {
		if actx.Err() != nil {
			err = fmt.Errorf("%w: no abort_ack after %v", transfer.ErrPeerLost, s.c.cfg.AbortTimeout)
			s.shutdown(err, true)
		}
		return errors.Join(err, cause)
	}
	if cause == nil || errors.Is(cause, transfer.ErrAborted) {
		return transfer.ErrAborted
	}
	return fmt.Errorf("%w: %w", transfer.ErrAborted, cause)
}

func (s *session) Abort(ctx context.Context) error {
	s.st.Lock()
	if s.closed {
		s.st.Unlock()
		return transfer.ErrClosed
	}
	cancel, end := s.inflight, s.fetchEnd
	s.st.Unlock()
	if cancel != nil {
		cancel(transfer.ErrAborted)
		select {
		case <-end:
		case <-ctx.Done():
			return fmt.Errorf("abort at %s: %w", s.addr, ctx.Err())
		}
		s.st.Lock()
		err := s.abortErr
		s.st.Unlock()
		if err == nil || errors.Is(err, transfer.ErrAborted) {
			return nil
		}
		return fmt.Errorf("abort at %s: %w", s.addr, err)
	}
	if err := ctxlock.Lock(ctx, &s.callMu); err != nil {
		return fmt.Errorf("abort at %s: %w", s.addr, err)
	}
	defer s.callMu.Unlock()
	if err := s.alive(); err != nil {
		return fmt.Errorf("abort at %s: %w", s.addr, err)
	}
	if err := s.abortRound(s.reqID, s.round, nil); !errors.Is(err, transfer.ErrAborted) {
		return fmt.Errorf("abort at %s: %w", s.addr, err)
	}
	return nil
}

func (s *session) Close() error {
	s.st.Lock()
	if s.closed {
		s.st.Unlock()
		return nil
	}
	s.closed = true
	if s.inflight != nil {
		s.inflight(transfer.ErrClosed)
	}
	s.st.Unlock()
	s.shutdown(transfer.ErrClosed, true)
	return nil
}
