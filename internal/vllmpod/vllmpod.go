// Package vllmpod is a vLLM-style KV-event producer for tests: a PUB socket
// sending [topic, seq, payload] and a ROUTER replay socket that answers the
// way vLLM's ZmqEventPublisher does, losses included.
//
// vLLM's replay handler sends every buffered batch from the requested
// sequence number, then an end marker, on a ROUTER socket with the default
// send high-water mark (1000 messages); a ROUTER never blocks a send, it
// drops the message when the peer's pipe is full. A reader slower than the
// sender therefore loses replies in transit although the engine still
// buffers them. The replay socket here sends each reply with DONTWAIT and
// ROUTER_MANDATORY, so a full pipe shows as EAGAIN, and drops (and counts)
// the reply then: the reader sees exactly what vLLM's drops leave it.
package vllmpod

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// Config configures a Pod.
type Config struct {
	// Endpoint is the PUB socket's, bound unless Connect.
	Endpoint string
	// Connect dials Endpoint, a router's bind socket, instead of binding
	// it, as llm-d's simulator does.
	Connect bool
	// ReplayEndpoint, when set, is bound by the ROUTER replay socket.
	ReplayEndpoint string
	// Topic is every message's first frame; vLLM's default is "".
	Topic string
	// BufferSteps is how many batches the replay buffer keeps; default
	// 10,000, vLLM's buffer_steps.
	BufferSteps int
	// ReplaySndHWM is the replay socket's send high-water mark; 0 keeps
	// libzmq's default (1000), as vLLM does.
	ReplaySndHWM int
}

type entry struct {
	seq     uint64
	payload []byte
}

// Pod is one simulated engine rank. Publish and Withhold are safe for
// concurrent use.
type Pod struct {
	cfg Config

	mu  sync.Mutex // guards pub, seq and buf
	pub *zmq.Socket
	seq uint64
	buf []entry // oldest first; the last BufferSteps are the buffer

	dropped, served atomic.Uint64
	stop            chan struct{}
	done            chan struct{}
	closeOnce       sync.Once
}

// endSeq is the sequence frame of the end marker: -1 as 8 signed bytes.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Start binds the pod's sockets and starts answering replay requests.
func Start(cfg Config) (*Pod, error) {
	if cfg.BufferSteps <= 0 {
		cfg.BufferSteps = 10000
	}
	pub, err := zmq.NewSocket(zmq.PUB)
	if err != nil {
		return nil, err
	}
	_ = pub.SetLinger(0)
	_ = pub.SetSndhwm(0)
	if cfg.Connect {
		err = pub.Connect(cfg.Endpoint)
	} else {
		err = pub.Bind(cfg.Endpoint)
	}
	if err != nil {
		pub.Close()
		return nil, fmt.Errorf("vllmpod: endpoint %s: %w", cfg.Endpoint, err)
	}
	p := &Pod{cfg: cfg, pub: pub, stop: make(chan struct{}), done: make(chan struct{})}
	if cfg.ReplayEndpoint == "" {
		close(p.done)
		return p, nil
	}
	router, err := zmq.NewSocket(zmq.ROUTER)
	if err == nil {
		_ = router.SetLinger(0)
		_ = router.SetRouterMandatory(1)
		if cfg.ReplaySndHWM > 0 {
			_ = router.SetSndhwm(cfg.ReplaySndHWM)
		}
		if err = router.Bind(cfg.ReplayEndpoint); err != nil {
			router.Close()
		}
	}
	if err != nil {
		pub.Close()
		return nil, fmt.Errorf("vllmpod: replay %s: %w", cfg.ReplayEndpoint, err)
	}
	go p.serve(router)
	return p, nil
}

// Publish sends payload with the next sequence number and buffers it for
// replay; it returns the sequence number.
func (p *Pod) Publish(payload []byte) (uint64, error) { return p.next(payload, true) }

// Withhold buffers payload under the next sequence number without sending
// it: a batch the live stream lost, which only replay can deliver.
func (p *Pod) Withhold(payload []byte) uint64 {
	seq, _ := p.next(payload, false)
	return seq
}

func (p *Pod) next(payload []byte, send bool) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pub == nil {
		return 0, errors.New("vllmpod: closed")
	}
	seq := p.seq
	p.seq++
	if len(p.buf) == 2*p.cfg.BufferSteps {
		p.buf = append(p.buf[:0], p.buf[p.cfg.BufferSteps:]...)
	}
	p.buf = append(p.buf, entry{seq: seq, payload: append([]byte(nil), payload...)})
	if !send {
		return seq, nil
	}
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], seq)
	if _, err := p.pub.SendMessage(p.cfg.Topic, sb[:], payload); err != nil {
		return seq, fmt.Errorf("vllmpod: publish %d: %w", seq, err)
	}
	return seq, nil
}

// Dropped is the number of replay replies (batches and end markers)
// dropped because the reader's pipe was full.
func (p *Pod) Dropped() uint64 { return p.dropped.Load() }

// Served is the number of replay requests answered.
func (p *Pod) Served() uint64 { return p.served.Load() }

func (p *Pod) serve(router *zmq.Socket) {
	defer close(p.done)
	defer router.Close()
	poller := zmq.NewPoller()
	poller.Add(router, zmq.POLLIN)
	for {
		select {
		case <-p.stop:
			return
		default:
		}
		polled, err := poller.Poll(20 * time.Millisecond)
		if err != nil || len(polled) == 0 {
			continue
		}
		frames, err := router.RecvMessageBytes(0)
		if err != nil || len(frames) != 3 || len(frames[2]) != 8 {
			continue
		}
		client, start := frames[0], binary.BigEndian.Uint64(frames[2])
		var sb [8]byte
		for _, e := range p.from(start) {
			binary.BigEndian.PutUint64(sb[:], e.seq)
			p.send(router, client, []byte(p.cfg.Topic), sb[:], e.payload)
		}
		p.send(router, client, nil, endSeq, nil)
		p.served.Add(1)
	}
}

// send sends one reply [client, "", topic, seq, payload] without blocking,
// dropping it when the client's pipe is full (or the client is gone).
func (p *Pod) send(router *zmq.Socket, client, topic, seq, payload []byte) {
	if _, err := router.SendBytes(client, zmq.DONTWAIT|zmq.SNDMORE); err != nil {
		p.dropped.Add(1)
		return
	}
	// Once its first frame is queued the rest of the message goes too.
	_, _ = router.SendBytes(nil, zmq.SNDMORE)
	_, _ = router.SendBytes(topic, zmq.SNDMORE)
	_, _ = router.SendBytes(seq, zmq.SNDMORE)
	_, _ = router.SendBytes(payload, 0)
}

func (p *Pod) from(start uint64) []entry {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []entry
	for _, e := range p.buf[max(0, len(p.buf)-p.cfg.BufferSteps):] {
		if e.seq >= start {
			out = append(out, e)
		}
	}
	return out
}

// Close stops the replay socket and closes the PUB socket.
func (p *Pod) Close() {
	p.closeOnce.Do(func() {
		close(p.stop)
		<-p.done
		p.mu.Lock()
		p.pub.Close()
		p.pub = nil
		p.mu.Unlock()
	})
}
