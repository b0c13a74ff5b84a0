//go:build cgo

package p2p

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvsource/kvsource/transfer"
)

// ProducerConfig configures a Producer: the serving side of vLLM's P2P tier.
type ProducerConfig struct {
	Endpoint
	// Store holds the blocks served. Its memory is registered with the
	// data plane; its BlockLen is the block_len consumers must match.
	Store BlockStore
	// PinTimeout releases the pins of a round that no fetch claimed, as
	// vLLM's store job times out. A later fetch of the round fails.
	// Default 30 s, vLLM's _STORE_TIMEOUT_S.
	PinTimeout time.Duration
	// CancelDrainTimeout bounds the wait for an aborted round's writes to
	// stop before abort_ack is sent anyway. Default 10 s, vLLM's
	// _CANCEL_DRAIN_TIMEOUT_S.
	CancelDrainTimeout time.Duration
	// RejectLinger bounds how long the connection to a rejected consumer
	// stays open to deliver the producer's connect, sent before the check:
	// vLLM's consumer learns of a mismatch (seed, block_len, fingerprint)
	// only from that connect, and then misses at once instead of retrying
	// its lookups forever. A consumer that cannot be reached for this long
	// never gets it; Close gives up at once. Default 5 s. (vLLM's own
	// DEALERs linger without bound.)
	RejectLinger time.Duration
}

// ProducerStats counts a Producer's work and what it refused.
type ProducerStats struct {
	Sessions      uint64 // handshakes completed
	Rejected      uint64 // connects rejected (silently, as vLLM does)
	Lookups       uint64
	LookupKeys    uint64
	LookupHits    uint64
	Fetches       uint64 // non-empty fetches whose transfer succeeded
	FetchFailures uint64 // transfer_done success=false sent
	Blocks        uint64 // blocks written to consumers
	Aborts        uint64 // abort_ack sent
	Malformed     uint64 // messages that did not decode or validate; the session was dropped
	Frames        uint64 // messages of more than one frame, dropped unread
	Ignored       uint64 // messages of unknown or misdirected type, or from no session
	PinsExpired   uint64 // rounds whose pins timed out
	Lost          uint64 // sessions reaped after the connection was lost
	Replaced      uint64 // sessions ended by a new connect from the same consumer
}

type producerCounters struct {
	sessions, rejected, lookups, lookupKeys, lookupHits, fetches, fetchFailures atomic.Uint64
	blocks, aborts, malformed, ignored, pinsExpired, lost, replaced             atomic.Uint64
}

// Producer serves blocks from a BlockStore to consumers speaking vLLM's P2P
// control protocol: it answers lookups (pinning hits for their round),
// writes fetched blocks into the consumer's memory through the data plane,
// and honours abort_fetch and disconnect.
type Producer struct {
	cfg ProducerConfig
	reg region
	ep  *endpoint
	c   producerCounters

	mu       sync.Mutex
	closed   bool
	sessions map[string]*peerSession // by consumer identity

	stop    chan struct{}
	wg      sync.WaitGroup // sweep
	reaping sync.WaitGroup // sessions ending: transfers stopping, remotes closing
}

// NewProducer registers the store's memory with the data plane and binds
// the side channel.
func NewProducer(cfg ProducerConfig) (*Producer, error) {
	cfg.Endpoint = cfg.Endpoint.withDefaults()
	if cfg.Store == nil {
		return nil, fmt.Errorf("p2p producer: %w: no store", transfer.ErrInvalid)
	}
	if cfg.PinTimeout <= 0 {
		cfg.PinTimeout = 30 * time.Second
	}
	if cfg.CancelDrainTimeout <= 0 {
		cfg.CancelDrainTimeout = 10 * time.Second
	}
	if cfg.RejectLinger <= 0 {
		cfg.RejectLinger = 5 * time.Second
	}
	reg, err := register(cfg.DataPlane, cfg.Store.Memory(), cfg.Store.BlockLen())
	if err != nil {
		return nil, fmt.Errorf("p2p producer: %w", err)
	}
	p := &Producer{cfg: cfg, reg: reg, sessions: make(map[string]*peerSession), stop: make(chan struct{})}
	p.ep, err = listen(cfg.Host, cfg.Port, cfg.Heartbeat, cfg.Logger)
	if err != nil {
		_ = cfg.DataPlane.Close()
		return nil, fmt.Errorf("p2p producer: %w", err)
	}
	p.ep.start(p.onMessage)
	p.wg.Add(1)
	go p.sweep()
	return p, nil
}

// ID returns the producer's identity, "host:port" of its bound ROUTER:
// the address consumers dial.
func (p *Producer) ID() string { return p.ep.id }

// Stats returns the producer's counters.
func (p *Producer) Stats() ProducerStats {
	c := &p.c
	return ProducerStats{
		Sessions: c.sessions.Load(), Rejected: c.rejected.Load(), Lookups: c.lookups.Load(),
		LookupKeys: c.lookupKeys.Load(), LookupHits: c.lookupHits.Load(), Fetches: c.fetches.Load(),
		FetchFailures: c.fetchFailures.Load(), Blocks: c.blocks.Load(), Aborts: c.aborts.Load(),
		Malformed: c.malformed.Load(), Frames: p.ep.dropped.Load(), Ignored: c.ignored.Load(), PinsExpired: c.pinsExpired.Load(), Lost: c.lost.Load(),
		Replaced: c.replaced.Load(),
	}
}

// Close sends disconnect to every consumer, cancels running transfers,
// releases every pin and closes the sockets and the data plane.
func (p *Producer) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	ss := make([]*peerSession, 0, len(p.sessions))
	for _, s := range p.sessions {
		ss = append(ss, s)
	}
	p.mu.Unlock()
	for _, s := range ss {
		p.reap(s, "producer closing", sayDisconnect)
	}
	close(p.stop)
	p.wg.Wait()
	// Cancelled writes must stop before the data plane goes away; one that
	// does not within the drain timeout is abandoned, as vLLM does.
	drained := make(chan struct{})
	go func() {
		p.reaping.Wait()
		close(drained)
	}()
	t := time.NewTimer(p.cfg.CancelDrainTimeout)
	select {
	case <-drained:
	case <-t.C:
		p.cfg.Logger.Warn("p2p producer: closing with transfers still draining")
	}
	t.Stop()
	p.ep.close()
	return p.cfg.DataPlane.Close()
}

// sweep reaps sessions whose handshake never completed and expires pins of
// rounds nobody fetched.
func (p *Producer) sweep() {
	defer p.wg.Done()
	tick := min(p.cfg.PinTimeout, p.cfg.HandshakeTimeout) / 4
	tick = max(tick, 10*time.Millisecond)
	tick = min(tick, time.Second)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case now := <-t.C:
			p.mu.Lock()
			ss := make([]*peerSession, 0, len(p.sessions))
			for _, s := range p.sessions {
				ss = append(ss, s)
			}
			p.mu.Unlock()
			for _, s := range ss {
				s.mu.Lock()
				stale := !s.acked && now.Sub(s.created) > p.cfg.HandshakeTimeout
				for rk, r := range s.rounds {
					if r.running == nil && now.Sub(r.pinnedAt) > p.cfg.PinTimeout {
						p.release(r)
						delete(s.rounds, rk)
						p.c.pinsExpired.Add(1)
						p.cfg.Logger.Warn("p2p producer: pins expired", "peer", s.id, "kv_request_id", rk.req, "round_seq", rk.seq)
					}
				}
				s.mu.Unlock()
				if stale {
					p.reap(s, "handshake timed out", sayNothing)
				}
			}
		}
	}
}

type roundKey struct {
	req string
	seq uint64
}

// round is the supply a (kv_request_id, round_seq) parked by its lookups,
// and its transfer once fetched. A round is forgotten when it ends (its
// transfer_done or abort_ack, an empty fetch, expired pins), so the same
// round_seq may open a new round: vLLM's consumer restarts a request's
// rounds at 0 on each load.
type round struct {
	supply   map[string]int // key -> pinned slot
	pinnedAt time.Time
	running  chan struct{} // closed when the round's transfer ends; nil when idle
	cancel   context.CancelFunc
	aborted  bool
}

// peerSession is the producer's session with one consumer.
type peerSession struct {
	id      string
	d       *dealer // set before the session is published
	created time.Time

	mu         sync.Mutex
	acked      bool // the consumer acknowledged our connect
	handshaken bool // we acknowledged the consumer's connect
	queue      [][]byte
	remote     Remote
	numBlocks  int
	rounds     map[roundKey]*round
	dead       bool
}

func (p *Producer) onMessage(from string, data []byte) {
	p.mu.Lock()
	s := p.sessions[from]
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return
	}
	m, err := decodeMessage(data)
	if err != nil {
		p.c.malformed.Add(1)
		p.cfg.Logger.Warn("p2p producer: malformed message", "peer", from, "err", err)
		if s != nil {
			p.reap(s, "malformed message", sayDisconnect)
		}
		return
	}
	if s == nil {
		if m.Type != TypeConnect {
			p.c.ignored.Add(1)
			p.cfg.Logger.Warn("p2p producer: message before connect", "peer", from, "type", m.Type)
			return
		}
		p.onConnect(from, m)
		return
	}
	switch m.Type {
	case TypeConnect:
		// The consumer started a new session under its identity (it closed
		// the old one and reconnected, or restarted at the same address):
		// the ROUTER's handover gave the identity to the new connection, so
		// the old session has no consumer left. It is replaced without a
		// disconnect, which would reach the new session.
		p.c.replaced.Add(1)
		p.cfg.Logger.Info("p2p producer: connect replaces the consumer's session", "peer", from)
		p.reap(s, "replaced by a new connect", sayNothing)
		p.onConnect(from, m)
	case TypeConnectAck:
		s.mu.Lock()
		s.acked = true
		q := s.queue
		s.queue = nil
		for _, b := range q {
			if err := s.d.send(b); err != nil {
				p.cfg.Logger.Warn("p2p producer: send", "peer", from, "err", err)
			}
		}
		s.mu.Unlock()
	case TypeLookup:
		p.onLookup(s, m)
	case TypeFetch:
		p.onFetch(s, m)
	case TypeAbortFetch:
		go p.onAbort(s, m)
	case TypeDisconnect:
		p.reap(s, "peer sent disconnect", sayNothing)
	default:
		p.c.ignored.Add(1)
		p.cfg.Logger.Warn("p2p producer: ignored message", "peer", from, "type", m.Type)
	}
}

// onConnect creates the session, which sends our connect at once, then
// checks the consumer's connect. A rejection is silent: no connect_ack, no
// disconnect, as vLLM does.
func (p *Producer) onConnect(from string, m message) {
	if _, _, ok := splitHostPort(from); !ok {
		p.c.rejected.Add(1)
		p.cfg.Logger.Warn("p2p producer: rejecting peer connect: identity is not host:port", "peer", from)
		return
	}
	s := &peerSession{id: from, created: time.Now(), rounds: make(map[roundKey]*round)}
	published := make(chan struct{})
	d, err := p.ep.dial(from, func(ev zmq.Event) {
		if ev == zmq.EVENT_DISCONNECTED {
			s.mu.Lock()
			dead := s.dead
			s.mu.Unlock()
			if dead {
				// A rejected session's connection, kept to deliver our
				// connect: it was not lost, it had ended.
				return
			}
			p.c.lost.Add(1)
			go func() {
				<-published
				p.reap(s, "connection lost", sayNothing)
			}()
		}
	})
	if err != nil {
		p.c.rejected.Add(1)
		p.cfg.Logger.Warn("p2p producer: rejecting peer connect: dial back", "peer", from, "err", err)
		return
	}
	s.d = d
	close(published)
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		d.close()
		return
	}
	p.sessions[from] = s
	p.mu.Unlock()
	_ = s.sendNow(p.reg.connect(p.ep.id, p.cfg.Endpoint))

	reject := func(err error) {
		p.c.rejected.Add(1)
		p.cfg.Logger.Warn("p2p producer: rejecting peer connect", "peer", from, "err", err)
		p.reap(s, "connect rejected", deliverSent)
	}
	if err := checkConnect(m, p.reg, p.cfg.Endpoint); err != nil {
		reject(err)
		return
	}
	n, _ := toInt(m.NumBlocks)
	remote, err := p.cfg.DataPlane.AddRemote(m.AgentMetadata, m.BaseAddr, n, int(m.BlockLen))
	if err != nil {
		reject(err)
		return
	}
	s.mu.Lock()
	if s.dead {
		// Reaped while the metadata loaded (connection lost, producer
		// closing): the reaper saw no remote to unload.
		s.mu.Unlock()
		_ = remote.Close()
		return
	}
	s.remote, s.numBlocks, s.handshaken = remote, n, true
	s.mu.Unlock()
	if err := s.sendNow(message{Type: TypeConnectAck, PeerID: p.ep.id}); err != nil {
		p.reap(s, "send connect_ack", sayNothing)
		return
	}
	p.c.sessions.Add(1)
}

// sendNow sends m at once, bypassing the queue that holds replies until the
// consumer acknowledged our connect: for the handshake and disconnect.
func (s *peerSession) sendNow(m message) error {
	b, err := m.encode()
	if err != nil {
		return err
	}
	return s.d.send(b)
}

// sendLocked sends m now, or queues it until the consumer acknowledged our
// connect. s.mu is held.
func (p *Producer) sendLocked(s *peerSession, m message) {
	b, err := m.encode()
	if err != nil {
		p.cfg.Logger.Error("p2p producer: encode", "type", m.Type, "err", err)
		return
	}
	if !s.acked {
		s.queue = append(s.queue, b)
		return
	}
	if err := s.d.send(b); err != nil {
		p.cfg.Logger.Warn("p2p producer: send", "peer", s.id, "type", m.Type, "err", err)
	}
}

func (p *Producer) onLookup(s *peerSession, m message) {
	rk := roundKey{m.KVRequestID, m.RoundSeq}
	hits := make([]bool, len(m.Keys))
	n := 0
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead {
		return
	}
	r := s.rounds[rk]
	if r == nil {
		r = &round{supply: make(map[string]int)}
		s.rounds[rk] = r
	}
	r.pinnedAt = time.Now()
	for i, k := range m.Keys {
		if _, ok := r.supply[string(k)]; ok {
			hits[i] = true
		} else if slot, ok := p.cfg.Store.Pin(k); ok {
			r.supply[string(k)] = slot
			hits[i] = true
		}
		if hits[i] {
			n++
		}
	}
	p.c.lookups.Add(1)
	p.c.lookupKeys.Add(uint64(len(m.Keys)))
	p.c.lookupHits.Add(uint64(n))
	p.sendLocked(s, message{Type: TypeLookupResp, KVRequestID: m.KVRequestID, Keys: m.Keys, Hits: hits})
}

// release unpins a round's supply.
func (p *Producer) release(r *round) {
	for _, slot := range r.supply {
		p.cfg.Store.Unpin(slot)
	}
	r.supply = nil
}

func (p *Producer) onFetch(s *peerSession, m message) {
	rk := roundKey{m.KVRequestID, m.RoundSeq}
	s.mu.Lock()
	if s.dead {
		s.mu.Unlock()
		return
	}
	if len(m.Keys) == 0 {
		// The request is finished: release every idle round of it.
		for k, r := range s.rounds {
			if k.req == rk.req && r.running == nil {
				p.release(r)
				delete(s.rounds, k)
			}
		}
		s.mu.Unlock()
		return
	}
	var bad error
	for i, b := range m.BlockIndexes {
		if b >= uint64(s.numBlocks) {
			bad = fmt.Errorf("%w: block index %d (key %d) outside the consumer's %d blocks", ErrMalformed, b, i, s.numBlocks)
			break
		}
	}
	// Only a round still open holds a fetch: one that ended was forgotten,
	// and vLLM's consumer opens it again on the request's next load (its
	// own producer, too, refuses a second fetch only while the round is
	// open).
	if r := s.rounds[rk]; bad == nil && r != nil && r.running != nil {
		bad = fmt.Errorf("%w: duplicate fetch for round %d", ErrMalformed, rk.seq)
	}
	if bad != nil {
		s.mu.Unlock()
		p.c.malformed.Add(1)
		p.cfg.Logger.Warn("p2p producer: bad fetch", "peer", s.id, "kv_request_id", rk.req, "round_seq", rk.seq, "err", bad)
		p.reap(s, "bad fetch", sayDisconnect)
		return
	}
	r := s.rounds[rk]
	src := make([]int, len(m.Keys))
	dst := make([]int, len(m.Keys))
	missing := r == nil
	for i, k := range m.Keys {
		if missing {
			break
		}
		slot, ok := r.supply[string(k)]
		if !ok {
			missing = true
			break
		}
		src[i], dst[i] = slot, int(m.BlockIndexes[i])
	}
	if missing {
		if r != nil {
			p.release(r)
			delete(s.rounds, rk)
		}
		p.c.fetchFailures.Add(1)
		p.cfg.Logger.Warn("p2p producer: fetch of a key not pinned in its round", "peer", s.id, "kv_request_id", rk.req, "round_seq", rk.seq)
		p.sendLocked(s, message{Type: TypeTransferDone, KVRequestID: rk.req, Success: false, RoundSeq: rk.seq})
		s.mu.Unlock()
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.running, r.cancel = make(chan struct{}), cancel
	remote := s.remote
	s.mu.Unlock()
	go func() {
		err := remote.Write(ctx, src, dst)
		cancel()
		p.finish(s, rk, r, len(src), err)
	}()
}

// finish ends a round's transfer: pins are released and, unless the round
// was aborted or the session ended, transfer_done reports the outcome.
func (p *Producer) finish(s *peerSession, rk roundKey, r *round, blocks int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p.release(r)
	if s.rounds[rk] == r {
		delete(s.rounds, rk)
	}
	close(r.running)
	if r.aborted || s.dead {
		return
	}
	if err != nil {
		p.c.fetchFailures.Add(1)
		p.cfg.Logger.Warn("p2p producer: transfer failed", "peer", s.id, "kv_request_id", rk.req, "round_seq", rk.seq, "err", err)
	} else {
		p.c.fetches.Add(1)
		p.c.blocks.Add(uint64(blocks))
	}
	p.sendLocked(s, message{Type: TypeTransferDone, KVRequestID: rk.req, Success: err == nil, RoundSeq: rk.seq})
}

// onAbort cancels the round's transfer, waits (bounded) for its writes to
// stop, releases its pins and always acknowledges, even unknown rounds.
func (p *Producer) onAbort(s *peerSession, m message) {
	rk := roundKey{m.KVRequestID, m.RoundSeq}
	s.mu.Lock()
	r := s.rounds[rk]
	var running chan struct{}
	if r != nil {
		r.aborted = true
		if r.running != nil {
			running = r.running
			r.cancel()
		} else {
			p.release(r)
			delete(s.rounds, rk)
		}
	}
	s.mu.Unlock()
	if running != nil {
		t := time.NewTimer(p.cfg.CancelDrainTimeout)
		select {
		case <-running:
		case <-t.C:
			p.cfg.Logger.Warn("p2p producer: aborted transfer still draining, acknowledging anyway", "peer", s.id, "kv_request_id", rk.req, "round_seq", rk.seq)
		}
		t.Stop()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead {
		return
	}
	p.c.aborts.Add(1)
	p.sendLocked(s, message{Type: TypeAbortAck, KVRequestID: rk.req, RoundSeq: rk.seq})
}

// farewell is what the end of a session still owes the consumer.
type farewell int

const (
	// sayNothing: the consumer left, or never answered.
	sayNothing farewell = iota
	// sayDisconnect: a disconnect, best effort, as vLLM sends one.
	sayDisconnect
	// deliverSent: nothing new, but what was sent (our connect to a
	// rejected consumer) is delivered before the connection closes, within
	// RejectLinger.
	deliverSent
)

// reap ends a session: running transfers are cancelled, pins released once
// they stop, the peer unloaded and the dealer closed, after the farewell.
func (p *Producer) reap(s *peerSession, reason string, bye farewell) {
	// p.mu is held across the Add so that Close, which takes p.mu before it
	// waits, is ordered after every drain it must wait for.
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.sessions[s.id] == s {
		delete(p.sessions, s.id)
	}
	s.mu.Lock()
	if s.dead {
		s.mu.Unlock()
		return
	}
	s.dead = true
	p.reaping.Add(1)
	var running []chan struct{}
	for rk, r := range s.rounds {
		if r.running != nil {
			r.cancel()
			running = append(running, r.running)
		} else {
			p.release(r)
			delete(s.rounds, rk)
		}
	}
	remote := s.remote
	s.mu.Unlock()
	if bye == sayDisconnect {
		_ = s.sendNow(message{Type: TypeDisconnect})
	}
	p.cfg.Logger.Info("p2p producer: session ended", "peer", s.id, "reason", reason)
	go func() {
		defer p.reaping.Done()
		for _, ch := range running {
			<-ch
		}
		if remote != nil {
			_ = remote.Close()
		}
		if bye == deliverSent {
			s.d.closeFlushed(p.cfg.RejectLinger, p.stop)
		} else {
			s.d.close()
		}
	}()
}
