//go:build cgo

package p2p

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
)

const testBlockLen = 128

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// Handshakes that should succeed get slowTimeout, generous for a loaded
// machine; tests that wait for a handshake to time out set fastTimeout.
const (
	slowTimeout = 5 * time.Second
	fastTimeout = 300 * time.Millisecond
)

// waitLong bounds the waits for a condition (pins released, a counter
// reached): generous, since a passing test returns as soon as it holds and
// `make test` runs under -race on shared, loaded machines (1 s and 2 s
// were the tightest such waits in the repository).
const waitLong = 30 * time.Second

func testEndpoint() Endpoint {
	return Endpoint{Host: "127.0.0.1", HandshakeTimeout: slowTimeout, Logger: quiet}
}

// testKey is the key of block i: a 32-byte digest, group 0.
func testKey(i int) transfer.Key {
	d := make([]byte, 32)
	d[0], d[31] = byte(i>>8), byte(i)
	return transfer.NewKey(d, 0)
}

func randomBlock(t *testing.T) []byte {
	b := make([]byte, testBlockLen)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return b
}

type fixture struct {
	prod    *Producer
	store   *MemStore
	blocks  map[string][]byte // content of each stored key
	client  *Client
	dst     []byte
	session transfer.Session
}

type fixtureOpts struct {
	producer    func(*ProducerConfig)
	client      func(*ClientConfig)
	stored      int // keys 0..stored-1 are held
	dstBlocks   int
	skipConnect bool
}

func newFixture(t *testing.T, o fixtureOpts) *fixture {
	t.Helper()
	if o.dstBlocks == 0 {
		o.dstBlocks = 16
	}
	store, err := NewMemStore(make([]byte, 64*testBlockLen), testBlockLen)
	require.NoError(t, err)
	f := &fixture{store: store, blocks: map[string][]byte{}}
	for i := range o.stored {
		b := randomBlock(t)
		require.NoError(t, store.Put(testKey(i), b))
		f.blocks[string(testKey(i))] = b
	}
	pc := ProducerConfig{Endpoint: testEndpoint(), Store: store}
	if o.producer != nil {
		o.producer(&pc)
	}
	f.prod, err = NewProducer(pc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.prod.Close() })

	f.dst = make([]byte, o.dstBlocks*testBlockLen)
	cc := ClientConfig{Endpoint: testEndpoint(), Memory: f.dst, BlockLen: testBlockLen, AbortTimeout: time.Second}
	if o.client != nil {
		o.client(&cc)
	}
	f.client, err = NewClient(cc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.client.Close() })
	if !o.skipConnect {
		f.session, err = f.client.Connect(context.Background(), f.prod.ID())
		require.NoError(t, err)
	}
	return f
}

func (f *fixture) block(i int) []byte { return f.dst[i*testBlockLen : (i+1)*testBlockLen] }

func (f *fixture) producerSessions() int {
	f.prod.mu.Lock()
	defer f.prod.mu.Unlock()
	return len(f.prod.sessions)
}

// gatedPlane wraps the in-process data plane: every Write announces itself
// on started and then waits for release (or its context) before copying.
type gatedPlane struct {
	*InProcess
	started chan struct{}
	release chan struct{}
}

func newGatedPlane() *gatedPlane {
	return &gatedPlane{InProcess: NewInProcess(), started: make(chan struct{}, 16), release: make(chan struct{})}
}

func (g *gatedPlane) AddRemote(md []byte, base uint64, n, bl int) (Remote, error) {
	r, err := g.InProcess.AddRemote(md, base, n, bl)
	if err != nil {
		return nil, err
	}
	return gatedRemote{r, g}, nil
}

// waitStarted waits for a Write to begin.
func (g *gatedPlane) waitStarted(t *testing.T) {
	t.Helper()
	select {
	case <-g.started:
	case <-time.After(5 * time.Second):
		t.Fatal("no transfer started")
	}
}

// receive returns the next value of ch, failing the test after 5 s.
func receive[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(5 * time.Second):
		t.Fatal("nothing received")
		panic("unreachable")
	}
}

type gatedRemote struct {
	Remote
	g *gatedPlane
}

func (r gatedRemote) Write(ctx context.Context, src, dst []int) error {
	r.g.started <- struct{}{}
	select {
	case <-r.g.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	return r.Remote.Write(ctx, src, dst)
}

// rawPeer speaks the protocol by hand over its own sockets, to check what
// the Go implementation puts on the wire and how it reacts to a peer.
type rawPeer struct {
	t      *testing.T
	id     string
	zctx   *zmq.Context
	router *zmq.Socket
	dealer *zmq.Socket
}

// newRawPeer binds a ROUTER on 127.0.0.1 and names itself idHost:port.
func newRawPeer(t *testing.T, idHost string) *rawPeer {
	t.Helper()
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	r := &rawPeer{t: t, zctx: zctx}
	r.router, err = zctx.NewSocket(zmq.ROUTER)
	require.NoError(t, err)
	require.NoError(t, r.router.SetLinger(0))
	require.NoError(t, r.router.Bind("tcp://127.0.0.1:*"))
	ep, err := r.router.GetLastEndpoint()
	require.NoError(t, err)
	r.id = idHost + ":" + ep[strings.LastIndexByte(ep, ':')+1:]
	t.Cleanup(r.close)
	return r
}

func (r *rawPeer) close() {
	if r.dealer != nil {
		_ = r.dealer.Close()
	}
	_ = r.router.Close()
	_ = r.zctx.Term()
}

func (r *rawPeer) dial(addr string) {
	r.t.Helper()
	var err error
	r.dealer, err = r.zctx.NewSocket(zmq.DEALER)
	require.NoError(r.t, err)
	require.NoError(r.t, r.dealer.SetIdentity(r.id))
	require.NoError(r.t, r.dealer.SetLinger(0))
	require.NoError(r.t, r.dealer.Connect("tcp://"+addr))
}

// watchDisconnect returns a channel closed when the dealer's connection is
// dropped by the other side.
func (r *rawPeer) watchDisconnect() <-chan struct{} {
	r.t.Helper()
	addr := fmt.Sprintf("inproc://monitor-%p", r)
	require.NoError(r.t, r.dealer.Monitor(addr, zmq.EVENT_DISCONNECTED))
	mon, err := r.zctx.NewSocket(zmq.PAIR)
	require.NoError(r.t, err)
	require.NoError(r.t, mon.SetLinger(0))
	require.NoError(r.t, mon.SetRcvtimeo(10*time.Second))
	require.NoError(r.t, mon.Connect(addr))
	done := make(chan struct{})
	go func() {
		defer mon.Close()
		if ev, _, _, err := mon.RecvEvent(0); err == nil && ev == zmq.EVENT_DISCONNECTED {
			close(done)
		}
	}()
	return done
}

func (r *rawPeer) send(m message) {
	r.t.Helper()
	b, err := m.encode()
	require.NoError(r.t, err)
	r.sendRaw(b)
}

func (r *rawPeer) sendRaw(b []byte) {
	r.t.Helper()
	_, err := r.dealer.SendBytes(b, 0)
	require.NoError(r.t, err)
}

// recv returns the next message on the ROUTER within d, checking it came
// as exactly [identity, payload].
func (r *rawPeer) recv(d time.Duration) (string, message, bool) {
	r.t.Helper()
	// A negative timeout would make Poll wait forever.
	d = max(d, 0)
	p := zmq.NewPoller()
	p.Add(r.router, zmq.POLLIN)
	ps, err := p.Poll(d)
	require.NoError(r.t, err)
	if len(ps) == 0 {
		return "", message{}, false
	}
	frames, err := r.router.RecvMessageBytes(0)
	require.NoError(r.t, err)
	require.Len(r.t, frames, 2, "one payload frame after the identity, no delimiter")
	m, err := decodeMessage(frames[1])
	require.NoError(r.t, err)
	return string(frames[0]), m, true
}

// expect returns the next message, which must be of type typ.
func (r *rawPeer) expect(typ string) message {
	r.t.Helper()
	_, m, ok := r.recv(5 * time.Second)
	require.True(r.t, ok, "no %s", typ)
	require.Equal(r.t, typ, m.Type)
	return m
}

// gate is a TCP proxy to target that leaves the connections made to it
// unaccepted (the kernel completes them, nothing is read) until open, and
// then forwards them both ways.
type gate struct {
	ln     net.Listener
	target string
	opened chan struct{}
	closed chan struct{}
	once   sync.Once
	wg     sync.WaitGroup

	mu    sync.Mutex
	done  bool // closed: a connection accepted now is closed at once
	conns []net.Conn
}

func newGate(t *testing.T, target string) *gate {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	g := &gate{ln: ln, target: target, opened: make(chan struct{}), closed: make(chan struct{})}
	g.wg.Add(1)
	go g.serve()
	t.Cleanup(g.close)
	return g
}

func (g *gate) addr() string { return g.ln.Addr().String() }

func (g *gate) open() { close(g.opened) }

func (g *gate) serve() {
	defer g.wg.Done()
	select {
	case <-g.opened:
	case <-g.closed:
		return
	}
	for {
		in, err := g.ln.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp", g.target)
		if err != nil {
			in.Close()
			continue
		}
		g.mu.Lock()
		done := g.done
		if !done {
			g.conns = append(g.conns, in, out)
		}
		g.mu.Unlock()
		if done {
			in.Close()
			out.Close()
			return
		}
		for _, pair := range [][2]net.Conn{{in, out}, {out, in}} {
			g.wg.Add(1)
			go func() {
				defer g.wg.Done()
				_, _ = io.Copy(pair[0], pair[1])
				// One side ended: so does the other direction.
				pair[0].Close()
				pair[1].Close()
			}()
		}
	}
}

func (g *gate) close() {
	g.once.Do(func() { close(g.closed) })
	g.ln.Close()
	g.mu.Lock()
	g.done = true
	for _, c := range g.conns {
		c.Close()
	}
	g.mu.Unlock()
	g.wg.Wait()
}

// processCPU is the process's user and system CPU time so far: threads the
// Go runtime does not see (NIXL's) count too.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
