//go:build cgo

package p2p

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
)

// newTestClient returns a client with dst blocks of destination memory.
func newTestClient(t *testing.T, dst int, mod func(*ClientConfig)) *Client {
	t.Helper()
	cc := ClientConfig{Endpoint: testEndpoint(), Memory: make([]byte, dst*testBlockLen), BlockLen: testBlockLen, AbortTimeout: 200 * time.Millisecond}
	if mod != nil {
		mod(&cc)
	}
	c, err := NewClient(cc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func TestClientSendsTheSpecifiedConnectAndTimesOutOnSilence(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 8, func(c *ClientConfig) { c.HandshakeTimeout = fastTimeout })
	start := time.Now()
	_, err := c.Connect(context.Background(), peer.id)
	require.ErrorIs(t, err, transfer.ErrHandshake, "the TCP connection was accepted, so the peer is reachable")
	require.GreaterOrEqual(t, time.Since(start), fastTimeout)

	from, m, ok := peer.recv(time.Second)
	require.True(t, ok)
	require.Equal(t, c.ID(), from, "the DEALER identity is our host:port")
	require.True(t, strings.HasPrefix(c.ID(), "127.0.0.1:"))
	require.Equal(t, TypeConnect, m.Type)
	require.Equal(t, c.ID(), m.PeerID)
	require.Equal(t, uint64(testBlockLen), m.BlockLen)
	require.Equal(t, uint64(8), m.NumBlocks)
	require.NotZero(t, m.BaseAddr)
	require.Equal(t, DefaultHashSeed, m.HashSeed)
	require.Empty(t, m.ConfigFingerprint)
	require.True(t, strings.HasPrefix(string(m.AgentMetadata), inprocPrefix))
	// The timed-out session says goodbye.
	require.Equal(t, TypeDisconnect, peer.expect(TypeDisconnect).Type)
}

func TestConnectHonoursItsContext(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 1, func(c *ClientConfig) { c.HandshakeTimeout = time.Hour })
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := c.Connect(ctx, peer.id)
	require.ErrorIs(t, err, transfer.ErrHandshake)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// handshake plays the producer's side of the handshake with client c: it
// sends its connect (with identity peer.id) and connect_ack, and checks
// that the client acknowledges the producer's connect.
func handshake(t *testing.T, peer *rawPeer, c *Client) transfer.Session {
	t.Helper()
	type result struct {
		s   transfer.Session
		err error
	}
	done := make(chan result, 1)
	dialed := "127.0.0.1:" + peer.id[strings.LastIndexByte(peer.id, ':')+1:]
	go func() {
		s, err := c.Connect(context.Background(), dialed)
		done <- result{s, err}
	}()
	conn := peer.expect(TypeConnect)
	peer.dial(conn.PeerID)
	peer.send(message{Type: TypeConnect, PeerID: peer.id, AgentMetadata: []byte("md"), BaseAddr: 1 << 40,
		NumBlocks: 10, BlockLen: testBlockLen, HashSeed: DefaultHashSeed})
	ack := peer.expect(TypeConnectAck)
	require.Equal(t, c.ID(), ack.PeerID, "the client answers the producer's connect")
	peer.send(message{Type: TypeConnectAck, PeerID: peer.id})
	r := receive(t, done)
	require.NoError(t, r.err)
	t.Cleanup(func() { _ = r.s.Close() })
	return r.s
}

// async runs f on another goroutine; its result comes back on the channel,
// so raw-peer checks (which may fail the test) stay on the test goroutine.
func async[T any](f func() (T, error)) <-chan result[T] {
	ch := make(chan result[T], 1)
	go func() {
		v, err := f()
		ch <- result[T]{v, err}
	}()
	return ch
}

type result[T any] struct {
	v   T
	err error
}

func await[T any](t *testing.T, ch <-chan result[T]) (T, error) {
	t.Helper()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-time.After(5 * time.Second):
		t.Fatal("call did not return")
		panic("unreachable")
	}
}

func TestClientMatchesAPeerWhoseIdentityDiffersFromTheDialedAddress(t *testing.T) {
	// The producer names itself localhost:port; the client dialed 127.0.0.1:port.
	peer := newRawPeer(t, "localhost")
	c := newTestClient(t, 4, nil)
	s := handshake(t, peer, c)

	call := async(func() ([]bool, error) { return s.Lookup(context.Background(), []transfer.Key{testKey(1), testKey(2)}) })
	lk := peer.expect(TypeLookup)
	require.Equal(t, [][]byte{testKey(1), testKey(2)}, lk.Keys)
	require.Equal(t, uint64(0), lk.RoundSeq)
	// A stale answer for another request is ignored.
	peer.send(message{Type: TypeLookupResp, KVRequestID: "other", Keys: lk.Keys, Hits: []bool{false, false}})
	peer.send(message{Type: TypeLookupResp, KVRequestID: lk.KVRequestID, Keys: lk.Keys, Hits: []bool{true, false}})
	hits, err := await(t, call)
	require.NoError(t, err)
	require.Equal(t, []bool{true, false}, hits)
	require.Equal(t, uint64(1), c.Stats().Stale)
}

// lookupHit answers the client's next lookup with all hits.
func lookupHit(t *testing.T, peer *rawPeer, s transfer.Session, keys ...transfer.Key) {
	t.Helper()
	call := async(func() ([]bool, error) { return s.Lookup(context.Background(), keys) })
	lk := peer.expect(TypeLookup)
	hits := make([]bool, len(lk.Keys))
	for i := range hits {
		hits[i] = true
	}
	peer.send(message{Type: TypeLookupResp, KVRequestID: lk.KVRequestID, Keys: lk.Keys, Hits: hits})
	_, err := await(t, call)
	require.NoError(t, err)
}

func TestClientAcceptsATransferDoneWithoutRoundSeq(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 4, nil)
	s := handshake(t, peer, c)
	lookupHit(t, peer, s, testKey(7))
	call := async(func() (transfer.Stats, error) {
		return s.Fetch(context.Background(), []transfer.Key{testKey(7)}, []int{3})
	})
	f := peer.expect(TypeFetch)
	require.Equal(t, []uint64{3}, f.BlockIndexes)
	require.Equal(t, uint64(0), f.RoundSeq)
	// A pre-round peer omits round_seq: it reads as 0.
	peer.sendRaw(unhex(t, `
		83 a4 74797065 ad 7472616e736665725f646f6e65
		ad 6b765f726571756573745f6964 `+fmt.Sprintf("%02x %x", 0xa0+len(f.KVRequestID), f.KVRequestID)+`
		a7 73756363657373 c3`))
	st, err := await(t, call)
	require.NoError(t, err)
	require.Equal(t, 1, st.Blocks)
}

func TestClientSendsTheNextRoundAfterAFetch(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 4, nil)
	s := handshake(t, peer, c)
	for round := range uint64(3) {
		call := async(func() ([]bool, error) { return s.Lookup(context.Background(), []transfer.Key{testKey(1)}) })
		lk := peer.expect(TypeLookup)
		require.Equal(t, round, lk.RoundSeq)
		peer.send(message{Type: TypeLookupResp, KVRequestID: lk.KVRequestID, Keys: lk.Keys, Hits: []bool{true}})
		_, err := await(t, call)
		require.NoError(t, err)
		fetch := async(func() (transfer.Stats, error) {
			return s.Fetch(context.Background(), []transfer.Key{testKey(1)}, []int{0})
		})
		f := peer.expect(TypeFetch)
		require.Equal(t, round, f.RoundSeq)
		peer.send(message{Type: TypeTransferDone, KVRequestID: f.KVRequestID, Success: round != 1, RoundSeq: round})
		_, err = await(t, fetch)
		if round == 1 {
			require.ErrorIs(t, err, transfer.ErrFetchFailed, "a hit the peer then failed")
		} else {
			require.NoError(t, err)
		}
	}
	// The empty fetch ends the request in the current round and expects no reply.
	_, err := s.Fetch(context.Background(), nil, nil)
	require.NoError(t, err)
	end := peer.expect(TypeFetch)
	require.Empty(t, end.Keys)
	require.Empty(t, end.BlockIndexes)
	require.Equal(t, uint64(3), end.RoundSeq)
}

func TestUnacknowledgedAbortLosesThePeer(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 4, nil)
	s := handshake(t, peer, c)
	lookupHit(t, peer, s, testKey(7))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	call := async(func() (transfer.Stats, error) { return s.Fetch(ctx, []transfer.Key{testKey(7)}, []int{0}) })
	peer.expect(TypeFetch)
	a := peer.expect(TypeAbortFetch)
	require.Equal(t, uint64(0), a.RoundSeq)
	_, err := await(t, call)
	require.ErrorIs(t, err, transfer.ErrPeerLost)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	_, err = s.Lookup(context.Background(), []transfer.Key{testKey(7)})
	require.ErrorIs(t, err, transfer.ErrPeerLost)
}

func TestLateTransferDoneAfterAbortIsStale(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 4, nil)
	s := handshake(t, peer, c)
	lookupHit(t, peer, s, testKey(7))
	call := async(func() (transfer.Stats, error) {
		return s.Fetch(context.Background(), []transfer.Key{testKey(7)}, []int{0})
	})
	f := peer.expect(TypeFetch)
	abort := async(func() (struct{}, error) { return struct{}{}, s.Abort(context.Background()) })
	a := peer.expect(TypeAbortFetch)
	require.Equal(t, f.KVRequestID, a.KVRequestID)
	// The transfer finished as the abort arrived: transfer_done, then abort_ack.
	peer.send(message{Type: TypeTransferDone, KVRequestID: f.KVRequestID, Success: true, RoundSeq: 0})
	peer.send(message{Type: TypeAbortAck, KVRequestID: a.KVRequestID, RoundSeq: a.RoundSeq})
	_, err := await(t, abort)
	require.NoError(t, err)
	_, err = await(t, call)
	require.ErrorIs(t, err, transfer.ErrAborted, "the abort was sent first: the round is aborted")
	require.Equal(t, uint64(1), c.Stats().Stale, "the transfer_done was discarded")
}

func TestPeerDisconnectEndsTheSession(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 4, nil)
	s := handshake(t, peer, c)
	call := async(func() ([]bool, error) { return s.Lookup(context.Background(), []transfer.Key{testKey(7)}) })
	peer.expect(TypeLookup)
	peer.send(message{Type: TypeDisconnect})
	_, err := await(t, call)
	require.ErrorIs(t, err, transfer.ErrPeerLost)
}

func TestMalformedReplyEndsTheSession(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 4, nil)
	s := handshake(t, peer, c)
	call := async(func() ([]bool, error) { return s.Lookup(context.Background(), []transfer.Key{testKey(7)}) })
	peer.expect(TypeLookup)
	peer.sendRaw([]byte{0xc1})
	_, err := await(t, call)
	require.ErrorIs(t, err, transfer.ErrPeerLost)
	require.ErrorIs(t, err, ErrMalformed)
	require.Equal(t, uint64(1), c.Stats().Malformed)
	require.Equal(t, TypeDisconnect, peer.expect(TypeDisconnect).Type)
}

func TestLookupRespWithOtherKeysEndsTheSession(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 4, nil)
	s := handshake(t, peer, c)
	call := async(func() ([]bool, error) { return s.Lookup(context.Background(), []transfer.Key{testKey(7)}) })
	lk := peer.expect(TypeLookup)
	peer.send(message{Type: TypeLookupResp, KVRequestID: lk.KVRequestID, Keys: [][]byte{testKey(8)}, Hits: []bool{true}})
	_, err := await(t, call)
	require.ErrorIs(t, err, ErrMalformed)
	require.Equal(t, TypeDisconnect, peer.expect(TypeDisconnect).Type)
}

func TestLookupTimeoutEndsTheRequest(t *testing.T) {
	peer := newRawPeer(t, "127.0.0.1")
	c := newTestClient(t, 4, nil)
	s := handshake(t, peer, c)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := s.Lookup(ctx, []transfer.Key{testKey(7)})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	lk := peer.expect(TypeLookup)
	end := peer.expect(TypeFetch)
	require.Equal(t, lk.KVRequestID, end.KVRequestID, "the unanswered lookup's pins are released")
	require.Empty(t, end.Keys)

	// The late answer is stale: the next lookup is a new request.
	peer.send(message{Type: TypeLookupResp, KVRequestID: lk.KVRequestID, Keys: lk.Keys, Hits: []bool{true}})
	call := async(func() ([]bool, error) { return s.Lookup(context.Background(), []transfer.Key{testKey(7)}) })
	next := peer.expect(TypeLookup)
	require.NotEqual(t, lk.KVRequestID, next.KVRequestID)
	peer.send(message{Type: TypeLookupResp, KVRequestID: next.KVRequestID, Keys: next.Keys, Hits: []bool{false}})
	hits, err := await(t, call)
	require.NoError(t, err)
	require.Equal(t, []bool{false}, hits)
}

// rawConsumer connects a raw peer to producer p as a consumer with
// destination memory registered in the in-process data plane.
func rawConsumer(t *testing.T, p *Producer, mod func(*message)) (*rawPeer, []byte) {
	t.Helper()
	peer := newRawPeer(t, "127.0.0.1")
	return peer, connectRaw(t, p, peer, mod)
}

// connectRaw sends peer's connect to producer p, with destination memory
// registered in the in-process data plane, and returns the memory.
func connectRaw(t *testing.T, p *Producer, peer *rawPeer, mod func(*message)) []byte {
	t.Helper()
	mem := make([]byte, 8*testBlockLen)
	plane := NewInProcess()
	md, err := plane.Register(mem, testBlockLen)
	require.NoError(t, err)
	t.Cleanup(func() { _ = plane.Close() })
	m := message{Type: TypeConnect, PeerID: peer.id, AgentMetadata: md, BaseAddr: 4096, NumBlocks: 8,
		BlockLen: testBlockLen, HashSeed: DefaultHashSeed}
	if mod != nil {
		mod(&m)
	}
	peer.dial(p.ID())
	peer.send(m)
	return mem
}

func newTestProducer(t *testing.T, stored int, mods ...func(*ProducerConfig)) (*Producer, *MemStore) {
	t.Helper()
	store, err := NewMemStore(make([]byte, 16*testBlockLen), testBlockLen)
	require.NoError(t, err)
	for i := range stored {
		require.NoError(t, store.Put(testKey(i), []byte(strings.Repeat(string(rune('a'+i)), testBlockLen))))
	}
	cfg := ProducerConfig{Endpoint: testEndpoint(), Store: store, CancelDrainTimeout: 100 * time.Millisecond}
	for _, m := range mods {
		m(&cfg)
	}
	p, err := NewProducer(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p, store
}

func TestProducerHandshakeQueuesRepliesUntilAcknowledged(t *testing.T) {
	p, _ := newTestProducer(t, 2)
	peer, mem := rawConsumer(t, p, nil)

	from, hello, ok := peer.recv(2 * time.Second)
	require.True(t, ok)
	require.Equal(t, p.ID(), from)
	require.Equal(t, message{Type: TypeConnect, PeerID: p.ID(), AgentMetadata: hello.AgentMetadata, BaseAddr: hello.BaseAddr,
		NumBlocks: 16, BlockLen: testBlockLen, HashSeed: DefaultHashSeed}, hello, "the producer's connect comes first")
	require.Equal(t, p.ID(), peer.expect(TypeConnectAck).PeerID)

	peer.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(0), testKey(9), testKey(1)}, RoundSeq: 4})
	require.Eventually(t, func() bool { return p.Stats().Lookups == 1 }, waitLong, time.Millisecond)
	require.Equal(t, 1, queuedReplies(p, peer.id), "the answered lookup's reply waits for the acknowledgement")
	peer.send(message{Type: TypeConnectAck, PeerID: peer.id})
	resp := peer.expect(TypeLookupResp)
	require.Equal(t, "r", resp.KVRequestID)
	require.Equal(t, []bool{true, false, true}, resp.Hits)

	peer.send(message{Type: TypeFetch, KVRequestID: "r", Keys: [][]byte{testKey(1), testKey(0)}, BlockIndexes: []uint64{7, 2}, RoundSeq: 4})
	done := peer.expect(TypeTransferDone)
	require.Equal(t, message{Type: TypeTransferDone, KVRequestID: "r", Success: true, RoundSeq: 4}, done)
	require.Equal(t, strings.Repeat("b", testBlockLen), string(mem[7*testBlockLen:8*testBlockLen]))
	require.Equal(t, strings.Repeat("a", testBlockLen), string(mem[2*testBlockLen:3*testBlockLen]))
}

// queuedReplies returns how many replies p holds back for consumer id.
func queuedReplies(p *Producer, id string) int {
	p.mu.Lock()
	s := p.sessions[id]
	p.mu.Unlock()
	if s == nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queue)
}

func handshakeRaw(t *testing.T, p *Producer, mod func(*message)) (*rawPeer, []byte) {
	t.Helper()
	peer, mem := rawConsumer(t, p, mod)
	peer.expect(TypeConnect)
	peer.expect(TypeConnectAck)
	peer.send(message{Type: TypeConnectAck, PeerID: peer.id})
	return peer, mem
}

func TestProducerRejectsAMismatchedConnectWithSilence(t *testing.T) {
	tests := []struct {
		name string
		mod  func(*message)
	}{
		{"block length", func(m *message) { m.BlockLen = 64 }},
		{"hash seed", func(m *message) { m.HashSeed = "1234" }},
		{"config fingerprint", func(m *message) { m.ConfigFingerprint = "bbbbbbbbbbbbbbbb" }},
		{"no blocks", func(m *message) { m.NumBlocks = 0 }},
		{"a region whose size overflows", func(m *message) { m.NumBlocks = 1 << 57 }},
		{"a region past the address space", func(m *message) { m.BaseAddr = 1<<64 - testBlockLen }},
		{"unknown agent", func(m *message) { m.AgentMetadata = []byte("kvsource-inproc/nobody") }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, _ := newTestProducer(t, 1, func(c *ProducerConfig) { c.ConfigFingerprint = "aaaaaaaaaaaaaaaa" })
			peer, _ := rawConsumer(t, p, func(m *message) {
				m.ConfigFingerprint = "aaaaaaaaaaaaaaaa"
				tt.mod(m)
			})
			// Our connect, sent before the check, is how the consumer
			// learns of the mismatch (TestProducerDeliversItsConnectToARejectedConsumer).
			require.Equal(t, p.ID(), peer.expect(TypeConnect).PeerID)
			_, m, ok := peer.recv(fastTimeout)
			require.False(t, ok, "no connect_ack, no disconnect; got %s", m.Type)
			require.Equal(t, uint64(1), p.Stats().Rejected)
			require.Zero(t, producerSessions(p), "the rejected session is dead")
		})
	}
}

func TestProducerDropsSessionsThatBreakTheProtocol(t *testing.T) {
	tests := []struct {
		name string
		send func(peer *rawPeer)
	}{
		{"malformed frame", func(peer *rawPeer) { peer.sendRaw([]byte("not msgpack")) }},
		{"block index past the consumer's region", func(peer *rawPeer) {
			peer.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(0)}})
			peer.expect(TypeLookupResp)
			peer.send(message{Type: TypeFetch, KVRequestID: "r", Keys: [][]byte{testKey(0)}, BlockIndexes: []uint64{8}})
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, store := newTestProducer(t, 1)
			peer, _ := handshakeRaw(t, p, nil)
			tt.send(peer)
			require.Equal(t, TypeDisconnect, peer.expect(TypeDisconnect).Type)
			require.Equal(t, uint64(1), p.Stats().Malformed)
			require.Eventually(t, func() bool { return store.Pinned() == 0 }, waitLong, 5*time.Millisecond)
		})
	}
}

// A consumer that connects again under its identity, over a new connection
// while the old one is still up, gets a new session: the old one's pins go
// and it is sent nothing (a disconnect would reach the new session).
func TestProducerReplacesASessionWhenItsConsumerConnectsAgain(t *testing.T) {
	p, store := newTestProducer(t, 2)
	peer := newRawPeer(t, "127.0.0.1")
	// As a Client's: the producer's new DEALER may connect before its old
	// one is gone.
	require.NoError(t, peer.router.SetRouterHandover(true))
	connectRaw(t, p, peer, nil)
	peer.expect(TypeConnect)
	peer.expect(TypeConnectAck)
	peer.send(message{Type: TypeConnectAck, PeerID: peer.id})
	peer.send(message{Type: TypeLookup, KVRequestID: "old", Keys: [][]byte{testKey(0)}})
	peer.expect(TypeLookupResp)
	require.Equal(t, 1, store.Pinned())

	old := peer.dealer
	t.Cleanup(func() { _ = old.Close() })
	mem := connectRaw(t, p, peer, nil)
	require.Equal(t, TypeConnect, peer.expect(TypeConnect).Type, "the new session's connect, no disconnect first")
	peer.expect(TypeConnectAck)
	peer.send(message{Type: TypeConnectAck, PeerID: peer.id})
	require.Eventually(t, func() bool { return store.Pinned() == 0 }, 2*time.Second, 5*time.Millisecond, "the old session's pins are released")

	peer.send(message{Type: TypeLookup, KVRequestID: "new", Keys: [][]byte{testKey(1)}})
	require.Equal(t, []bool{true}, peer.expect(TypeLookupResp).Hits)
	peer.send(message{Type: TypeFetch, KVRequestID: "new", Keys: [][]byte{testKey(1)}, BlockIndexes: []uint64{3}})
	require.True(t, peer.expect(TypeTransferDone).Success)
	require.Equal(t, strings.Repeat("b", testBlockLen), string(mem[3*testBlockLen:4*testBlockLen]), "the new session writes the new region")
	st := p.Stats()
	require.Equal(t, uint64(1), st.Replaced)
	require.Equal(t, uint64(2), st.Sessions)
	require.Zero(t, st.Malformed)
	require.Equal(t, 1, producerSessions(p))
}

func TestProducerAcknowledgesAbortsOfUnknownRounds(t *testing.T) {
	p, _ := newTestProducer(t, 1)
	peer, _ := handshakeRaw(t, p, nil)
	peer.send(message{Type: TypeAbortFetch, KVRequestID: "never", RoundSeq: 9})
	require.Equal(t, message{Type: TypeAbortAck, KVRequestID: "never", RoundSeq: 9}, peer.expect(TypeAbortAck))
}

func TestProducerIgnoresUnknownTypesAndMessagesBeforeConnect(t *testing.T) {
	p, _ := newTestProducer(t, 1)
	stranger := newRawPeer(t, "127.0.0.1")
	stranger.dial(p.ID())
	stranger.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(0)}})
	// The stranger's connection is not the peer's: nothing orders its message
	// before the peer's lookup response.
	require.Eventually(t, func() bool { return p.Stats().Ignored == 1 }, waitLong, 5*time.Millisecond,
		"a lookup before connect is ignored")
	peer, _ := handshakeRaw(t, p, nil)
	peer.sendRaw(unhex(t, "81 a4 74797065 a4 70696e67")) // {"type": "ping"}
	peer.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(0)}})
	require.Equal(t, []bool{true}, peer.expect(TypeLookupResp).Hits, "the session survives")
	require.Equal(t, uint64(2), p.Stats().Ignored)
}

func TestProducerReapsAConsumerThatNeverAcknowledges(t *testing.T) {
	p, _ := newTestProducer(t, 1, func(c *ProducerConfig) { c.HandshakeTimeout = fastTimeout })
	peer, _ := rawConsumer(t, p, nil)
	peer.expect(TypeConnect)
	peer.expect(TypeConnectAck)
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.sessions) == 0
	}, waitLong, 10*time.Millisecond)
}

func TestProducerReapsALostConsumerAndReleasesItsPins(t *testing.T) {
	p, store := newTestProducer(t, 1)
	peer, _ := handshakeRaw(t, p, nil)
	peer.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(0)}})
	peer.expect(TypeLookupResp)
	require.Equal(t, 1, store.Pinned())
	peer.close()
	require.Eventually(t, func() bool { return store.Pinned() == 0 && p.Stats().Lost == 1 }, waitLong, 10*time.Millisecond)
	require.NoError(t, store.Evict(testKey(0)), "no pin is left")
}

func TestClientMatchesUnknownIdentitiesOnlyToHandshakingSessions(t *testing.T) {
	c := newTestClient(t, 1, nil)
	add := func(addr string) *session {
		s := &session{c: c, addr: addr, dead: make(chan struct{})}
		c.mu.Lock()
		c.sessions[addr] = s
		c.mu.Unlock()
		return s
	}
	a := add("127.0.0.1:1000")
	require.Same(t, a, c.match("127.0.0.1:1000"), "an exact identity")
	require.Nil(t, c.match("localhost:2000"), "a session that heard from its peer takes no other identity")

	b := add("127.0.0.1:2000")
	d := add("127.0.0.1:3000")
	require.Same(t, b, c.match("localhost:2000"), "same port")
	require.Same(t, b, c.match("localhost:2000"), "the alias sticks")
	require.Same(t, d, c.match("pod-d:9999"), "the only session still waiting")
	require.Nil(t, c.match("pod-e:9999"))

	add("127.0.0.1:4000")
	require.Nil(t, c.match("\x00\x00\x00\x00\x07"), "an identity that is not host:port: a replaced connection's")
	require.Nil(t, c.match("no-port"))
}

// A fetch of a round whose transfer still runs is a duplicate, even after an
// empty fetch released the request's idle rounds; serving it would start a
// second write on the same round. (Once the round ended, the same round_seq
// is a new round: TestProducerServesAFinishedRoundAgainUnderTheSameRoundSeq.)
func TestProducerDropsASecondFetchOfARunningRound(t *testing.T) {
	plane := newGatedPlane()
	p, store := newTestProducer(t, 1, func(c *ProducerConfig) { c.DataPlane = plane })
	peer, _ := handshakeRaw(t, p, nil)
	peer.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(0)}})
	peer.expect(TypeLookupResp)
	fetch := message{Type: TypeFetch, KVRequestID: "r", Keys: [][]byte{testKey(0)}, BlockIndexes: []uint64{0}}
	peer.send(fetch)
	plane.waitStarted(t)
	peer.send(message{Type: TypeFetch, KVRequestID: "r", Keys: [][]byte{}, BlockIndexes: []uint64{}})
	peer.send(fetch)
	require.Equal(t, TypeDisconnect, peer.expect(TypeDisconnect).Type)
	require.Equal(t, uint64(1), p.Stats().Malformed)
	close(plane.release)
	require.Eventually(t, func() bool { return store.Pinned() == 0 }, waitLong, 5*time.Millisecond)
}

// slowAddPlane holds AddRemote until release and reports each remote's Close.
type slowAddPlane struct {
	*InProcess
	adding  chan struct{}
	release chan struct{}
	closed  chan struct{}
}

func (p *slowAddPlane) AddRemote(md []byte, base uint64, n, bl int) (Remote, error) {
	p.adding <- struct{}{}
	<-p.release
	r, err := p.InProcess.AddRemote(md, base, n, bl)
	if err != nil {
		return nil, err
	}
	return closeReporter{r, p.closed}, nil
}

type closeReporter struct {
	Remote
	closed chan struct{}
}

func (r closeReporter) Close() error {
	r.closed <- struct{}{}
	return r.Remote.Close()
}

func TestProducerUnloadsAPeerLostWhileItsMetadataLoads(t *testing.T) {
	plane := &slowAddPlane{InProcess: NewInProcess(), adding: make(chan struct{}, 1), release: make(chan struct{}), closed: make(chan struct{}, 1)}
	p, _ := newTestProducer(t, 1, func(c *ProducerConfig) { c.DataPlane = plane })
	peer, _ := rawConsumer(t, p, nil)
	peer.expect(TypeConnect)
	receive(t, plane.adding)
	peer.close()
	// The loss is counted before the session is reaped; wait for the reap.
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.Stats().Lost == 1 && len(p.sessions) == 0
	}, waitLong, 10*time.Millisecond)
	close(plane.release)
	receive(t, plane.closed)
	require.Zero(t, p.Stats().Sessions, "the lost consumer was never acknowledged")
}

func TestOversizedFramesAreDroppedBeforeDecoding(t *testing.T) {
	p, _ := newTestProducer(t, 1)
	big := newRawPeer(t, "127.0.0.1")
	big.dial(p.ID())
	disconnected := big.watchDisconnect()
	big.sendRaw(make([]byte, maxMessageSize+1))
	// The producer's socket refuses the frame by dropping the connection,
	// before anything is decoded; unbounded, it would decode the frame
	// and keep the connection.
	receive(t, disconnected)
	small := newRawPeer(t, "127.0.0.1")
	small.dial(p.ID())
	small.sendRaw([]byte("junk"))
	require.Eventually(t, func() bool { return p.Stats().Malformed == 1 }, waitLong, 10*time.Millisecond)
	require.Equal(t, uint64(1), p.Stats().Malformed, "the oversized frame never reached the decoder")
}

func TestMultiFrameMessagesAreCountedAndDropped(t *testing.T) {
	p, _ := newTestProducer(t, 1)
	r := newRawPeer(t, "127.0.0.1")
	r.dial(p.ID())
	_, err := r.dealer.SendMessage([]byte("a"), []byte("b"))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return p.Stats().Frames == 1 }, waitLong, 10*time.Millisecond)
	require.Zero(t, p.Stats().Malformed, "a dropped message never reaches the decoder")
}

// vLLM's consumer drops a request's state when its load completes, so the
// request's next load probes and fetches under round_seq 0 again. A round
// the producer finished (transfer_done success or failure, or abort_ack)
// may therefore be opened again under the same number, and leaves no
// record behind.
func TestProducerServesAFinishedRoundAgainUnderTheSameRoundSeq(t *testing.T) {
	tests := []struct {
		name   string
		finish func(t *testing.T, peer *rawPeer, plane *gatedPlane)
	}{
		{"after a transfer", func(t *testing.T, peer *rawPeer, plane *gatedPlane) {
			close(plane.release)
			peer.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(0)}})
			peer.expect(TypeLookupResp)
			peer.send(message{Type: TypeFetch, KVRequestID: "r", Keys: [][]byte{testKey(0)}, BlockIndexes: []uint64{0}})
			require.Equal(t, message{Type: TypeTransferDone, KVRequestID: "r", Success: true}, peer.expect(TypeTransferDone))
		}},
		{"after a failed fetch", func(t *testing.T, peer *rawPeer, plane *gatedPlane) {
			close(plane.release)
			peer.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(0), testKey(9)}})
			peer.expect(TypeLookupResp)
			peer.send(message{Type: TypeFetch, KVRequestID: "r", Keys: [][]byte{testKey(9)}, BlockIndexes: []uint64{0}})
			require.Equal(t, message{Type: TypeTransferDone, KVRequestID: "r", Success: false}, peer.expect(TypeTransferDone))
		}},
		{"after an aborted fetch", func(t *testing.T, peer *rawPeer, plane *gatedPlane) {
			peer.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(0)}})
			peer.expect(TypeLookupResp)
			peer.send(message{Type: TypeFetch, KVRequestID: "r", Keys: [][]byte{testKey(0)}, BlockIndexes: []uint64{0}})
			plane.waitStarted(t)
			peer.send(message{Type: TypeAbortFetch, KVRequestID: "r"})
			peer.expect(TypeAbortAck)
			close(plane.release)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			plane := newGatedPlane()
			p, store := newTestProducer(t, 2, func(c *ProducerConfig) { c.DataPlane = plane })
			peer, mem := handshakeRaw(t, p, nil)
			tt.finish(t, peer, plane)
			require.Zero(t, openRounds(p, peer.id), "a finished round leaves no record")

			// The request's next load, as vLLM's consumer sends it.
			peer.send(message{Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{testKey(1)}})
			require.Equal(t, []bool{true}, peer.expect(TypeLookupResp).Hits)
			peer.send(message{Type: TypeFetch, KVRequestID: "r", Keys: [][]byte{testKey(1)}, BlockIndexes: []uint64{5}})
			require.Equal(t, message{Type: TypeTransferDone, KVRequestID: "r", Success: true}, peer.expect(TypeTransferDone))
			require.Equal(t, strings.Repeat("b", testBlockLen), string(mem[5*testBlockLen:6*testBlockLen]))
			require.Zero(t, p.Stats().Malformed)
			require.Zero(t, openRounds(p, peer.id))
			require.Eventually(t, func() bool { return store.Pinned() == 0 }, waitLong, 5*time.Millisecond)
		})
	}
}

// openRounds returns how many rounds p holds state for, for consumer id.
func openRounds(p *Producer, id string) int {
	p.mu.Lock()
	s := p.sessions[id]
	p.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.rounds)
}

// vLLM's consumer learns that the producer rejected it only from the
// producer's own connect, sent before the check: it then turns its lookups
// into misses; without it they stay RETRY forever. The gate holds the
// producer's dial-back unaccepted until the producer has rejected the
// consumer and ended the session, so a connect discarded when the session's
// connection is closed at once (LINGER 0) is lost every time instead of in
// some runs.
func TestProducerDeliversItsConnectToARejectedConsumer(t *testing.T) {
	tests := []struct {
		name     string
		producer func(*ProducerConfig)
		mod      func(*message)
	}{
		{"block length", nil, func(m *message) { m.BlockLen = 64 }},
		{"hash seed", nil, func(m *message) { m.HashSeed = "1234" }},
		{"config fingerprint", func(c *ProducerConfig) { c.ConfigFingerprint = "aaaaaaaaaaaaaaaa" },
			func(m *message) { m.ConfigFingerprint = "bbbbbbbbbbbbbbbb" }},
		{"unknown agent", nil, func(m *message) { m.AgentMetadata = []byte("kvsource-inproc/nobody") }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var mods []func(*ProducerConfig)
			if tt.producer != nil {
				mods = append(mods, tt.producer)
			}
			p, _ := newTestProducer(t, 1, mods...)
			peer := newRawPeer(t, "127.0.0.1")
			g := newGate(t, "127.0.0.1:"+peer.id[strings.LastIndexByte(peer.id, ':')+1:])
			peer.id = g.addr()
			connectRaw(t, p, peer, tt.mod)
			require.Eventually(t, func() bool { return p.Stats().Rejected == 1 && producerSessions(p) == 0 },
				5*time.Second, 5*time.Millisecond, "the producer rejects the consumer and ends the session")
			g.open()
			from, m, ok := peer.recv(5 * time.Second)
			require.True(t, ok, "the producer's connect never arrived")
			require.Equal(t, p.ID(), from)
			require.Equal(t, TypeConnect, m.Type)
			require.Equal(t, uint64(testBlockLen), m.BlockLen, "the consumer can tell what differs")
			require.Zero(t, p.Stats().Sessions)
		})
	}
}

// producerSessions returns how many sessions p holds.
func producerSessions(p *Producer) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.sessions)
}

// A rejected consumer that cannot be reached does not keep the producer's
// connection open past RejectLinger, nor hold up Close.
func TestProducerGivesUpOnAnUnreachableRejectedConsumer(t *testing.T) {
	rejectUnreachable := func(t *testing.T, linger time.Duration) *Producer {
		t.Helper()
		p, _ := newTestProducer(t, 1, func(c *ProducerConfig) { c.RejectLinger = linger })
		peer := newRawPeer(t, "127.0.0.1")
		peer.id = newGate(t, "127.0.0.1:1").addr() // never opened
		connectRaw(t, p, peer, func(m *message) { m.HashSeed = "1234" })
		require.Eventually(t, func() bool { return p.Stats().Rejected == 1 }, waitLong, 5*time.Millisecond)
		return p
	}
	t.Run("after RejectLinger", func(t *testing.T) {
		p := rejectUnreachable(t, 50*time.Millisecond)
		require.Eventually(t, func() bool { return producerDealers(p) == 0 }, waitLong, 5*time.Millisecond)
		require.Zero(t, p.Stats().Lost, "a rejected session is not lost")
	})
	t.Run("at Close", func(t *testing.T) {
		p := rejectUnreachable(t, time.Hour)
		require.Equal(t, 1, producerDealers(p), "still trying to deliver")
		closed := make(chan error, 1)
		go func() { closed <- p.Close() }()
		require.NoError(t, receive(t, closed))
	})
}

// producerDealers returns how many DEALERs p has open.
func producerDealers(p *Producer) int {
	p.ep.mu.Lock()
	defer p.ep.mu.Unlock()
	return len(p.ep.dealers)
}
