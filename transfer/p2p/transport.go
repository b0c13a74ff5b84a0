//go:build cgo

package p2p

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// Heartbeat sets ZMTP heartbeats on every socket. The zero value is vLLM's:
// a PING every 2 s, a peer silent for 10 s is dropped, and the remote side
// is told to drop us after 10 s of silence.
type Heartbeat struct {
	Interval time.Duration // ZMQ_HEARTBEAT_IVL, default 2 s
	Timeout  time.Duration // ZMQ_HEARTBEAT_TIMEOUT, default 10 s
	TTL      time.Duration // ZMQ_HEARTBEAT_TTL, default 10 s
}

func (h Heartbeat) withDefaults() Heartbeat {
	if h.Interval <= 0 {
		h.Interval = 2 * time.Second
	}
	if h.Timeout <= 0 {
		h.Timeout = 10 * time.Second
	}
	if h.TTL <= 0 {
		h.TTL = 10 * time.Second
	}
	return h
}

// maxMessageSize bounds a received frame, so a hostile or broken peer
// cannot make us allocate without limit: libzmq drops the connection of a
// peer that sends more. Real messages are far smaller (a lookup of 100k keys
// is about 4 MiB).
const maxMessageSize = 64 << 20

// pollInterval bounds how long a receive loop blocks before it checks for
// shutdown.
const pollInterval = 50 * time.Millisecond

var monitorSeq atomic.Uint64

// endpoint is one side of the transport: a bound ROUTER that receives every
// message sent to us, and a DEALER per peer to send, both in a private ZMQ
// context so closing one endpoint never affects another.
type endpoint struct {
	id     string
	log    *slog.Logger
	hb     Heartbeat
	zctx   *zmq.Context
	router *zmq.Socket
	stop   chan struct{}
	wg     sync.WaitGroup

	mu      sync.Mutex
	dealers map[*dealer]bool

	dropped atomic.Uint64 // frames that were not [identity, payload]
}

// listen binds a ROUTER on tcp://host:port (port 0: an ephemeral port).
// Nothing is received until start.
func listen(host string, port int, hb Heartbeat, log *slog.Logger) (*endpoint, error) {
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, fmt.Errorf("p2p: zmq context: %w", err)
	}
	e := &endpoint{log: log, hb: hb, zctx: zctx, stop: make(chan struct{}), dealers: make(map[*dealer]bool)}
	fail := func(err error) (*endpoint, error) {
		if e.router != nil {
			_ = e.router.Close()
		}
		_ = zctx.Term()
		return nil, err
	}
	if e.router, err = zctx.NewSocket(zmq.ROUTER); err != nil {
		return fail(fmt.Errorf("p2p: router socket: %w", err))
	}
	if err := e.configure(e.router); err != nil {
		return fail(err)
	}
	if err := e.router.SetRcvtimeo(pollInterval); err != nil {
		return fail(fmt.Errorf("p2p: router socket: %w", err))
	}
	if err := e.router.SetMaxmsgsize(maxMessageSize); err != nil {
		return fail(fmt.Errorf("p2p: router socket: %w", err))
	}
	// A peer that reconnects reuses its identity while its old connection
	// may still be up (its DEALER closes in the background): without
	// handover libzmq drops the new connection and its connect with it.
	// With it the new connection takes the identity, and what the old one
	// still delivers arrives under a temporary identity that is no
	// "host:port", so no session takes it.
	if err := e.router.SetRouterHandover(true); err != nil {
		return fail(fmt.Errorf("p2p: router socket: %w", err))
	}
	p := "*"
	if port > 0 {
		p = strconv.Itoa(port)
	}
	if err := e.router.Bind("tcp://" + net.JoinHostPort(host, p)); err != nil {
		return fail(fmt.Errorf("p2p: bind %s:%s: %w", host, p, err))
	}
	bound, err := e.router.GetLastEndpoint()
	if err != nil {
		return fail(fmt.Errorf("p2p: bound address: %w", err))
	}
	i := strings.LastIndexByte(bound, ':')
	if i < 0 {
		return fail(fmt.Errorf("p2p: bound address %q has no port", bound))
	}
	// The identity is the configured host verbatim, as vLLM does: peers dial
	// it back.
	e.id = host + ":" + bound[i+1:]
	return e, nil
}

// start calls onMessage with the sender identity and payload of every
// two-frame message, on one goroutine, until close.
func (e *endpoint) start(onMessage func(from string, data []byte)) {
	e.wg.Add(1)
	go e.receive(onMessage)
}

func (e *endpoint) configure(s *zmq.Socket) error {
	for _, err := range []error{
		s.SetHeartbeatIvl(e.hb.Interval),
		s.SetHeartbeatTimeout(e.hb.Timeout),
		s.SetHeartbeatTtl(e.hb.TTL),
		s.SetLinger(0),
	} {
		if err != nil {
			return fmt.Errorf("p2p: socket options: %w", err)
		}
	}
	return nil
}

func (e *endpoint) receive(onMessage func(string, []byte)) {
	defer e.wg.Done()
	for {
		select {
		case <-e.stop:
			return
		default:
		}
		frames, err := e.router.RecvMessageBytes(0)
		if err != nil {
			if zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
				continue
			}
			e.log.Warn("p2p: receive", "err", err)
			continue
		}
		if len(frames) != 2 {
			e.dropped.Add(1)
			e.log.Warn("p2p: dropped message, expected 2 frames", "frames", len(frames))
			continue
		}
		onMessage(string(frames[0]), frames[1])
	}
}

// dealer is the sending half towards one peer. Sends are serialised by mu;
// a monitor goroutine reports connection events.
type dealer struct {
	e         *endpoint
	mu        sync.Mutex
	sock      *zmq.Socket
	closed    bool
	stop      chan struct{}
	done      chan struct{}
	handshook chan struct{} // closed once a connection's ZMTP handshake succeeded
}

// dial opens a DEALER with our identity to addr ("host:port") and calls
// onEvent (on the monitor goroutine) for EVENT_CONNECTED and
// EVENT_DISCONNECTED.
func (e *endpoint) dial(addr string, onEvent func(zmq.Event)) (*dealer, error) {
	s, err := e.zctx.NewSocket(zmq.DEALER)
	if err != nil {
		return nil, fmt.Errorf("p2p: dealer socket: %w", err)
	}
	d := &dealer{e: e, sock: s, stop: make(chan struct{}), done: make(chan struct{}), handshook: make(chan struct{})}
	fail := func(err error) (*dealer, error) {
		_ = s.Close()
		return nil, err
	}
	if err := s.SetIdentity(e.id); err != nil {
		return fail(fmt.Errorf("p2p: dealer identity: %w", err))
	}
	if err := e.configure(s); err != nil {
		return fail(err)
	}
	monAddr := fmt.Sprintf("inproc://kvsource-p2p-monitor-%d", monitorSeq.Add(1))
	if err := s.Monitor(monAddr, zmq.EVENT_CONNECTED|zmq.EVENT_DISCONNECTED|zmq.EVENT_HANDSHAKE_SUCCEEDED); err != nil {
		return fail(fmt.Errorf("p2p: dealer monitor: %w", err))
	}
	mon, err := e.zctx.NewSocket(zmq.PAIR)
	if err != nil {
		return fail(fmt.Errorf("p2p: monitor socket: %w", err))
	}
	if err := mon.SetRcvtimeo(pollInterval); err != nil {
		_ = mon.Close()
		return fail(fmt.Errorf("p2p: monitor socket: %w", err))
	}
	if err := mon.SetLinger(0); err != nil {
		_ = mon.Close()
		return fail(fmt.Errorf("p2p: monitor socket: %w", err))
	}
	if err := mon.Connect(monAddr); err != nil {
		_ = mon.Close()
		return fail(fmt.Errorf("p2p: monitor connect: %w", err))
	}
	if err := s.Connect("tcp://" + addr); err != nil {
		_ = mon.Close()
		return fail(fmt.Errorf("p2p: connect %s: %w", addr, err))
	}
	e.mu.Lock()
	e.dealers[d] = true
	e.mu.Unlock()
	go d.monitor(mon, onEvent)
	return d, nil
}

func (d *dealer) monitor(mon *zmq.Socket, onEvent func(zmq.Event)) {
	defer close(d.done)
	defer mon.Close()
	handshook := false
	for {
		select {
		case <-d.stop:
			return
		default:
		}
		ev, _, _, err := mon.RecvEvent(0)
		if err != nil {
			continue
		}
		select {
		case <-d.stop:
			// Events of a socket we closed ourselves are not news.
			return
		default:
		}
		switch ev {
		case zmq.EVENT_MONITOR_STOPPED:
			return
		case zmq.EVENT_HANDSHAKE_SUCCEEDED:
			if !handshook {
				handshook = true
				close(d.handshook)
			}
			continue
		}
		onEvent(ev)
	}
}

// errDealerClosed is returned by send after close.
var errDealerClosed = errors.New("p2p: connection closed")

// send sends one frame without blocking: a full send queue (the peer
// stopped reading) is an error.
func (d *dealer) send(data []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errDealerClosed
	}
	if _, err := d.sock.SendBytes(data, zmq.DONTWAIT); err != nil {
		return fmt.Errorf("p2p: send: %w", err)
	}
	return nil
}

// close closes the socket, discarding what it has not sent yet, and waits
// for the monitor goroutine. It must not be called from the monitor
// goroutine.
func (d *dealer) close() { d.closeLinger(0) }

// closeFlushed closes the socket once what was sent has been delivered, or
// after timeout or when stop closes, discarding what is left. libzmq's
// linger alone does not deliver messages queued before the connection is
// up when the socket is closed (zeromq/libzmq#1264, #3774; libzmq 4.3.4 lost
// it in 2 of 20 runs of TestProducerDeliversItsConnectToARejectedConsumer
// with a 5 s linger), so it waits for the connection's handshake first,
// and then closes with the time left as linger.
func (d *dealer) closeFlushed(timeout time.Duration, stop <-chan struct{}) {
	deadline := time.Now().Add(timeout)
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-d.handshook:
		d.closeLinger(max(time.Until(deadline), time.Millisecond))
	case <-t.C:
		d.close()
	case <-stop:
		d.close()
	}
}

// closeLinger closes the socket as close does, except that libzmq keeps
// delivering what was sent for up to linger; the context's Term waits for
// that.
func (d *dealer) closeLinger(linger time.Duration) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		<-d.done
		return
	}
	d.closed = true
	close(d.stop)
	if linger > 0 {
		if err := d.sock.SetLinger(linger); err != nil {
			d.e.log.Warn("p2p: dealer linger", "err", err)
		}
	}
	_ = d.sock.Close()
	d.mu.Unlock()
	<-d.done
	d.e.mu.Lock()
	delete(d.e.dealers, d)
	d.e.mu.Unlock()
}

// close stops receiving and closes every socket and the context.
func (e *endpoint) close() {
	close(e.stop)
	e.wg.Wait()
	_ = e.router.Close()
	e.mu.Lock()
	ds := make([]*dealer, 0, len(e.dealers))
	for d := range e.dealers {
		ds = append(ds, d)
	}
	e.mu.Unlock()
	for _, d := range ds {
		d.close()
	}
	_ = e.zctx.Term()
}

// splitHostPort splits a "host:port" identity at its last colon, as vLLM
// does with rsplit(":", 1).
func splitHostPort(id string) (host string, port int, ok bool) {
	i := strings.LastIndexByte(id, ':')
	if i <= 0 {
		return "", 0, false
	}
	p, err := strconv.Atoi(id[i+1:])
	if err != nil || p <= 0 || p > 65535 {
		return "", 0, false
	}
	return id[:i], p, true
}
