//go:build cgo

package zmq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvsource/kvsource/events"
)

// ReplayFormat is the reply format of a replay (ROUTER) socket.
type ReplayFormat uint8

const (
	// ReplayV26 is vLLM >= 0.26: [empty, topic, seq, payload] per batch, then
	// [empty, "", ff*8, ""].
	ReplayV26 ReplayFormat = iota
	// ReplayV25 is older vLLM: [empty, seq, payload] per batch, then
	// [empty, ff*8, ""].
	ReplayV25
)

func (f ReplayFormat) String() string {
	if f == ReplayV25 {
		return "v25"
	}
	return "v26"
}

// endSeq is the sequence frame of a replay's end marker.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// PublisherConfig configures a Publisher. Topic is required; without Bind
// or Connect the publisher binds vLLM's default endpoint, "tcp://*:5557".
// It publishes in the map layout without replay by default.
type PublisherConfig struct {
	// Bind is the endpoint the PUB socket binds, for subscribers that
	// connect to the engine (port 0 picks a free port; Addr reports it).
	// Connect is the endpoint it connects to, a subscriber's bind socket.
	// At most one is set. (vLLM chooses from the endpoint's form;
	// BindsEndpoint reproduces its rule.)
	Bind, Connect string
	// ReplayEndpoint, when set, is bound by a ROUTER socket answering replay
	// requests from the last BufferSteps batches.
	ReplayEndpoint string
	// Topic is the first frame of every message, e.g. "kv@10.0.0.1:8000@model".
	Topic string
	// Layout and Trim are passed to events.AppendBatch.
	Layout events.Layout
	Trim   int
	// ReplayFormat selects the replay reply format; default ReplayV26.
	ReplayFormat ReplayFormat
	// BufferSteps is how many batches replay keeps; default 10,000.
	BufferSteps int
	// HWM is the PUB socket's send high-water mark; default 100,000.
	HWM int
	// Drop, for tests, reports whether batch seq is kept from the live
	// stream (it stays in the replay buffer), simulating a lost message.
	Drop func(seq uint64) bool
	// FirstSeq is the first batch's sequence number: 0 as vLLM and SGLang
	// number; TensorRT-LLM starts at its start time in nanoseconds.
	FirstSeq uint64
}

// Publisher is a vLLM-compatible KV-event publisher: a PUB socket sending
// [topic, seq, payload] with seq counting from 0 (or FirstSeq), and an optional ROUTER
// replay socket. It is safe for concurrent use.
//
// Like every ZMQ publisher it drops what it sends before a subscriber's
// subscription has reached it ("slow joiner"), however the two connect. A
// caller that must not lose its first batches either waits for
// WaitSubscribed before publishing, or sets ReplayEndpoint: a Subscriber
// registered with the replay endpoint (AddPod) fetches the batches before
// the first one it receives.
type Publisher struct {
	cfg        PublisherConfig
	mu         sync.Mutex  // guards pub, seq, buf, ring and subscribed
	pub        *zmq.Socket // XPUB: a PUB that reads its subscriptions
	addr       string
	raddr      string
	subscribed bool
	seq        uint64
	buf        []byte
	ring       []ringEntry
	stop       chan struct{}
	done       chan struct{}
	close      sync.Once
	err        atomic.Pointer[error]
}

type ringEntry struct {
	seq     uint64
	payload []byte
	used    bool
}

// BindsEndpoint reports whether vLLM binds (rather than connects) endpoint.
func BindsEndpoint(endpoint string) bool {
	return strings.Contains(endpoint, "*") || strings.Contains(endpoint, "::") ||
		strings.HasPrefix(endpoint, "ipc://") || strings.HasPrefix(endpoint, "inproc://")
}

// NewPublisher opens the publisher's sockets.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.Topic == "" {
		return nil, fmt.Errorf("%w: Topic is required (subscribers drop messages without one)", events.ErrConfig)
	}
	if cfg.Bind != "" && cfg.Connect != "" {
		return nil, fmt.Errorf("%w: Bind and Connect both set", events.ErrConfig)
	}
	if cfg.Bind == "" && cfg.Connect == "" {
		cfg.Bind = "tcp://*:5557"
	}
	if cfg.BufferSteps <= 0 {
		cfg.BufferSteps = 10000
	}
	if cfg.HWM <= 0 {
		cfg.HWM = 100000
	}
	pub, err := zmq.NewSocket(zmq.XPUB)
	if err != nil {
		return nil, fmt.Errorf("events/zmq: publisher socket: %w", err)
	}
	_ = pub.SetSndhwm(cfg.HWM)
	_ = pub.SetLinger(time.Second)
	endpoint := cfg.Connect
	if cfg.Bind != "" {
		endpoint = cfg.Bind
		err = pub.Bind(endpoint)
	} else {
		err = pub.Connect(endpoint)
	}
	if err != nil {
		pub.Close()
		return nil, fmt.Errorf("events/zmq: publisher endpoint %s: %w", endpoint, err)
	}
	p := &Publisher{cfg: cfg, pub: pub, addr: endpoint, seq: cfg.FirstSeq, ring: make([]ringEntry, cfg.BufferSteps), stop: make(chan struct{}), done: make(chan struct{})}
	if cfg.Bind != "" {
		if a, err := pub.GetLastEndpoint(); err == nil {
			p.addr = a
		}
	}
	if cfg.ReplayEndpoint == "" {
		close(p.done)
		return p, nil
	}
	router, err := zmq.NewSocket(zmq.ROUTER)
	if err == nil {
		_ = router.SetLinger(0)
		if err = router.Bind(cfg.ReplayEndpoint); err != nil {
			router.Close()
		}
	}
	if err != nil {
		pub.Close()
		return nil, fmt.Errorf("events/zmq: replay endpoint %s: %w", cfg.ReplayEndpoint, err)
	}
	p.raddr = cfg.ReplayEndpoint
	if a, err := router.GetLastEndpoint(); err == nil {
		p.raddr = a
	}
	go p.serveReplay(router)
	return p, nil
}

// Addr is the endpoint the PUB socket is bound (with the port a port 0
// got) or connected to.
func (p *Publisher) Addr() string { return p.addr }

// ReplayAddr is the endpoint the replay socket is bound to, with the port a
// port 0 got; "" without replay.
func (p *Publisher) ReplayAddr() string { return p.raddr }

// WaitSubscribed returns once a subscription matching the topic has reached
// the publisher, so that what it publishes next is delivered to at least
// that subscriber, or with ctx's error.
func (p *Publisher) WaitSubscribed(ctx context.Context) error {
	const pollEvery = 10 * time.Millisecond
	for {
		p.mu.Lock()
		if p.pub == nil {
			p.mu.Unlock()
			return errClosed
		}
		p.readSubscriptionsLocked()
		ok := p.subscribed
		p.mu.Unlock()
		if ok {
			return nil
		}
		t := time.NewTimer(pollEvery)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// readSubscriptionsLocked reads the subscription messages the XPUB socket
// has queued: [1, prefix] subscribes, [0, prefix] unsubscribes. libzmq
// passes a prefix's subscription up when its first subscriber arrives and
// its unsubscription when its last one leaves, so the latest of them says
// whether one is subscribed now.
func (p *Publisher) readSubscriptionsLocked() {
	for {
		msg, err := p.pub.RecvBytes(zmq.DONTWAIT)
		if err != nil {
			return
		}
		if len(msg) > 0 && msg[0] <= 1 && strings.HasPrefix(p.cfg.Topic, string(msg[1:])) {
			p.subscribed = msg[0] == 1
		}
	}
}

var errClosed = errors.New("events/zmq: publisher closed")

// Publish encodes b and sends it with the next sequence number, which it
// returns.
func (p *Publisher) Publish(b *events.Batch) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buf = events.AppendBatch(p.buf[:0], b, p.cfg.Layout, p.cfg.Trim)
	return p.sendLocked(p.buf)
}

// PublishPayload sends payload as it is (for tests: malformed payloads)
// with the next sequence number, which it returns.
func (p *Publisher) PublishPayload(payload []byte) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sendLocked(payload)
}

func (p *Publisher) sendLocked(payload []byte) (uint64, error) {
	if p.pub == nil {
		return 0, errClosed
	}
	seq := p.seq
	p.seq++
	r := &p.ring[seq%uint64(len(p.ring))]
	r.seq, r.used = seq, true
	r.payload = append(r.payload[:0], payload...)
	if p.cfg.Drop != nil && p.cfg.Drop(seq) {
		return seq, nil
	}
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], seq)
	if _, err := p.pub.Send(p.cfg.Topic, zmq.SNDMORE); err != nil {
		return seq, fmt.Errorf("events/zmq: publish seq %d: %w", seq, err)
	}
	if _, err := p.pub.SendBytes(sb[:], zmq.SNDMORE); err != nil {
		return seq, fmt.Errorf("events/zmq: publish seq %d: %w", seq, err)
	}
	if _, err := p.pub.SendBytes(payload, 0); err != nil {
		return seq, fmt.Errorf("events/zmq: publish seq %d: %w", seq, err)
	}
	return seq, nil
}

// serveReplay answers [client, empty, start_seq] on the ROUTER socket until
// Close. The socket lives on this goroutine alone.
func (p *Publisher) serveReplay(router *zmq.Socket) {
	defer close(p.done)
	defer router.Close()
	poller := zmq.NewPoller()
	poller.Add(router, zmq.POLLIN)
	var items []ringEntry
	for {
		select {
		case <-p.stop:
			return
		default:
		}
		polled, err := poller.Poll(50 * time.Millisecond)
		if err != nil {
			p.err.Store(&err)
			return
		}
		if len(polled) == 0 {
			continue
		}
		frames, err := router.RecvMessageBytes(0)
		if err != nil || len(frames) != 3 || len(frames[2]) != 8 {
			continue
		}
		client, start := frames[0], binary.BigEndian.Uint64(frames[2])
		items = p.snapshot(items[:0], start)
		var sb [8]byte
		for _, it := range items {
			binary.BigEndian.PutUint64(sb[:], it.seq)
			if p.cfg.ReplayFormat == ReplayV25 {
				_, err = router.SendMessage(client, "", sb[:], it.payload)
			} else {
				_, err = router.SendMessage(client, "", p.cfg.Topic, sb[:], it.payload)
			}
			if err != nil {
				break
			}
		}
		if p.cfg.ReplayFormat == ReplayV25 {
			_, _ = router.SendMessage(client, "", endSeq, "")
		} else {
			_, _ = router.SendMessage(client, "", "", endSeq, "")
		}
	}
}

// snapshot appends copies of the buffered batches with seq >= start, in
// order.
func (p *Publisher) snapshot(dst []ringEntry, start uint64) []ringEntry {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := uint64(len(p.ring))
	first := uint64(0)
	if p.seq > n {
		first = p.seq - n
	}
	for s := max(first, start); s < p.seq; s++ {
		r := p.ring[s%n]
		if r.used && r.seq == s {
			dst = append(dst, ringEntry{seq: s, payload: append([]byte(nil), r.payload...)})
		}
	}
	return dst
}

// Close stops the replay socket and closes the PUB socket, giving queued
// messages up to a second to leave.
func (p *Publisher) Close() error {
	p.close.Do(func() {
		close(p.stop)
		<-p.done
		p.mu.Lock()
		p.pub.Close()
		p.pub = nil
		p.mu.Unlock()
	})
	if err := p.err.Load(); err != nil {
		return *err
	}
	return nil
}
