//go:build cgo

package zmq

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
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
	// Engine is the engine of the pods a bind socket hears from that no
	// PodConfig names (events.Engine); the zero value is vLLM.
	Engine events.Engine
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
	// Allow lists the sender networks a Bind socket accepts messages from
	// for pods named by a DNS name; default loopback only (127.0.0.0/8,
	// ::1), as Redis's protected mode. A pod named by an IP literal is
	// accepted from that address only, whatever Allow says. A refused
	// message is counted in Stats.SenderMismatch. Senders over ipc:// and
	// inproc:// are local processes and are not checked. In connect mode
	// the pod is the endpoint the subscriber dialled.
	Allow []netip.Prefix
	// NoSenderCheck turns the Bind sockets' sender verification off, for
	// networks where every peer that can reach the port is trusted.
	NoSenderCheck bool
	// MaxPodsPerSender bounds the pods one sender address may publish for
	// on a Bind socket (pods named by its own IP with different ports, or
	// by DNS names from an allowed network); messages naming more are
	// counted in Stats.SenderMismatch. It is also the default of
	// Events.MaxHoldersPerSender, which bounds the holders (pod x
	// data-parallel rank) one sender's messages make, the rank being in
	// the payload: one name with 4,200 ranks is 4,200 holders. A sender is
	// a bind-mode peer's IP address, or a connect-mode pod. Pods the
	// processor forgot (evicted) no longer count. Default 64: a vLLM pod
	// publishes for one name, its data-parallel ranks in the payload.
	MaxPodsPerSender int
	// Heartbeat is the ZMTP heartbeat interval on every connection; a
	// peer that answers none for three intervals is disconnected (a
	// crashed host, a partition), as one that closes its connection is at
	// once. Its pod is then "disconnected" and no pull source. Default 1s.
	Heartbeat time.Duration
}

// Subscriber receives KV events from engines over ZMQ and applies them
// through an events.Processor.
type Subscriber struct {
	cfg   SubscriberConfig
	proc  *events.Processor
	allow []netip.Prefix

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
	mon      *zmq4.Socket // its monitor's events
	// up is whether it is connected, as the monitor last said: written by
	// the receiver, read by Endpoints too.
	up atomic.Bool
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
	// engine is the pod's engine (PodConfig.Engine or, for pods not
	// configured, SubscriberConfig.Engine).
	engine events.Engine
}

// NewSubscriber checks cfg and returns a Subscriber; Run starts it.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	for _, ep := range cfg.Bind {
		if err := checkEndpoint(ep, false); err != nil {
			return nil, err
		}
	}
	if cfg.MaxPodsPerSender <= 0 {
		cfg.MaxPodsPerSender = 64
	}
	if cfg.Events.MaxHoldersPerSender <= 0 {
		cfg.Events.MaxHoldersPerSender = cfg.MaxPodsPerSender
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
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = time.Second
	}
	allow := cfg.Allow
	if allow == nil {
		allow = loopback
	}
	for _, p := range allow {
		if !p.IsValid() {
			return nil, fmt.Errorf("%w: invalid Allow network %v", events.ErrConfig, p)
		}
	}
	return &Subscriber{cfg: cfg, proc: proc, allow: allow, conns: map[string]*conn{}, sources: map[string]*source{},
		ready: make(chan struct{})}, nil
}

// checkEndpoint checks an endpoint to bind, or to connect to when connect
// is set, so that a typo fails at once rather than in libzmq's I/O thread
// later: a tcp:// one needs a host and a port ("*" or 0 only to bind; a
// source address before a ";" is allowed).
func checkEndpoint(ep string, connect bool) error {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		addr := rest[strings.LastIndexByte(rest, ';')+1:]
		host, port, err := net.SplitHostPort(addr)
		if err != nil || host == "" || connect && host == "*" {
			return fmt.Errorf("%w: %q: want tcp://HOST:PORT", ErrBadEndpoint, ep)
		}
		n, err := strconv.ParseUint(port, 10, 16)
		switch {
		case port == "*" && !connect:
		case err != nil || connect && n == 0:
			return fmt.Errorf("%w: %q: port %q", ErrBadEndpoint, ep, port)
		}
		return nil
	}
	for _, p := range []string{"ipc://", "inproc://"} {
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
	// Engine is the engine the pod runs (events.Engine); the zero value
	// is vLLM.
	Engine events.Engine
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
		if err := checkEndpoint(ep, true); err != nil {
			return err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	src := &source{pod: p.Pod, replay: p.Replay, timeout: s.cfg.ReplayTimeout, model: p.Model, engine: p.Engine}
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

// EndpointStatus is a connect-mode endpoint and whether its connection is
// up.
type EndpointStatus struct {
	Pod, Endpoint string
	Connected     bool
}

// Endpoints lists the connect-mode endpoints added with AddPod, by pod and
// endpoint, whether or not their engines ever published: an engine that
// cannot be reached shows here, while Status knows only holders heard from.
func (s *Subscriber) Endpoints() []EndpointStatus {
	s.mu.Lock()
	out := make([]EndpointStatus, 0, len(s.conns))
	for ep, c := range s.conns {
		out = append(out, EndpointStatus{Pod: c.src.pod, Endpoint: ep, Connected: c.up.Load()})
	}
	s.mu.Unlock()
	slices.SortFunc(out, func(a, b EndpointStatus) int {
		return cmp.Or(strings.Compare(a.Pod, b.Pod), strings.Compare(a.Endpoint, b.Endpoint))
	})
	return out
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
	// A Run that fails before it starts receiving may be retried.
	started := false
	defer func() {
		if !started {
			s.mu.Lock()
			s.running = false
			s.mu.Unlock()
		}
	}()

	var bind, bindMon *zmq4.Socket
	var addrs []string
	if len(s.cfg.Bind) > 0 {
		var err error
		if bind, err = s.newSub(); err != nil {
			return err
		}
		if bindMon, err = monitor(bind, zmq4.EVENT_ACCEPTED|zmq4.EVENT_DISCONNECTED); err != nil {
			bind.Close()
			return err
		}
		for _, ep := range s.cfg.Bind {
			if err := bind.Bind(ep); err != nil {
				closeMonitored(bind, bindMon)
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
			closeMonitored(bind, bindMon)
		}
		return err
	}
	started = true
	r := &receiver{s: s, poller: zmq4.NewPoller(), bind: bind, bindMon: bindMon, live: map[string]*conn{},
		bySock: map[*zmq4.Socket]*conn{}, byMon: map[*zmq4.Socket]*conn{}, podUp: map[string]int{}, senderNames: map[string]string{},
		links: newLinks(4*s.proc.Config().MaxHolders, s.cfg.MaxPodsPerSender, s.proc.Tracked)}
	if bind != nil {
		r.poller.Add(bindMon, zmq4.POLLIN)
		r.poller.Add(bind, zmq4.POLLIN)
	}
	r.reconcile()
	s.mu.Lock()
	s.addrs = addrs
	s.mu.Unlock()
	close(s.ready)
	r.loop(ctx)
	for _, c := range r.live {
		closeMonitored(c.sock, c.mon)
	}
	if bind != nil {
		closeMonitored(bind, bindMon)
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
	_ = sock.SetHeartbeatIvl(s.cfg.Heartbeat)
	_ = sock.SetHeartbeatTimeout(3 * s.cfg.Heartbeat)
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
	bindMon *zmq4.Socket
	live    map[string]*conn // connected endpoints
	bySock  map[*zmq4.Socket]*conn
	byMon   map[*zmq4.Socket]*conn // connect-mode monitors
	podUp   map[string]int         // connect mode: a pod's connected endpoints
	links   *links                 // bind mode
	sources map[string]*source
	// senderNames caches senderName's answers, by Peer-Address.
	senderNames map[string]string
	// downAfter: sender found the message's pod down, to be reported
	// once the message is handed (links.heard).
	downAfter bool
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
		// Connections first: a message must not find its pod's
		// connection unknown yet.
		for _, p := range polled {
			if p.Socket == r.bindMon || r.byMon[p.Socket] != nil {
				r.monitorEvents(ctx, p.Socket)
			}
		}
		for _, p := range polled {
			if p.Socket != r.bindMon && r.byMon[p.Socket] == nil {
				r.drain(ctx, p.Socket)
			}
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
		_ = r.poller.RemoveBySocket(c.mon)
		closeMonitored(c.sock, c.mon)
		delete(r.live, ep)
		delete(r.bySock, c.sock)
		delete(r.byMon, c.mon)
		r.connUp(c, false)
	}
	for ep, c := range r.s.conns {
		if r.live[ep] == c {
			continue
		}
		sock, err := r.s.newSub()
		var mon *zmq4.Socket
		if err == nil {
			if mon, err = monitor(sock, zmq4.EVENT_CONNECTED|zmq4.EVENT_DISCONNECTED); err != nil {
				sock.Close()
			} else if err = sock.Connect(ep); err != nil {
				closeMonitored(sock, mon)
			}
		}
		if err != nil {
			r.s.proc.Logger().Error("events/zmq: cannot connect to pod", "pod", c.src.pod, "endpoint", ep, "err", err)
			delete(r.s.conns, ep)
			continue
		}
		c.sock, c.mon = sock, mon
		r.live[ep] = c
		r.bySock[sock] = c
		r.byMon[mon] = c
		r.poller.Add(mon, zmq4.POLLIN)
		r.poller.Add(sock, zmq4.POLLIN)
	}
}

// drain receives what sock has ready, up to a bound so one busy socket
// cannot starve the others.
// drain handles the messages waiting on sock, up to 256, and reports
// whether it read them all.
func (r *receiver) drain(ctx context.Context, sock *zmq4.Socket) bool {
	var c *conn
	if sock != r.bind {
		if c = r.bySock[sock]; c == nil {
			return true
		}
	}
	for range 256 {
		r.downAfter = false
		var frames [][]byte
		var meta map[string]string
		var err error
		if c == nil {
			frames, meta, err = sock.RecvMessageBytesWithMetadata(zmq4.DONTWAIT, "Peer-Address")
		} else {
			frames, err = sock.RecvMessageBytes(zmq4.DONTWAIT)
		}
		if err != nil {
			return true // none waiting (EAGAIN), or none to read now
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
			m.Sender = c.src.pod
			if !ok {
				model = topic
			}
		} else {
			m.Sender = r.senderName(meta["Peer-Address"])
			if !ok {
				r.s.proc.NoPod(topic, m.Seq)
				continue
			}
			src = r.sources[pod]
			// A malformed name goes on to the processor, which drops and
			// counts it (bad_topic); it must take no slot of its sender's
			// pods or of the sources.
			valid := src != nil || events.ValidPodName(pod) == nil
			if valid && !r.sender(pod, meta["Peer-Address"], m.Seq) {
				continue
			}
			if src == nil {
				src = &source{pod: pod, engine: r.s.cfg.Engine}
				// Bounded like the holders: names a peer makes up must not
				// grow the map without end, nor pods gone fill it for good.
				// The processor tracks at most 3 x MaxHolders pods, so a
				// prune at 4 x frees a quarter at least (as links).
				if limit := 4 * r.s.proc.Config().MaxHolders; valid && len(r.sources) >= limit {
					r.pruneSources()
				}
				if valid && len(r.sources) < 4*r.s.proc.Config().MaxHolders {
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
		m.Pod, m.Model, m.Engine = src.pod, model, src.engine
		if src.replay != "" {
			m.Replay = src
		}
		r.s.proc.Handle(ctx, m)
		if r.downAfter {
			r.downAfter = false
			r.s.proc.PodConnected(m.Pod, false)
		}
	}
	return false
}

// senderName is a bind-mode message's events.Message.Sender: its peer's
// IP address, IPv4-mapped ones as IPv4; "" for a peer that is no TCP
// address (ipc://, inproc://: a local process). The names are cached, so
// that a message costs no allocation.
func (r *receiver) senderName(peer string) string {
	if name, ok := r.senderNames[peer]; ok {
		return name
	}
	name := ""
	if a, err := netip.ParseAddr(peer); err == nil {
		name = a.Unmap().String()
	}
	if len(r.senderNames) >= 4096 {
		clear(r.senderNames) // bounded: peers are what connects
	}
	r.senderNames[peer] = name
	return name
}

// pruneSources forgets the bind-mode pods heard from but not registered
// (AddPod) that the processor forgot.
func (r *receiver) pruneSources() {
	for pod, src := range r.sources {
		if !src.perRank && !r.s.proc.Tracked(pod) {
			delete(r.sources, pod)
		}
	}
}

// podOfConn names the pod of a connect-mode message, "" for bind mode.
func podOfConn(c *conn) string {
	if c == nil {
		return ""
	}
	return c.src.pod
}

// sender checks that a bind-socket message naming pod may come from peer,
// libzmq's "Peer-Address" of its connection, and tracks the pod's
// connection; false drops it, counted.
func (r *receiver) sender(pod, peer string, seq uint64) bool {
	addr, err := netip.ParseAddr(peer)
	if err != nil {
		// Not a TCP peer (ipc://: "uid:gid:pid", inproc://: none): a local
		// process, and no connection to track by address.
		return true
	}
	addr = addr.Unmap()
	if !r.s.cfg.NoSenderCheck {
		if want, named := events.PodAddr(pod); named && want != addr {
			r.s.proc.SenderMismatch(pod, peer+" (the pod is named by the address "+want.String()+", accepted from it only)", seq)
			return false
		} else if !named && !r.allowed(addr) {
			r.s.proc.SenderMismatch(pod, peer+" (outside the networks allowed to publish for DNS-named pods)", seq)
			return false
		}
	}
	ok, downAfter := r.links.heard(pod, addr, r.s.proc.PodConnected)
	if !ok {
		r.s.proc.SenderMismatch(pod, peer+" (past MaxPodsPerSender)", seq)
		return false
	}
	r.downAfter = downAfter
	return true
}

func (r *receiver) allowed(addr netip.Addr) bool {
	for _, p := range r.s.allow {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}

// monitorEvents reads the connection events mon has ready: the bind
// socket's accepted and closed connections, or a connect-mode endpoint's
// connects and disconnects.
func (r *receiver) monitorEvents(ctx context.Context, mon *zmq4.Socket) {
	for range 256 {
		ev, _, fd, err := mon.RecvEvent(zmq4.DONTWAIT)
		if err != nil {
			return
		}
		if mon == r.bindMon {
			switch ev {
			case zmq4.EVENT_ACCEPTED:
				r.links.accepted(fd, r.s.proc.PodConnected)
			case zmq4.EVENT_DISCONNECTED:
				// The closed connection's last messages are still
				// queued: handled after the close, they would bring a
				// dead engine back as live (see links). Bounded: live
				// engines keep the socket busy.
				for range closeDrainRounds {
					if r.drain(ctx, r.bind) {
						break
					}
				}
				r.links.closed(fd, r.s.proc.PodConnected)
			}
			continue
		}
		if c := r.byMon[mon]; c != nil {
			r.connUp(c, ev == zmq4.EVENT_CONNECTED)
		}
	}
}

// closeDrainRounds bounds the reads before a close is applied, to 64
// drains of 256 messages: live engines could keep the socket busy for
// good, and a dead connection's queue is longer only when the receiver is
// that far behind.
const closeDrainRounds = 64

// connUp records a connect-mode endpoint's state: its pod is connected
// while any of its endpoints is.
func (r *receiver) connUp(c *conn, up bool) {
	if c.up.Load() == up {
		return
	}
	c.up.Store(up)
	pod := c.src.pod
	if up {
		r.podUp[pod]++
		if r.podUp[pod] == 1 {
			r.s.proc.PodConnected(pod, true)
		}
		return
	}
	if r.podUp[pod]--; r.podUp[pod] <= 0 {
		delete(r.podUp, pod)
		r.s.proc.PodConnected(pod, false)
	}
}

// Source reports whether holder h may serve a pull now, and its state
// (events.Processor.Source); picker.Config.Sources takes it.
func (s *Subscriber) Source(h index.Holder) (state string, ok bool) { return s.proc.Source(h) }
