package zmq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	zmq4 "github.com/pebbe/zmq4"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/index"
)

// ErrBadEndpoint: an endpoint is not a ZMQ tcp://, ipc:// or inproc://
// address.
var ErrBadEndpoint = errors.New("events/zmq: bad endpoint")

// SubscriberConfig configures a Subscriber. Only Events.Sink is required.
type SubscriberConfig struct {
	// Events configures the state machine applying the events; see
	// events.Config for its defaults.
	Events events.Config
	// Bind lists endpoints one SUB socket binds, for engines configured to
	// connect to the router ("tcp://*:5557"; port 0 picks a free port,
	// which Addrs reports). Empty: no bind socket.
	Bind []string
	// TopicPrefix is the SUB subscription filter; "" receives every topic.
	TopicPrefix string
	// Topic maps a topic to (pod, model); default events.ParseTopic. In
	// connect mode the pod is the one given to AddPod and only the model is
	// taken from Topic (the whole topic when Topic does not match). A pod's
	// PodConfig.Model overrides the topic's; a message left with no model
	// (vLLM's default topic is empty) is dropped and counted.
	Topic events.TopicFunc
	// ReplayTimeout bounds the wait for each message of a replay reply;
	// default 2s (events.Config.ReplayDeadline bounds the whole replay).
	ReplayTimeout time.Duration
	// RcvHWM is the SUB sockets' receive high-water mark; default 100,000.
	RcvHWM int
	// MaxMessageSize bounds a received message's frames in bytes (libzmq
	// drops the connection of a peer sending more); default 64 MiB.
	MaxMessageSize int64
}

// Subscriber receives KV events from engines over ZMQ and applies them
// through an events.Processor.
type Subscriber struct {
	cfg  SubscriberConfig
	proc *events.Processor

	mu      sync.Mutex
	conns   map[string]*conn   // connect-mode endpoints, by endpoint
	sources map[string]*source // bind-mode pods, by pod
	dirty   atomic.Bool
	running bool
	addrs   []string
	ready   chan struct{}
}

// conn is one connect-mode endpoint; its socket belongs to the receive loop.
type conn struct {
	src      *source
	endpoint string
	sock     *zmq4.Socket
}

// source is where a message came from: its pod, and how to reach the
// pod's replay socket. Immutable once created; it is the messages'
// events.Replayer when it has a replay endpoint.
type source struct {
	pod     string
	replay  string
	timeout time.Duration
	// perRank: replay is rank 0's endpoint, rank r's TCP port is r higher
	// (vLLM's data-parallel rule), as for a pod registered for bind mode.
	perRank bool
	// model, when set, overrides the topic's (PodConfig.Model).
	model string
}

// NewSubscriber checks cfg and returns a Subscriber; Run starts it.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	for _, ep := range cfg.Bind {
		if err := checkEndpoint(ep); err != nil {
			return nil, err
		}
	}
	proc, err := events.NewProcessor(cfg.Events)
	if err != nil {
		return nil, err
	}
	if cfg.Topic == nil {
		cfg.Topic = events.ParseTopic
	}
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = 2 * time.Second
	}
	if cfg.RcvHWM <= 0 {
		cfg.RcvHWM = 100000
	}
	if cfg.MaxMessageSize <= 0 {
		cfg.MaxMessageSize = 64 << 20
	}
	return &Subscriber{cfg: cfg, proc: proc, conns: map[string]*conn{}, sources: map[string]*source{},
		ready: make(chan struct{})}, nil
}

func checkEndpoint(ep string) error {
	for _, p := range []string{"tcp://", "ipc://", "inproc://"} {
		if rest, ok := strings.CutPrefix(ep, p); ok && rest != "" {
			return nil
		}
	}
	return fmt.Errorf("%w: %q", ErrBadEndpoint, ep)
}

// AddPod registers a pod. With an endpoint, the subscriber connects a SUB
// socket to it (connect mode; libzmq reconnects on its own) and messages
// received there belong to pod, with replayEndpoint (may be "") serving
// their gaps. With endpoint "", the pod is one that connects to a Bind
// socket and replayEndpoint is its rank-0 replay socket; rank r's port is r
// higher. Call it for each data-parallel rank's endpoint of a pod in
// connect mode. Adding an endpoint again replaces it. Safe to call before
// and during Run.
func (s *Subscriber) AddPod(pod, endpoint, replayEndpoint string) error {
	return s.AddPodConfig(PodConfig{Pod: pod, Endpoint: endpoint, Replay: replayEndpoint})
}

// PodConfig is a pod AddPodConfig registers; see AddPod for Endpoint and
// Replay.
type PodConfig struct {
	Pod, Endpoint, Replay string
	// Model, when set, is the pod's model whatever its topic says. vLLM's
	// default topic is empty: a pod whose topic does not name its model
	// (kv@POD@MODEL) needs it, or its messages are dropped
	// (events.Stats.NoModel).
	Model string
}

// AddPodConfig is AddPod with the pod's model.
func (s *Subscriber) AddPodConfig(p PodConfig) error {
	if p.Pod == "" {
		return fmt.Errorf("%w: empty pod name", events.ErrConfig)
	}
	for _, ep := range []string{p.Endpoint, p.Replay} {
		if ep == "" {
			continue
		}
		if err := checkEndpoint(ep); err != nil {
			return err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	src := &source{pod: p.Pod, replay: p.Replay, timeout: s.cfg.ReplayTimeout, model: p.Model}
	if p.Endpoint == "" {
		src.perRank = true
		s.sources[p.Pod] = src
	} else {
		// A new conn, even for a known endpoint: the receive loop replaces
		// whatever conn it has for the endpoint with this one.
		s.conns[p.Endpoint] = &conn{src: src, endpoint: p.Endpoint}
	}
	s.dirty.Store(true)
	return nil
}

// RemovePod disconnects every endpoint added for pod and forgets its replay
// endpoint. The pod's index entries and its holders' status stay; a caller
// whose pod is gone for good removes it from the index (RemoveHolder).
func (s *Subscriber) RemovePod(pod string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.sources, pod)
	for ep, c := range s.conns {
		if c.src.pod == pod {
			delete(s.conns, ep)
		}
	}
	s.dirty.Store(true)
}

// Ready is closed once Run has bound the Bind endpoints and started
// applying events: Addrs is then valid. Connections to pods and from
// engines are made in the background after it.
func (s *Subscriber) Ready() <-chan struct{} { return s.ready }

// Addrs returns the endpoints the bind socket is bound to, in Config.Bind
// order, with the port a port 0 (or "*") got; nil before Ready.
func (s *Subscriber) Addrs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.addrs)
}

// Stats returns the global counters.
func (s *Subscriber) Stats() events.Stats { return s.proc.Stats() }

// Status returns every holder's status, sorted by pod and rank.
func (s *Subscriber) Status() []events.HolderStatus { return s.proc.Status() }

// LastSeq returns the sequence number of the last batch applied for h, and
// whether h is known (events.Processor.LastSeq).
func (s *Subscriber) LastSeq(h index.Holder) (uint64, bool) { return s.proc.LastSeq(h) }

// WaitApplied returns once holder h has applied batch seq or a later one,
// or with ctx's error.
func (s *Subscriber) WaitApplied(ctx context.Context, h index.Holder, seq uint64) error {
	return s.proc.WaitApplied(ctx, h, seq)
}

// Sync returns once every message received before the call has been
// handled, or with ctx's error.
func (s *Subscriber) Sync(ctx context.Context) error { return s.proc.Sync(ctx) }

// Run receives and applies events until ctx is done, then closes its
// sockets, lets the workers finish what is queued (running replays end at
// once) and returns nil. It returns an error only when a Bind endpoint
// cannot be bound.
func (s *Subscriber) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.running {
		s.mu.Unlock()
		return events.ErrRunning
	}
	s.running = true
	s.mu.Unlock()

	var bind *zmq4.Socket
	var addrs []string
	if len(s.cfg.Bind) > 0 {
		var err error
		if bind, err = s.newSub(); err != nil {
			return err
		}
		for _, ep := range s.cfg.Bind {
			if err := bind.Bind(ep); err != nil {
				bind.Close()
				return fmt.Errorf("events/zmq: bind %s: %w", ep, err)
			}
			addr, err := bind.GetLastEndpoint()
			if err != nil {
				addr = ep
			}
			addrs = append(addrs, addr)
		}
	}
	if err := s.proc.Start(ctx); err != nil {
		if bind != nil {
			bind.Close()
		}
		return err
	}
	r := &receiver{s: s, poller: zmq4.NewPoller(), bind: bind, live: map[string]*conn{}, bySock: map[*zmq4.Socket]*conn{}}
	if bind != nil {
		r.poller.Add(bind, zmq4.POLLIN)
	}
	r.reconcile()
	s.mu.Lock()
	s.addrs = addrs
	s.mu.Unlock()
	close(s.ready)
	r.loop(ctx)
	for _, c := range r.live {
		c.sock.Close()
	}
	if bind != nil {
		bind.Close()
	}
	s.proc.Close()
	return nil
}

func (s *Subscriber) newSub() (*zmq4.Socket, error) {
	sock, err := zmq4.NewSocket(zmq4.SUB)
	if err != nil {
		return nil, fmt.Errorf("events/zmq: SUB socket: %w", err)
	}
	_ = sock.SetRcvhwm(s.cfg.RcvHWM)
	_ = sock.SetMaxmsgsize(s.cfg.MaxMessageSize)
	_ = sock.SetLinger(0)
	if err := sock.SetSubscribe(s.cfg.TopicPrefix); err != nil {
		sock.Close()
		return nil, fmt.Errorf("events/zmq: subscribe: %w", err)
	}
	return sock, nil
}

// receiver is the receive loop's state; it alone touches the SUB sockets.
type receiver struct {
	s       *Subscriber
	poller  *zmq4.Poller
	bind    *zmq4.Socket
	live    map[string]*conn // connected endpoints
	bySock  map[*zmq4.Socket]*conn
	sources map[string]*source
}

func (r *receiver) loop(ctx context.Context) {
	const pollEvery = 50 * time.Millisecond
	for ctx.Err() == nil {
		if r.s.dirty.Swap(false) {
			r.reconcile()
		}
		if r.bind == nil && len(r.live) == 0 {
			select {
			case <-ctx.Done():
			case <-time.After(pollEvery):
			}
			continue
		}
		polled, err := r.poller.Poll(pollEvery)
		if err != nil {
			if zmq4.AsErrno(err) == zmq4.Errno(syscall.EINTR) {
				continue
			}
			r.s.proc.Logger().Error("events/zmq: poll failed", "err", err)
			time.Sleep(pollEvery)
			continue
		}
		for _, p := range polled {
			r.drain(ctx, p.Socket)
		}
	}
}

// reconcile makes the connected sockets match the registered endpoints.
func (r *receiver) reconcile() {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	r.sources = make(map[string]*source, len(r.s.sources))
	for pod, src := range r.s.sources {
		r.sources[pod] = src
	}
	for ep, c := range r.live {
		if r.s.conns[ep] == c {
			continue
		}
		_ = r.poller.RemoveBySocket(c.sock)
		c.sock.Close()
		delete(r.live, ep)
		delete(r.bySock, c.sock)
	}
	for ep, c := range r.s.conns {
		if r.live[ep] == c {
			continue
		}
		sock, err := r.s.newSub()
		if err == nil {
			if err = sock.Connect(ep); err != nil {
				sock.Close()
			}
		}
		if err != nil {
			r.s.proc.Logger().Error("events/zmq: cannot connect to pod", "pod", c.src.pod, "endpoint", ep, "err", err)
			delete(r.s.conns, ep)
			continue
		}
		c.sock = sock
		r.live[ep] = c
		r.bySock[sock] = c
		r.poller.Add(sock, zmq4.POLLIN)
	}
}

// drain receives what sock has ready, up to a bound so one busy socket
// cannot starve the others.
func (r *receiver) drain(ctx context.Context, sock *zmq4.Socket) {
	var c *conn
	if sock != r.bind {
		if c = r.bySock[sock]; c == nil {
			return
		}
	}
	for range 256 {
		frames, err := sock.RecvMessageBytes(zmq4.DONTWAIT)
		if err != nil {
			return
		}
		if len(frames) != 3 || len(frames[1]) != 8 {
			r.s.proc.BadMessage(podOfConn(c), "bad framing", "frames", len(frames))
			continue
		}
		m := events.Message{Seq: binary.BigEndian.Uint64(frames[1]), Payload: frames[2]}
		topic := string(frames[0])
		pod, model, ok := r.s.cfg.Topic(topic)
		var src *source
		if c != nil {
			src = c.src
			if !ok {
				model = topic
			}
		} else {
			if !ok {
				r.s.proc.NoPod(topic, m.Seq)
				continue
			}
			src = r.sources[pod]
			if src == nil {
				src = &source{pod: pod}
				// Bounded like the holders: names a peer makes up must not
				// grow the map without end.
				if len(r.sources) < r.s.proc.Config().MaxHolders {
					r.sources[pod] = src
				}
			}
		}
		if src.model != "" {
			model = src.model
		}
		if model == "" {
			r.s.proc.NoModel(src.pod, topic, m.Seq)
			continue
		}
		m.Pod, m.Model = src.pod, model
		if src.replay != "" {
			m.Replay = src
		}
		r.s.proc.Handle(ctx, m)
	}
}

// podOfConn names the pod of a connect-mode message, "" for bind mode.
func podOfConn(c *conn) string {
	if c == nil {
		return ""
	}
	return c.src.pod
}
