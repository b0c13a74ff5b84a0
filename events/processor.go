package events

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/boundmap"
	"github.com/kvsource/kvsource/internal/notify"
	"github.com/kvsource/kvsource/internal/ratelog"
)

// MaxModelBytes bounds a message's model name: Hugging Face names
// (org/name, 96 bytes each at most) with a revision or an adapter fit well
// within it.
const MaxModelBytes = 512

// Errors the Processor's API returns.
var (
	// ErrConfig: the Config cannot work.
	ErrConfig = errors.New("events: bad config")
	// ErrRunning: Start was called twice.
	ErrRunning = errors.New("events: already running")
	// ErrReplayTimeout is wrapped by a Replayer's error when its endpoint
	// went quiet for longer than the transport waits; it is counted in
	// Stats.ReplayTimeouts, as is a replay that ran out of
	// Config.ReplayDeadline.
	ErrReplayTimeout = errors.New("events: replay timed out")
	// ErrSenderRefused is returned by WaitApplied when the pod's messages
	// are being dropped because their sender may not publish for it (see
	// SenderMismatch): waiting longer would not apply them.
	ErrSenderRefused = errors.New("events: sender may not publish for the pod")
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

// Config configures a Processor. Only Sink is required.
type Config struct {
	// Sink receives the events, normally an *index.Index.
	Sink Sink
	// Workers is the number of goroutines applying events; default
	// GOMAXPROCS. All events of one pod go to the same worker, in order.
	Workers int
	// QueueLen is each worker's queue length in messages, and the number
	// of a pod's messages kept behind the pod's running replay; default
	// 4096.
	QueueLen int
	// QueueBytes bounds the payload bytes handed to each worker and not yet
	// applied, those kept behind a replay included; default 64 MiB. A
	// message that would pass it is dropped at once and its pod marked for
	// resync, as on a full queue (Stats.QueueFull): QueueLen messages of a
	// transport's largest size would otherwise hold far more memory than
	// the index. Set it at least to the transport's largest message.
	QueueBytes int64
	// EnqueueTimeout is how long Handle waits for room in a full queue
	// before dropping the message and marking its pod for resync; default
	// 100ms.
	EnqueueTimeout time.Duration
	// ReplayDeadline bounds a whole replay, however steadily its endpoint
	// sends; default 10s. A replay stops as soon as it has covered the
	// sequence numbers the holder is missing, so only a slow or
	// misbehaving endpoint reaches it: the replay counts as timed out and
	// the gap policy handles what it did not deliver. A replay runs off
	// the worker: only its own pod's later messages wait for it. A holder
	// whose replay failed does not try again for 30s.
	ReplayDeadline time.Duration
	// ReplayRounds bounds the replay requests of one replay: vLLM's replay
	// socket drops the replies a slower reader cannot take in time, so a
	// replay whose replies have holes the engine still buffers asks again
	// from the first missing batch, within the one ReplayDeadline; default
	// 8. Past the last round the rest counts as lost.
	ReplayRounds int
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
	// ContentKeysHint names, in the hash-mismatch log, how the user turns
	// content-key mode on; default "content-key mode
	// (events.Config.ContentKeys)" (kvsource serve sets "--keys content").
	ContentKeysHint string
	// SenderCheckHint names, in the log line of a message dropped for its
	// sender, how the user lets that sender publish; default
	// "zmq.SubscriberConfig.Allow, or NoSenderCheck" (kvsource serve names
	// its --events-allow and --events-no-sender-check).
	SenderCheckHint string
	// ContentMapSize bounds each holder's engine-key to content-key map in
	// content-key mode; default 1<<20 entries.
	ContentMapSize int
	// MismatchLogInterval is the minimum time between two hash-mismatch log
	// lines of one holder, and between two chunked-offload warnings of one
	// holder; default one minute.
	MismatchLogInterval time.Duration
	// MaxHolders bounds the holders (pod, data-parallel rank pairs) the
	// processor tracks, and the pods it keeps per-pod state for: a peer
	// may name any pod and any rank, so without a bound it could grow the
	// processor's state without end. A new holder past the bound makes
	// room: a holder is forgotten and its entries cleared (Stats.Evicted,
	// and a rate-limited log line), so that a new real pod is never
	// locked out by names a peer made up. The victim is taken from the
	// senders (Message.Sender) holding more than their share, MaxHolders
	// over the number of senders, first, so that a flood from a few hosts
	// evicts its own holders and not an idle healthy engine's; then from
	// the holders not live (stale, disconnected, reconnected, in
	// conflict); then the least recently heard. Default 4096.
	MaxHolders int
	// MaxHoldersPerSender bounds the holders whose first message came
	// from one Message.Sender: a new holder past it is not made and its
	// message dropped (Stats.SenderHolders). One host names one pod per
	// engine, and an engine one holder per data-parallel rank, while a
	// peer can name as many ranks as it likes under one name. Default 64
	// (package events/zmq sets its MaxPodsPerSender).
	MaxHoldersPerSender int
	// SnapshotExpiry is how long a holder of InitialSeqs that is never
	// heard from keeps its entries: after it the processor removes them
	// from the Sink and forgets its sequence number (when the Sink
	// implements HolderRemover, as *index.Index does), so that pods
	// gone for good, or names a peer made up before a restart, do not
	// stay for ever. Default 10 minutes.
	SnapshotExpiry time.Duration
	// ConflictWindow is how close together ConflictRestarts sequence
	// numbers going backwards must come for a holder to be in state
	// conflict: two engines publishing under one name, or a peer
	// replaying old numbers. A holder in conflict has its entries cleared
	// once, its messages dropped (counted) and is no pull source, until no
	// number went backwards for a whole window; then it starts again as a
	// new holder. Default one minute.
	ConflictWindow time.Duration
	// ConflictRestarts is the number of backwards sequence numbers within
	// ConflictWindow that put a holder in conflict; default 3. An engine
	// restarts in tens of seconds at best, so three in a minute is not
	// one engine.
	ConflictRestarts int
	// Logger receives the processor's logs; default slog.Default().
	Logger *slog.Logger
	// LogBudget bounds the log lines of each kind (one message, whatever
	// the pod it names) to this many a second across all pods; default
	// 10. Each kind is also limited per pod (once a second, or per
	// MismatchLogInterval), but peers choose the names: 6,000 made-up
	// pods disconnecting would write 6,000 lines. The next line of a kind
	// the budget cut says how many it left out (left_out).
	LogBudget int
	// Tap, when set, is called with every batch just before it applies,
	// live or replayed, in the order each holder applies them: gaps
	// repaired, duplicates dropped. A relay forwards these to a shared
	// log, whose consumers run the same sequencing over them. It runs on
	// the holder's worker, so a slow Tap delays that worker's pods; the
	// payload is valid only during the call.
	Tap func(TapBatch)
	// Tapped says the messages are another Processor's Tap batches (a
	// replica reading a relay's log): they carry no heartbeats, which
	// never reach a Tap, so a batch repeating the last applied number is
	// always a restart the relay applied, such as a new process's empty
	// first batch at 0 after its predecessor's 0. The replica has no
	// connection events to tell the two apart, as a relay's subscriber does.
	Tapped bool
}

// TapBatch is one batch as Config.Tap sees it.
type TapBatch struct {
	Model, Pod string
	Rank       int
	Seq        uint64
	Payload    []byte
}

// Message is one batch a transport received: [topic, seq, payload] of a
// vLLM publisher, or the same fields from another transport.
type Message struct {
	// Pod names the engine the message came from; Model is its model.
	Pod, Model string
	// Seq is the publisher's sequence number of the batch, counted per
	// data-parallel rank (the rank is in the payload).
	Seq uint64
	// Payload is the msgpack EventBatch. The Processor owns it from Handle
	// on: the caller must not modify or reuse it.
	Payload []byte
	// Replay fetches the pod's earlier batches to close a gap; nil when
	// the pod has none.
	Replay Replayer
	// Sender is where the message came from as its transport knows it (in
	// bind mode, the peer's IP address; in connect mode, the pod dialled):
	// holders are bounded per sender (Config.MaxHoldersPerSender), and at
	// Config.MaxHolders the senders over their share lose holders first.
	// "": unknown, neither bounded nor counted in the shares.
	Sender string
	// Engine is the engine the pod runs; the zero value is vLLM.
	Engine Engine
}

// Replayer fetches a holder's buffered batches, as vLLM's ROUTER replay
// socket serves them. A transport implements it for the pods it knows.
type Replayer interface {
	// Replay calls fn with each buffered batch of h from sequence number
	// from on, in order, until it has sent all it buffers (then it returns
	// nil), fn returns false (nil), ctx is done (ctx.Err()) or the
	// transport fails (an error, wrapping ErrReplayTimeout when the
	// endpoint went quiet). payload belongs to fn's caller only during the
	// call. Batches of another rank that share the endpoint are filtered
	// by the Processor.
	Replay(ctx context.Context, h index.Holder, from uint64, fn func(seq uint64, payload []byte) bool) error
}

// Processor is the transport-independent half of a subscriber: it decodes
// the messages a transport hands it and drives the per-holder state machine
// (sequencing, gaps, restarts, replay, hash agreement, content keys) that
// applies them to a Sink. It is safe for concurrent use, except that one
// pod's messages must be handed in order, from one goroutine at a time.
type Processor struct {
	cfg     Config
	log     *slog.Logger
	limited *logLimiter
	c       counters

	mu      sync.Mutex
	started bool
	ctx     context.Context
	workers []*worker
	wg      sync.WaitGroup
	closed  bool
	stop    chan struct{} // closed by Close, for the snapshot expiry timer

	holders  sync.Map // index.Holder -> *holder
	nHolders atomic.Int64
	evictMu  sync.Mutex // one eviction at a time, so two cannot pick one victim
	// senders counts the holders of each Message.Sender, for
	// Config.MaxHoldersPerSender and the shares eviction goes by.
	senderMu sync.Mutex
	senders  map[string]int
	// pods holds the state of each pod with holders or messages in flight,
	// its connection's included: bounded by the holders that exist and
	// twice Config.MaxHolders for the others, not by the pods ever heard
	// from.
	pods boundmap.Map[string, *podState]
	// epoch counts the pods' reconnects: a message is stamped with it when
	// handed, a reconnect with its new value, so that a holder knows
	// whether it applied a message sent after its pod's latest reconnect.
	epoch atomic.Uint64
	// overflow counts the messages of pods past Config.MaxHolders pods
	// together; their replays run on the worker, so that they too are
	// handled in the order they were handed.
	overflow podState
	// errPods counts the decode errors of at most Config.MaxHolders pods.
	errPods boundmap.Map[string, *atomic.Uint64]
	applied notify.Notifier
	// refused holds, for at most maxRefusedPods pods, the latest message
	// dropped for its sender, so that WaitApplied can say why it would
	// wait in vain; refusals numbers them.
	refused  boundmap.Map[string, *atomic.Pointer[refusal]]
	refusals atomic.Uint64
}

// refusal is a pod's latest message dropped by SenderMismatch.
type refusal struct {
	n      uint64 // its number in Processor.refusals
	sender string
}

// maxRefusedPods bounds Processor.refused: a flood of names cannot grow it.
const maxRefusedPods = 1024

// podState counts how many of a pod's messages were handed and how many
// have been handled, which is what Sync waits on: one pod's messages are
// handled in order. It also holds the pod's connection state, as its
// transport reports it.
type podState struct {
	handed, closed atomic.Uint64
	// holders counts the pod's holders; the pod's worker alone writes it.
	holders atomic.Int64
	down    atomic.Bool
	// upAt is Processor.epoch at the pod's latest reconnect.
	upAt atomic.Uint64
}

// NewProcessor checks cfg and returns a Processor; Start starts it.
func NewProcessor(cfg Config) (*Processor, error) {
	if cfg.Sink == nil {
		return nil, fmt.Errorf("%w: Sink is required", ErrConfig)
	}
	if cfg.ContentKeys != nil && cfg.ContentKeys.Config().Algo != hashing.Content {
		return nil, fmt.Errorf("%w: ContentKeys must use hashing.Content, not %s", ErrConfig, cfg.ContentKeys.Config().Algo)
	}
	if cfg.Workers <= 0 {
		cfg.Workers = runtime.GOMAXPROCS(0)
	}
	if cfg.QueueBytes <= 0 {
		cfg.QueueBytes = 64 << 20
	}
	if cfg.QueueLen <= 0 {
		cfg.QueueLen = 4096
	}
	if cfg.EnqueueTimeout <= 0 {
		cfg.EnqueueTimeout = 100 * time.Millisecond
	}
	if cfg.ReplayDeadline <= 0 {
		cfg.ReplayDeadline = 10 * time.Second
	}
	if cfg.ReplayRounds <= 0 {
		cfg.ReplayRounds = 8
	}
	if cfg.ContentKeysHint == "" {
		cfg.ContentKeysHint = "content-key mode (events.Config.ContentKeys)"
	}
	if cfg.SenderCheckHint == "" {
		cfg.SenderCheckHint = "zmq.SubscriberConfig.Allow, or NoSenderCheck where every peer is trusted"
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
	if cfg.SnapshotExpiry <= 0 {
		cfg.SnapshotExpiry = 10 * time.Minute
	}
	if cfg.ConflictWindow <= 0 {
		cfg.ConflictWindow = time.Minute
	}
	if cfg.ConflictRestarts <= 0 {
		cfg.ConflictRestarts = 3
	}
	if cfg.MaxHoldersPerSender <= 0 {
		cfg.MaxHoldersPerSender = 64
	}
	if cfg.LogBudget <= 0 {
		cfg.LogBudget = 10
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Processor{cfg: cfg, log: log, limited: &logLimiter{log: log, lim: &ratelog.Limiter{Interval: time.Second, Budget: cfg.LogBudget}},
		ctx: context.Background(), senders: map[string]int{}}, nil
}

// Config returns the processor's configuration with its defaults filled in.
func (p *Processor) Config() Config { return p.cfg }

// Logger is the processor's logger, for its transport's log lines.
func (p *Processor) Logger() *slog.Logger { return p.log }

// Start starts the workers. ctx bounds every replay: once it is done,
// running replays return and no new ones start. Close stops the workers.
func (p *Processor) Start(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.started {
		return ErrRunning
	}
	p.started, p.ctx = true, ctx
	p.workers = make([]*worker, p.cfg.Workers)
	for i := range p.workers {
		w := newWorker(p)
		p.workers[i] = w
		p.wg.Go(w.run)
	}
	if _, ok := p.cfg.Sink.(HolderRemover); ok && len(p.cfg.InitialSeqs) > 0 {
		p.stop = make(chan struct{})
		p.wg.Go(func() {
			t := time.NewTimer(p.cfg.SnapshotExpiry)
			defer t.Stop()
			select {
			case <-t.C:
				p.expireSnapshot()
			case <-ctx.Done():
			case <-p.stop:
			}
		})
	}
	return nil
}

// Close stops accepting messages and returns once the workers have handled
// everything handed before it and their replays have ended (at once when
// Start's ctx is done, else within Config.ReplayDeadline). Handle must not
// run concurrently with or after Close.
func (p *Processor) Close() {
	p.mu.Lock()
	if !p.started || p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	p.mu.Unlock()
	if p.stop != nil {
		close(p.stop)
	}
	for _, w := range p.workers {
		close(w.in)
	}
	p.wg.Wait()
}

// Handle queues m for its pod's worker. It waits at most
// Config.EnqueueTimeout (or until ctx is done) for room in a full queue;
// then the message is dropped, counted in Stats.QueueFull, and its pod
// resynchronised from replay. It must be called between Start and Close.
func (p *Processor) Handle(ctx context.Context, m Message) {
	if len(p.workers) == 0 {
		p.BadMessage(m.Pod, "the processor is not started", "seq", m.Seq)
		return
	}
	p.c[cMessages].Add(1)
	if _, known := p.pods.Load(m.Pod); !known {
		if err := ValidPodName(m.Pod); err != nil {
			p.c[cBadTopic].Add(1)
			p.limited.logAny(slog.LevelWarn, "events: dropped message of an invalid pod name", logName(m.Pod), "seq", m.Seq, "err", err)
			return
		}
	}
	if len(m.Model) > MaxModelBytes {
		// Each holder keeps its model's name: 260 names of 1 MiB from one
		// sender held 417 MiB under an index budget of 16 MiB.
		p.c[cBadTopic].Add(1)
		p.limited.logAny(slog.LevelWarn, "events: dropped message whose model name is too long", logName(m.Pod), "seq", m.Seq,
			"model", logName(m.Model), "bytes", len(m.Model), "max", MaxModelBytes)
		return
	}
	msg := message{Message: m, ps: p.podState(m.Pod), epoch: p.epoch.Load()}
	if msg.ps == nil {
		msg.ps = &p.overflow
	} else {
		msg.tracked = true
	}
	msg.ps.handed.Add(1)
	w := p.workers[podHash(m.Pod)%uint32(len(p.workers))]
	// The worker releases the bytes when it closes the message, however
	// that ends.
	if n := int64(len(m.Payload)); w.queued.Add(n) > p.cfg.QueueBytes {
		p.limited.logf(slog.LevelWarn, "events: worker queue over its byte bound; message dropped, its pod marked for resync", m.Pod,
			"seq", m.Seq, "bytes", n, "queue_bytes", p.cfg.QueueBytes)
		w.dropped(msg)
		return
	}
	select {
	case w.in <- msg:
		w.congested.Store(false)
		return
	default:
	}
	if w.congested.Load() {
		// Still full since the last wait ran out: waiting again for every
		// message would stall the other workers' pods too.
		w.dropped(msg)
		return
	}
	t := time.NewTimer(p.cfg.EnqueueTimeout)
	defer t.Stop()
	select {
	case w.in <- msg:
		return
	case <-ctx.Done():
	case <-t.C:
	}
	w.congested.Store(true)
	p.limited.logAny(slog.LevelWarn, "events: worker queue full; dropping its messages until it drains, their pods marked for resync",
		m.Pod, "seq", m.Seq)
	w.dropped(msg)
}

// BadMessage counts a message its transport could not read (bad framing, an
// unknown topic) in Stats.Messages and Stats.BadMessages and logs why,
// rate-limited per pod ("" when unknown).
func (p *Processor) BadMessage(pod, why string, args ...any) {
	p.c[cMessages].Add(1)
	p.c[cBadMessages].Add(1)
	p.limited.logf(slog.LevelWarn, "events: dropped message: "+why, pod, args...)
}

// NoPod counts and logs a message dropped because its topic names no pod
// (a transport that learns the pod from the topic, such as ZMQ's bind
// mode), by reason: vLLM's default empty topic, or another topic that is
// not kv@POD@MODEL. Each reason logs at most once per log interval, naming
// the fix.
func (p *Processor) NoPod(topic string, seq uint64) {
	p.c[cMessages].Add(1)
	p.c[cBadMessages].Add(1)
	if topic == "" {
		p.c[cEmptyTopic].Add(1)
		p.limited.logAny(slog.LevelWarn, "events: dropped message with vLLM's default empty topic, which names no pod: "+
			"set topic to kv@POD@MODEL in the engine's kv_events_config, or connect to the pod instead "+
			"(kvsource serve: --events-connect POD=tcp://HOST:PORT,model=MODEL)", "", "seq", seq)
		return
	}
	p.c[cUnknownTopic].Add(1)
	p.limited.logAny(slog.LevelWarn, "events: dropped message whose topic names no pod: "+
		"set topic to kv@POD@MODEL in the engine's kv_events_config, or connect to the pod instead",
		"", "topic", topic, "seq", seq)
}

// NoModel counts and logs a message of pod dropped because neither its
// topic nor the pod's configuration names its model: indexing it under an
// empty model would match no request.
func (p *Processor) NoModel(pod, topic string, seq uint64) {
	p.c[cMessages].Add(1)
	p.c[cBadMessages].Add(1)
	p.c[cNoModel].Add(1)
	p.limited.logf(slog.LevelWarn, "events: dropped message of a pod with no model: its topic names none "+
		"(vLLM's default topic is empty); set topic to kv@POD@MODEL in the engine's kv_events_config, "+
		"or give the pod its model (kvsource serve: --events-connect POD=...,model=MODEL)",
		pod, "topic", topic, "seq", seq)
}

// WaitApplied returns once holder h has applied the batch with sequence
// number seq or a later one, or with ctx's error when ctx is done first.
//
// It returns an error wrapping ErrSenderRefused, naming the sender, when a
// message for h's pod is dropped for its sender while it waits.
func (p *Processor) WaitApplied(ctx context.Context, h index.Holder, seq uint64) error {
	since := p.refusals.Load()
	var refused *refusal
	err := p.applied.Await(ctx, func() bool {
		if slot, ok := p.refused.Load(h.Pod); ok {
			if r := slot.Load(); r != nil && r.n > since {
				refused = r
				return true
			}
		}
		v, ok := p.holders.Load(h)
		if !ok {
			return false
		}
		hd := v.(*holder)
		return hd.hasSeq.Load() && hd.lastSeq.Load() >= seq
	})
	if err == nil && refused != nil {
		return fmt.Errorf("%w: pod %s, sender %s (let it publish with %s)", ErrSenderRefused, logName(h.Pod), refused.sender, p.cfg.SenderCheckHint)
	}
	return err
}

// Sync returns once every message handed to the processor before the call
// has been handled (applied, or dropped and counted), including the
// replays they caused, or with ctx's error when ctx is done first.
func (p *Processor) Sync(ctx context.Context) error {
	type mark struct {
		ps *podState
		n  uint64
	}
	marks := []mark{{&p.overflow, p.overflow.handed.Load()}}
	p.pods.Range(func(_ string, ps *podState) bool {
		marks = append(marks, mark{ps, ps.handed.Load()})
		return true
	})
	return p.applied.Await(ctx, func() bool {
		for _, m := range marks {
			if m.ps.closed.Load() < m.n {
				return false
			}
		}
		return true
	})
}

// errCount returns pod's decode-error counter, nil when pod is new and
// Config.MaxHolders pods already have one.
func (p *Processor) errCount(pod string) *atomic.Uint64 {
	n, _ := p.errPods.LoadOrNew(pod, p.cfg.MaxHolders, newCounter)
	return n
}

func newCounter() *atomic.Uint64 { return new(atomic.Uint64) }

// Tracked reports whether the processor keeps state for pod: it has
// holders, or messages on their way to a worker. A transport that keeps
// state of its own per pod (package events/zmq: which address a pod
// publishes from) forgets pods no longer tracked, so that its state too is
// bounded by the holders that exist rather than by every name ever heard.
func (p *Processor) Tracked(pod string) bool {
	_, ok := p.pods.Load(pod)
	return ok
}

// podState returns pod's state, nil when pod is new and twice
// Config.MaxHolders pods already have one (those of the holders and of
// messages on their way to a worker); a holder's own state is made by
// holderState.
func (p *Processor) podState(pod string) *podState {
	ps, _ := p.pods.LoadOrNew(pod, 2*p.cfg.MaxHolders, newPodState)
	return ps
}

// holderState returns pod's state for a holder of it being made, beyond
// podState's bound if need be: every holder must have one, or the pod's
// disconnects would go unseen, and there are at most Config.MaxHolders
// holders.
func (p *Processor) holderState(pod string) *podState {
	ps, _ := p.pods.LoadOrNew(pod, -1, newPodState)
	return ps
}

func newPodState() *podState { return &podState{} }

// forgetPod drops the state of pod, which has no holder (its last was
// evicted, or its messages made none), when none of its messages is in
// flight: the Config.MaxHolders pod states are then those of pods still
// followed, and a new pod after a flood of made-up names gets one of its
// own rather than the shared overflow (whose replays hold the worker). A
// message of pod arriving meanwhile makes a new state.
func (p *Processor) forgetPod(pod string) {
	ps, ok := p.pods.Load(pod)
	if !ok || ps.holders.Load() != 0 || ps.handed.Load() != ps.closed.Load() {
		return
	}
	p.pods.CompareAndDelete(pod, ps)
}

// Stats are the processor's global counters since it was created.
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
	ReplayTimeouts uint64 // of ReplayErrors, those that timed out or ran out of ReplayDeadline
	Replayed       uint64 // batches applied from replay
	// ReplayRounds counts replay requests repeated because replies were
	// lost in transit, ReplayRecovered the batches those rounds applied.
	ReplayRounds    uint64
	ReplayRecovered uint64
	Unrecovered     uint64 // gaps replay did not close; the GapPolicy applied
	Restarts        uint64 // engine restarts: sequences that went backwards, or a holder publishing another model
	Duplicates      uint64 // live batches already applied from replay
	QueueFull       uint64 // messages dropped because a worker queue was full
	HashChecks      uint64 // hash agreement checks run
	HashMismatches  uint64 // hash agreement checks that failed
	Unresolved      uint64 // content mode: blocks whose content key was unknown
	// Tokenless counts, in content mode, BlockStored events without token
	// ids naming blocks never seen with tokens: their content keys cannot
	// be computed (HolderStatus.Tokenless per holder).
	Tokenless uint64
	// Of BadMessages, by reason: EmptyTopic, bind-mode messages with vLLM's
	// default empty topic; UnknownTopic, bind-mode topics the topic mapper
	// rejects; NoModel, messages of a pod with no model from its topic or
	// its configured one (zmq.PodConfig.Model).
	EmptyTopic, UnknownTopic, NoModel uint64
	// ZeroParents counts BlockStored events whose parent was 0, llm-d's
	// empty block hash, read as starting a chain.
	ZeroParents uint64
	Evicted     uint64 // holders forgotten to make room at Config.MaxHolders
	// ChunkedOffload counts offload-tier BlockStored events (applied as
	// usual) whose non-zero block size differs from the GPU tier's: the
	// offloading connector keys one block per chunk of several GPU blocks,
	// so lookups in that tier undercount (see the package doc).
	ChunkedOffload  uint64
	BadTopic        uint64 // dropped: the pod name is not valid (ValidPodName), or the model name over MaxModelBytes
	SenderMismatch  uint64 // dropped: the sender may not publish for the pod it names
	SenderHolders   uint64 // dropped: a new holder past Config.MaxHoldersPerSender
	Conflicts       uint64 // holders put in state conflict
	ConflictDropped uint64 // messages of holders in conflict, dropped
	Disconnects     uint64 // pod connections that went down
	SnapshotExpired uint64 // InitialSeqs holders never heard from, removed
	// Heartbeats counts empty batches that repeat the last applied
	// sequence number (TensorRT-LLM sends an empty batch every 5 s): the
	// pod is alive, nothing changed. An empty batch at 0 repeating 0 after
	// its pod reconnected is a restart instead: a new process's first.
	Heartbeats uint64
}

// HolderStatus is the state of one holder's event stream.
type HolderStatus struct {
	Pod     string
	Model   string
	Rank    int
	LastSeq uint64
	// Gaps counts forward sequence jumps, Replays replay requests answered
	// in full, Unrecovered the lost ranges the GapPolicy handled.
	Gaps           uint64
	Replays        uint64
	Unrecovered    uint64
	Restarts       uint64
	DecodeErrors   uint64
	HashChecks     uint64
	HashMismatches uint64
	// ChunkedOffload counts the holder's offload-tier BlockStored events
	// whose block size differs from its GPU tier's (Stats.ChunkedOffload).
	ChunkedOffload uint64
	// Tokenless counts the holder's content-mode BlockStored events that
	// could not be resolved for want of token ids (Stats.Tokenless).
	Tokenless uint64
	// Conflicts counts the times the holder was put in state conflict.
	Conflicts uint64
	// State is one of the State* constants: whether the holder's entries
	// can be trusted and it may serve pulls (Processor.Source).
	State string
}

// Holder returns the status's holder.
func (s HolderStatus) Holder() index.Holder { return index.Holder{Pod: s.Pod, Rank: s.Rank} }

// Stats returns the global counters.
func (p *Processor) Stats() Stats {
	var st Stats
	for _, c := range Counters {
		*c.Stat(&st) = p.c[c.id].Load()
	}
	return st
}

// Status returns every holder's status sorted by pod and rank. A pod
// whose payloads all failed to decode (so no holder is known) is listed as
// rank 0.
func (p *Processor) Status() []HolderStatus {
	var out []HolderStatus
	seen := map[string]bool{}
	p.holders.Range(func(_, v any) bool {
		h := v.(*holder)
		st := h.status(p)
		if n, ok := p.errPods.Load(h.id.Pod); ok {
			st.DecodeErrors = n.Load()
		}
		seen[h.id.Pod] = true
		out = append(out, st)
		return true
	})
	p.errPods.Range(func(pod string, v *atomic.Uint64) bool {
		if n := v.Load(); n > 0 && !seen[pod] {
			out = append(out, HolderStatus{Pod: pod, DecodeErrors: n, State: "stale"})
		}
		return true
	})
	slices.SortFunc(out, func(a, b HolderStatus) int { return a.Holder().Compare(b.Holder()) })
	return out
}

// LastSeq returns the sequence number of the last batch applied for h, and
// whether h is known. A service snapshotting the index records these as the
// next run's Config.InitialSeqs.
func (p *Processor) LastSeq(h index.Holder) (uint64, bool) {
	v, ok := p.holders.Load(h)
	if !ok {
		return 0, false
	}
	return v.(*holder).lastSeq.Load(), true
}

func podHash(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}
