package events

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"
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

// PublisherConfig configures a Publisher. The zero value publishes on vLLM's
// default endpoint in the map layout without replay.
type PublisherConfig struct {
	// Endpoint is bound when it holds "*" or "::" or is ipc:// or inproc://,
	// else connected, as vLLM does. Default "tcp://*:5557".
	Endpoint string
	// ReplayEndpoint, when set, is bound by a ROUTER socket answering replay
	// requests from the last BufferSteps batches.
	ReplayEndpoint string
	// Topic is the first frame of every message, e.g. "kv@10.0.0.1:8000@model".
	Topic string
	// Layout and Trim are passed to AppendBatch.
	Layout Layout
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
}

// Publisher is a vLLM-compatible KV-event publisher: a PUB socket sending
// [topic, seq, payload] with seq counting from 0, and an optional ROUTER
// replay socket. It is safe for concurrent use.
type Publisher struct {
	cfg   PublisherConfig
	mu    sync.Mutex // guards pub, seq, buf and ring
	pub   *zmq.Socket
	seq   uint64
	buf   []byte
	ring  []ringEntry
	stop  chan struct{}
	done  chan struct{}
	close sync.Once
	err   atomic.Pointer[error]
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
	if cfg.Endpoint == "" {
		cfg.Endpoint = "tcp://*:5557"
	}
	if cfg.BufferSteps <= 0 {
		cfg.BufferSteps = 10000
	}
	if cfg.HWM <= 0 {
		cfg.HWM = 100000
	}
	pub, err := zmq.NewSocket(zmq.PUB)
	if err != nil {
		return nil, fmt.Errorf("events: publisher socket: %w", err)
	}
	_ = pub.SetSndhwm(cfg.HWM)
	_ = pub.SetLinger(time.Second)
	if BindsEndpoint(cfg.Endpoint) {
		err = pub.Bind(cfg.Endpoint)
	} else {
		err = pub.Connect(cfg.Endpoint)
	}
	if err != nil {
		pub.Close()
		return nil, fmt.Errorf("events: publisher endpoint %s: %w", cfg.Endpoint, err)
	}
	p := &Publisher{cfg: cfg, pub: pub, ring: make([]ringEntry, cfg.BufferSteps), stop: make(chan struct{}), done: make(chan struct{})}
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
		return nil, fmt.Errorf("events: replay endpoint %s: %w", cfg.ReplayEndpoint, err)
	}
	go p.serveReplay(router)
	return p, nil
}

// Publish encodes b and sends it with the next sequence number, which it
// returns.
func (p *Publisher) Publish(b *Batch) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buf = AppendBatch(p.buf[:0], b, p.cfg.Layout, p.cfg.Trim)
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
		return 0, errors.New("events: publisher closed")
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
		return seq, fmt.Errorf("events: publish seq %d: %w", seq, err)
	}
	if _, err := p.pub.SendBytes(sb[:], zmq.SNDMORE); err != nil {
		return seq, fmt.Errorf("events: publish seq %d: %w", seq, err)
	}
	if _, err := p.pub.SendBytes(payload, 0); err != nil {
		return seq, fmt.Errorf("events: publish seq %d: %w", seq, err)
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
