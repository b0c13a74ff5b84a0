package events

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// Errors the subscriber's API returns.
var (
	// ErrBadEndpoint: an endpoint is not a ZMQ tcp://, ipc:// or inproc://
	// address.
	ErrBadEndpoint = errors.New("events: bad endpoint")
	// ErrRunning: Run was called twice.
	ErrRunning = errors.New("events: subscriber already running")
	// ErrConfig: the Config cannot work.
	ErrConfig = errors.New("events: bad config")
)

// GapPolicy is what a holder's state becomes after a sequence gap that
// replay could not close, when events it missed may have removed blocks.
type GapPolicy uint8

const (
	// GapClear (the default) clears the holder's entries and goes on: from
	// then on the index holds a subset of what the engine holds, so it can
	// miss a hit but never sends a pull for a block that is gone.
	GapClear GapPolicy = iota
	// GapKeep keeps the entries and reports the holder "stale" until the
	// engine restarts or clears all its blocks; callers that want to keep
	// hits and can tolerate a failed pull (which falls back to compute)
	// choose this.
	GapKeep
)

func (p GapPolicy) String() string {
	if p == GapKeep {
		return "keep"
	}
	return "clear"
}

// TopicFunc maps a message topic to the pod and model it comes from; ok
// false drops the message (counted in Stats.BadMessages).
type TopicFunc func(topic string) (pod, model string, ok bool)

// ParseTopic is the default TopicFunc for llm-d's convention
// "kv@<pod>@<model>": the pod is up to the second '@', the model is the
// rest, which may itself hold '@' and '/'.
func ParseTopic(topic string) (pod, model string, ok bool) {
	rest, found := strings.CutPrefix(topic, "kv@")
	if !found {
		return "", "", false
	}
	pod, model, found = strings.Cut(rest, "@")
	if !found || pod == "" {
		return "", "", false
	}
	return pod, model, true
}

// Config configures a Subscriber. Only Sink is required.
type Config struct {
	// Sink receives the events, normally an *index.Index.
	Sink Sink
	// Bind lists endpoints one SUB socket binds, for engines configured to
	// connect to the router ("tcp://*:5557"). Empty: no bind socket.
	Bind []string
	// TopicPrefix is the SUB subscription filter; "" receives every topic.
	TopicPrefix string
	// Topic maps a topic to (pod, model); default ParseTopic. In connect
	// mode the pod is the one given to AddPod and only the model is taken
	// from Topic (the whole topic when Topic does not match).
	Topic TopicFunc
	// Workers is the number of goroutines applying events; default
	// GOMAXPROCS. All events of one pod go to the same worker, in order.
	Workers int
	// QueueLen is each worker's queue length in messages; default 4096.
	QueueLen int
	// QueueBytes bounds the payload bytes queued for each worker, the one
	// it is applying included; default 64 MiB or MaxMessageSize, whichever
	// is larger. A message that would pass it is dropped at once and its
	// pod marked for resync, as on a full queue (Stats.QueueFull): a
	// queue of QueueLen messages of up to MaxMessageSize each would
	// otherwise hold far more memory than the index.
	QueueBytes int64
	// EnqueueTimeout is how long the receive loop waits for room in a full
	// queue before dropping the message and marking its pod for resync;
	// default 100ms.
	EnqueueTimeout time.Duration
	// ReplayTimeout bounds the wait for each message of a replay reply;
	// default 2s. A holder whose replay failed does not try again for 30s,
	// so a dead replay endpoint cannot stall its worker on every gap.
	ReplayTimeout time.Duration
	// ReplayDeadline bounds a whole replay, however steadily its endpoint
	// sends; default 10s. A replay stops as soon as it has covered the
	// sequence numbers the holder is missing, so only a slow or misbehaving
	// endpoint reaches it: the replay counts as timed out and the gap
	// policy handles what it did not deliver. The worker applies no other
	// pod's events meanwhile.
	ReplayDeadline time.Duration
	// Gap is the policy after an unrecovered gap; default GapClear.
	Gap GapPolicy
	// InitialSeqs holds, for a router restarted from an index snapshot, the
	// last sequence number the snapshot includes for each holder: the first
	// message after it is checked against it, and what was missed is
	// fetched from the pod's replay endpoint.
	InitialSeqs map[index.Holder]uint64
	// Hasher, when set, checks hash agreement: every BlockStored that starts
	// at block 0 with token ids is rehashed with the router's settings and
	// compared with the engine's keys. Nil disables the check.
	Hasher *hashing.Hasher
	// ContentKeys, when set (a hasher with Algo hashing.Content), selects
	// content-key mode: index keys are computed from the events' token ids
	// rather than taken from the engine (see the package doc).
	ContentKeys *hashing.Hasher
	// ContentMapSize bounds each holder's engine-key to content-key map in
	// content-key mode; default 1<<20 entries.
	ContentMapSize int
	// MismatchLogInterval is the minimum time between two hash-mismatch log
	// lines of one holder, and between two chunked-offload warnings of one
	// holder; default one minute.
	MismatchLogInterval time.Duration
	// RcvHWM is the SUB sockets' receive high-water mark; default 100,000.
	RcvHWM int
	// MaxHolders bounds the holders (pod, data-parallel rank pairs) the
	// subscriber tracks, and the pods it keeps decode-error counts for:
	// in bind mode any peer names its pod in the topic and its rank in the
	// payload, so without a bound it could grow the subscriber's state
	// without end. Messages of a new holder past the bound are dropped
	// (Stats.HolderLimit, and a rate-limited log line); holders already
	// known are unaffected. Default 4096.
	MaxHolders int
	// MaxMessageSize bounds a received message's frames in bytes (libzmq
	// drops the connection of a peer sending more); default 64 MiB.
	MaxMessageSize int64
	// Logger receives the subscriber's logs; default slog.Default().
	Logger *slog.Logger
}

// Stats are the subscriber's global counters since it was created.
type Stats struct {
	Messages       uint64 // messages received
	BadMessages    uint64 // dropped: wrong frame count, sequence frame or topic
	Batches        uint64 // batches applied (live and replayed)
	Events         uint64 // events applied
	Blocks         uint64 // blocks in applied BlockStored and BlockRemoved events
	UnknownEvents  uint64 // events of unknown type, skipped
	DecodeErrors   uint64 // malformed payloads, dropped
	Gaps           uint64 // forward sequence jumps
	Replays        uint64 // replay requests answered in full (gaps, resyncs, joins)
	ReplayErrors   uint64 // replay requests that failed or timed out
	ReplayTimeouts uint64 // of ReplayErrors, those that ran out of ReplayTimeout or ReplayDeadline
	Replayed       uint64 // batches applied from replay
	Unrecovered    uint64 // gaps replay did not close; the GapPolicy applied
	Restarts       uint64 // sequences that went backwards: engine restarts
	Duplicates     uint64 // live batches already applied from replay
	QueueFull      uint64 // messages dropped because a worker queue was full
	HashChecks     uint64 // hash agreement checks run
	HashMismatches uint64 // hash agreement checks that failed
	Unresolved     uint64 // content mode: blocks whose content key was unknown
	HolderLimit    uint64 // dropped: their holder would be new and pass Config.MaxHolders
	// ChunkedOffload counts offload-tier BlockStored events (applied as
	// usual) whose non-zero block size differs from the GPU tier's: the
	// offloading connector keys one block per chunk of several GPU blocks,
	// so lookups in that tier undercount (see the package doc).
	ChunkedOffload uint64
}

// HolderStatus is the state of one holder's event stream.
type HolderStatus struct {
	Pod     string `json:"pod"`
	Model   string `json:"model"`
	Rank    int    `json:"dp_rank"`
	LastSeq uint64 `json:"last_seq"`
	// Gaps counts forward sequence jumps, Replays replay requests answered
	// in full, Unrecovered the lost ranges the GapPolicy handled.
	Gaps           uint64 `json:"gaps"`
	Replays        uint64 `json:"replays"`
	Unrecovered    uint64 `json:"unrecovered"`
	Restarts       uint64 `json:"restarts"`
	DecodeErrors   uint64 `json:"decode_errors"`
	HashChecks     uint64 `json:"hash_checks"`
	HashMismatches uint64 `json:"hash_mismatches"`
	// ChunkedOffload counts the holder's offload-tier BlockStored events
	// whose block size differs from its GPU tier's (Stats.ChunkedOffload).
	ChunkedOffload uint64 `json:"chunked_offload"`
	// State is "live", or "stale" while the holder's entries may include
	// blocks the engine no longer has (GapKeep after an unrecovered gap, or
	// a dropped message not yet resolved).
	State string `json:"state"`
}

// Holder returns the status's holder.
func (s HolderStatus) Holder() index.Holder { return index.Holder{Pod: s.Pod, Rank: s.Rank} }

type counters struct {
	messages, badMessages, batches, events, blocks, unknown, decodeErrors atomic.Uint64
	gaps, replays, replayErrors, replayed, unrecovered, restarts, dups    atomic.Uint64
	queueFull, hashChecks, hashMismatches, unresolved, replayTimeouts     atomic.Uint64
	holderLimit, chunkedOffload                                           atomic.Uint64
}

// Subscriber receives KV events from engines and applies them to a Sink.
type Subscriber struct {
	cfg     Config
	log     *slog.Logger
	limited *logLimiter
	c       counters

	mu      sync.Mutex
	conns   map[string]*conn   // connect-mode endpoints, by endpoint
	sources map[string]*source // bind-mode pods, by pod
	dirty   atomic.Bool
	running bool

	holders  sync.Map // index.Holder -> *holder
	pods     sync.Map // pod -> *podCounters
	nHolders atomic.Int64
	nPods    atomic.Int64
}

// conn is one connect-mode endpoint; its socket belongs to the receive loop.
type conn struct {
	src      *source
	endpoint string
	sock     *zmq.Socket
}

// source is where a message came from: its pod, and how to reach the
// pod's replay socket. Immutable once created.
type source struct {
	pod    string
	replay string
	// perRank: replay is rank 0's endpoint, rank r's TCP port is r higher
	// (vLLM's data-parallel rule), as for a pod registered for bind mode.
	perRank bool
}

type podCounters struct {
	decodeErrors atomic.Uint64
}

// NewSubscriber checks cfg and returns a Subscriber; Run starts it.
func NewSubscriber(cfg Config) (*Subscriber, error) {
	if cfg.Sink == nil {
		return nil, fmt.Errorf("%w: Sink is required", ErrConfig)
	}
	for _, ep := range cfg.Bind {
		if err := checkEndpoint(ep); err != nil {
			return nil, err
		}
	}
	if cfg.ContentKeys != nil && cfg.ContentKeys.Config().Algo != hashing.Content {
		return nil, fmt.Errorf("%w: ContentKeys must use hashing.Content, not %s", ErrConfig, cfg.ContentKeys.Config().Algo)
	}
	if cfg.Topic == nil {
		cfg.Topic = ParseTopic
	}
	if cfg.Workers <= 0 {
		cfg.Workers = runtime.GOMAXPROCS(0)
	}
	if cfg.QueueLen <= 0 {
		cfg.QueueLen = 4096
	}
	if cfg.EnqueueTimeout <= 0 {
		cfg.EnqueueTimeout = 100 * time.Millisecond
	}
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = 2 * time.Second
	}
	if cfg.ReplayDeadline <= 0 {
		cfg.ReplayDeadline = 10 * time.Second
	}
	if cfg.ContentMapSize <= 0 {
		cfg.ContentMapSize = 1 << 20
	}
	if cfg.MismatchLogInterval <= 0 {
		cfg.MismatchLogInterval = time.Minute
	}
	if cfg.MaxHolders <= 0 {
		cfg.MaxHolders = 4096
	}
	if cfg.RcvHWM <= 0 {
		cfg.RcvHWM = 100000
	}
	if cfg.MaxMessageSize <= 0 {
		cfg.MaxMessageSize = 64 << 20
	}
	if cfg.QueueBytes <= 0 {
		cfg.QueueBytes = max(64<<20, cfg.MaxMessageSize)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Subscriber{cfg: cfg, log: log, limited: &logLimiter{log: log, interval: time.Second},
		conns: map[string]*conn{}, sources: map[string]*source{}}, nil
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
	if pod == "" {
		return fmt.Errorf("%w: empty pod name", ErrConfig)
	}
	if endpoint != "" {
		if err := checkEndpoint(endpoint); err != nil {
			return err
		}
	}
	if replayEndpoint != "" {
		if err := checkEndpoint(replayEndpoint); err != nil {
			return err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if endpoint == "" {
		s.sources[pod] = &source{pod: pod, replay: replayEndpoint, perRank: true}
	} else {
		// A new conn, even for a known endpoint: the receive loop replaces
		// whatever conn it has for the endpoint with this one.
		s.conns[endpoint] = &conn{src: &source{pod: pod, replay: replayEndpoint}, endpoint: endpoint}
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

// Stats returns the global counters.
func (s *Subscriber) Stats() Stats {
	c := &s.c
	return Stats{
		Messages: c.messages.Load(), BadMessages: c.badMessages.Load(), Batches: c.batches.Load(),
		Events: c.events.Load(), Blocks: c.blocks.Load(), UnknownEvents: c.unknown.Load(),
		DecodeErrors: c.decodeErrors.Load(), Gaps: c.gaps.Load(), Replays: c.replays.Load(),
		ReplayErrors: c.replayErrors.Load(), ReplayTimeouts: c.replayTimeouts.Load(), Replayed: c.replayed.Load(), Unrecovered: c.unrecovered.Load(),
		Restarts: c.restarts.Load(), Duplicates: c.dups.Load(), QueueFull: c.queueFull.Load(),
		HashChecks: c.hashChecks.Load(), HashMismatches: c.hashMismatches.Load(), Unresolved: c.unresolved.Load(),
		HolderLimit: c.holderLimit.Load(), ChunkedOffload: c.chunkedOffload.Load(),
	}
}

// Status returns every holder's status, sorted by pod and rank. A pod whose
// payloads all failed to decode (so no holder is known) is listed as rank 0.
func (s *Subscriber) Status() []HolderStatus {
	var out []HolderStatus
	seen := map[string]bool{}
	s.holders.Range(func(_, v any) bool {
		h := v.(*holder)
		st := h.status()
		if pc, ok := s.pods.Load(h.id.Pod); ok {
			st.DecodeErrors = pc.(*podCounters).decodeErrors.Load()
		}
		seen[h.id.Pod] = true
		out = append(out, st)
		return true
	})
	s.pods.Range(func(k, v any) bool {
		pod := k.(string)
		if n := v.(*podCounters).decodeErrors.Load(); n > 0 && !seen[pod] {
			out = append(out, HolderStatus{Pod: pod, DecodeErrors: n, State: "stale"})
		}
		return true
	})
	slices.SortFunc(out, func(a, b HolderStatus) int {
		if c := strings.Compare(a.Pod, b.Pod); c != 0 {
			return c
		}
		return a.Rank - b.Rank
	})
	return out
}

// LastSeq returns the sequence number of the last batch applied for h, and
// whether h is known. A service snapshotting the index records these as the
// next run's Config.InitialSeqs.
func (s *Subscriber) LastSeq(h index.Holder) (uint64, bool) {
	v, ok := s.holders.Load(h)
	if !ok {
		return 0, false
	}
	return v.(*holder).lastSeq.Load(), true
}

// podCounters returns pod's counters, nil when pod is new and
// Config.MaxHolders pods already have some.
func (s *Subscriber) podCounters(pod string) *podCounters {
	if v, ok := s.pods.Load(pod); ok {
		return v.(*podCounters)
	}
	if s.nPods.Add(1) > int64(s.cfg.MaxHolders) {
		s.nPods.Add(-1)
		return nil
	}
	v, loaded := s.pods.LoadOrStore(pod, &podCounters{})
	if loaded {
		s.nPods.Add(-1)
	}
	return v.(*podCounters)
}

// message is one received ZMQ message on its way to a worker.
type message struct {
	src     *source
	model   string
	seq     uint64
	payload []byte
}

// Run receives and applies events until ctx is done, then closes its
// sockets, lets the workers finish what is queued and returns nil. It
// returns an error only when a Bind endpoint cannot be bound.
func (s *Subscriber) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.running {
		s.mu.Unlock()
		return ErrRunning
	}
	s.running = true
	s.mu.Unlock()

	var bind *zmq.Socket
	if len(s.cfg.Bind) > 0 {
		var err error
		if bind, err = s.newSub(); err != nil {
			return err
		}
		for _, ep := range s.cfg.Bind {
			if err := bind.Bind(ep); err != nil {
				bind.Close()
				return fmt.Errorf("events: bind %s: %w", ep, err)
			}
		}
	}
	workers := make([]*worker, s.cfg.Workers)
	var wg sync.WaitGroup
	for i := range workers {
		workers[i] = newWorker(s)
		wg.Add(1)
		go func() {
			defer wg.Done()
			workers[i].run()
		}()
	}
	r := &receiver{s: s, workers: workers, poller: zmq.NewPoller(), bind: bind, live: map[string]*conn{}, bySock: map[*zmq.Socket]*conn{}}
	if bind != nil {
		r.poller.Add(bind, zmq.POLLIN)
	}
	s.dirty.Store(true)
	r.loop(ctx)
	for _, c := range r.live {
		c.sock.Close()
	}
	if bind != nil {
		bind.Close()
	}
	for _, w := range workers {
		close(w.in)
	}
	wg.Wait()
	return nil
}

func (s *Subscriber) newSub() (*zmq.Socket, error) {
	sock, err := zmq.NewSocket(zmq.SUB)
	if err != nil {
		return nil, fmt.Errorf("events: SUB socket: %w", err)
	}
	_ = sock.SetRcvhwm(s.cfg.RcvHWM)
	_ = sock.SetMaxmsgsize(s.cfg.MaxMessageSize)
	_ = sock.SetLinger(0)
	if err := sock.SetSubscribe(s.cfg.TopicPrefix); err != nil {
		sock.Close()
		return nil, fmt.Errorf("events: subscribe: %w", err)
	}
	return sock, nil
}

// receiver is the receive loop's state; it alone touches the SUB sockets.
type receiver struct {
	s       *Subscriber
	workers []*worker
	poller  *zmq.Poller
	bind    *zmq.Socket
	live    map[string]*conn // connected endpoints
	bySock  map[*zmq.Socket]*conn
	sources map[string]*source
	timer   *time.Timer
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
			if zmq.AsErrno(err) == zmq.Errno(syscall.EINTR) {
				continue
			}
			r.s.log.Error("events: poll failed", "err", err)
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
			r.s.log.Error("events: cannot connect to pod", "pod", c.src.pod, "endpoint", ep, "err", err)
			delete(r.s.conns, ep)
			continue
		}
		c.sock = sock
		r.live[ep] = c
		r.bySock[sock] = c
		r.poller.Add(sock, zmq.POLLIN)
	}
}

// drain receives what sock has ready, up to a bound so one busy socket
// cannot starve the others.
func (r *receiver) drain(ctx context.Context, sock *zmq.Socket) {
	var c *conn
	if sock != r.bind {
		if c = r.bySock[sock]; c == nil {
			return
		}
	}
	for range 256 {
		frames, err := sock.RecvMessageBytes(zmq.DONTWAIT)
		if err != nil {
			return
		}
		r.s.c.messages.Add(1)
		if len(frames) != 3 || len(frames[1]) != 8 {
			r.s.c.badMessages.Add(1)
			r.s.limited.logf(slog.LevelWarn, "events: dropped message with bad framing", podOfConn(c), "frames", len(frames))
			continue
		}
		m := message{seq: binary.BigEndian.Uint64(frames[1]), payload: frames[2]}
		topic := string(frames[0])
		pod, model, ok := r.s.cfg.Topic(topic)
		if c != nil {
			m.src = c.src
			if !ok {
				model = topic
			}
		} else {
			if !ok {
				r.s.c.badMessages.Add(1)
				r.s.limited.logf(slog.LevelWarn, "events: dropped message with unknown topic", "", "topic", topic, "seq", m.seq)
				continue
			}
			m.src = r.sources[pod]
			if m.src == nil {
				m.src = &source{pod: pod}
				// Bounded like the holders: names a peer makes up must not
				// grow the map without end.
				if len(r.sources) < r.s.cfg.MaxHolders {
					r.sources[pod] = m.src
				}
			}
		}
		m.model = model
		r.enqueue(ctx, m)
	}
}

func (r *receiver) enqueue(ctx context.Context, m message) {
	w := r.workers[podHash(m.src.pod)%uint32(len(r.workers))]
	n := int64(len(m.payload))
	if w.queued.Add(n) > r.s.cfg.QueueBytes {
		w.queued.Add(-n)
		r.s.limited.logf(slog.LevelWarn, "events: worker queue over its byte bound; message dropped, its pod marked for resync", m.src.pod,
			"seq", m.seq, "bytes", n, "queue_bytes", r.s.cfg.QueueBytes)
		r.dropped(w, m)
		return
	}
	select {
	case w.in <- m:
		w.congested = false
		return
	default:
	}
	if w.congested {
		// Still full since the last wait ran out: waiting again for every
		// message would stall the other workers' pods too.
		w.queued.Add(-n)
		r.dropped(w, m)
		return
	}
	if r.timer == nil {
		r.timer = time.NewTimer(r.s.cfg.EnqueueTimeout)
	} else {
		r.timer.Reset(r.s.cfg.EnqueueTimeout)
	}
	select {
	case w.in <- m:
		r.timer.Stop()
		return
	case <-ctx.Done():
	case <-r.timer.C:
	}
	w.queued.Add(-n)
	w.congested = true
	r.s.log.Warn("events: worker queue full; dropping its messages until it drains, their pods marked for resync",
		"pod", m.src.pod, "seq", m.seq)
	r.dropped(w, m)
}

func (r *receiver) dropped(w *worker, m message) {
	r.s.c.queueFull.Add(1)
	w.markResync(m.src.pod, m.seq)
}

// podOfConn names the pod of a connect-mode message, "" for bind mode.
func podOfConn(c *conn) string {
	if c == nil {
		return ""
	}
	return c.src.pod
}

func podHash(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}
