package natsstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvsource/kvsource/events"
)

// Defaults of RelayConfig.
const (
	DefaultLeaseTTL = 5 * time.Second
	DefaultRetain   = 30 * time.Second
	DefaultRetainN  = 4096
)

// RelayConfig configures a Relay. Only JetStream is required.
type RelayConfig struct {
	Config
	// JetStream is the client the relay publishes with.
	JetStream jetstream.JetStream
	// Name identifies the relay in the lease and the logs; default the
	// host name and process id.
	Name string
	// LeaseTTL is the relay lease's TTL: a standby takes over about 1.25
	// times this long after the active relay died (it tries every quarter
	// TTL), and within a quarter TTL when it stopped cleanly. Default
	// DefaultLeaseTTL.
	LeaseTTL time.Duration
	// Retain is how long each relay keeps the batches it tapped, and
	// RetainN how many per subject at most, so that a standby taking over
	// publishes what the dead relay did not. Retain must exceed LeaseTTL
	// with room to spare. Defaults DefaultRetain, DefaultRetainN.
	Retain  time.Duration
	RetainN int
	// Logger receives the relay's logs; default slog.Default().
	Logger *slog.Logger
}

// RelayStats are a relay's counters since it was created.
type RelayStats struct {
	Tapped      uint64 // batches received from the subscriber
	Published   uint64 // batches the stream stored
	Duplicates  uint64 // batches the stream already had (the other relay's, or a retry)
	Retries     uint64 // publish attempts that failed and were retried
	Republished uint64 // retained batches published on taking over
	Leader      bool   // the relay holds the lease and publishes
}

// Relay appends engines' batches, as an events.Processor applies them
// (Tap), to the event stream. Several relays of the same engines may run:
// one holds the relay lease and publishes, the others keep recent batches
// and take over when the lease falls to them (see the package doc).
type Relay struct {
	cfg    RelayConfig
	js     jetstream.JetStream
	stream jetstream.Stream
	log    *slog.Logger
	lease  *lease
	ctx    atomic.Pointer[context.Context]

	mu       sync.Mutex
	subjects map[string]*relaySubject

	tapped, published, dups, retries, republished atomic.Uint64
}

// relaySubject is one subject's retained batches, oldest first. Its
// mutex orders the subject's publishes.
type relaySubject struct {
	mu      sync.Mutex
	subject string
	kept    []kept
	term    uint64 // the lease term the subject was reconciled in
	// gone marks a subject sweep removed from the map: a Tap that found
	// it just before looks it up again.
	gone bool
}

type kept struct {
	b  Batch
	id string
	at time.Time
}

// NewRelay creates or updates the stream and the lease bucket.
func NewRelay(ctx context.Context, cfg RelayConfig) (*Relay, error) {
	if cfg.JetStream == nil {
		return nil, fmt.Errorf("%w: RelayConfig.JetStream is required", ErrConfig)
	}
	cfg.Config = cfg.Config.withDefaults()
	cfg.Name = defaultName(cfg.Name)
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.Retain <= 0 {
		cfg.Retain = DefaultRetain
	}
	if cfg.RetainN <= 0 {
		cfg.RetainN = DefaultRetainN
	}
	if cfg.Retain <= cfg.LeaseTTL {
		return nil, fmt.Errorf("%w: Retain %v must exceed LeaseTTL %v", ErrConfig, cfg.Retain, cfg.LeaseTTL)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	s, err := cfg.ensureStream(ctx, cfg.JetStream)
	if err != nil {
		return nil, err
	}
	kv, err := cfg.ensureKV(ctx, cfg.JetStream, "_RELAY", cfg.LeaseTTL)
	if err != nil {
		return nil, err
	}
	r := &Relay{cfg: cfg, js: cfg.JetStream, stream: s, log: log, subjects: map[string]*relaySubject{},
		lease: &lease{kv: kv, key: "relay", owner: uniqueOwner(cfg.Name), ttl: cfg.LeaseTTL, log: log}}
	bg := context.Background()
	r.ctx.Store(&bg)
	return r, nil
}

// Run holds or waits for the relay lease until ctx is done, publishing
// what a previous holder left out each time it takes the lease. Tap
// publishes only while Run runs. It returns once the lease is released, so
// that a caller closing the connection after it does not lose the release
// and leave the standby to wait out the lease's TTL.
func (r *Relay) Run(ctx context.Context) error {
	r.ctx.Store(&ctx)
	leased := make(chan struct{})
	go func() { defer close(leased); r.lease.run(ctx) }()
	defer func() { <-leased }()
	tick := time.NewTicker(r.cfg.LeaseTTL / 8)
	defer tick.Stop()
	done := uint64(0)
	swept := time.Now()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-tick.C:
			if now.Sub(swept) >= r.cfg.Retain/4 {
				r.sweep(now)
				swept = now
			}
		}
		if term := r.lease.term(); r.lease.held() && term != done {
			r.reconcileAll(ctx, term)
			done = term
		}
	}
}

// Stats returns the relay's counters.
func (r *Relay) Stats() RelayStats {
	return RelayStats{Tapped: r.tapped.Load(), Published: r.published.Load(), Duplicates: r.dups.Load(),
		Retries: r.retries.Load(), Republished: r.republished.Load(), Leader: r.lease.held()}
}

// Tap takes one batch from an events.Processor (its Config.Tap, as a
// zmq.Subscriber's Events config sets it): it keeps
// it and, while the relay holds the lease, publishes it and returns once
// the stream stored it, retrying until then. Holding the subscriber's
// worker meanwhile is deliberate: a stream that cannot take batches makes
// the subscriber drop messages and resynchronise from the engines' replay
// later, rather than this relay buffering without bound.
func (r *Relay) Tap(tb events.TapBatch) {
	r.tapped.Add(1)
	b := Batch{Model: tb.Model, Pod: tb.Pod, Rank: tb.Rank, Seq: tb.Seq, Payload: append([]byte(nil), tb.Payload...)}
	subj := r.cfg.Subject(b.Model, b.Pod)
	var s *relaySubject
	for {
		r.mu.Lock()
		s = r.subjects[subj]
		if s == nil {
			s = &relaySubject{subject: subj}
			if r.lease.held() {
				// A subject new to this term has nothing kept that a
				// previous holder could have left out: publish at once.
				// Reconciling it would take the stream's last message
				// of the subject, an earlier run's when the engine
				// restarted (its numbers from 0 again) after the sweep
				// forgot it, for the point to go on from, and drop this
				// batch.
				s.term = r.lease.term()
			}
			r.subjects[subj] = s
		}
		r.mu.Unlock()
		s.mu.Lock()
		if !s.gone {
			break
		}
		s.mu.Unlock()
	}
	defer s.mu.Unlock()

	ctx := *r.ctx.Load()
	now := time.Now()
	s.trim(now, r.cfg.Retain, r.cfg.RetainN)
	s.kept = append(s.kept, kept{b: b, id: msgID(b.Model, b.Pod, b.Rank, b.Seq, b.Payload), at: now})
	if !r.lease.held() {
		return
	}
	if term := r.lease.term(); s.term != term {
		// Taken over since this subject last published: first what the
		// previous holder left out, which includes this batch.
		r.reconcile(ctx, s, term)
		return
	}
	r.publish(ctx, s, len(s.kept)-1)
}

// sweep trims every subject's kept batches and forgets the subjects left
// with none, so that pods that stopped publishing (gone, renamed) do not
// keep their last batches, and their map entries, for ever: Tap trims only
// the subject it taps.
func (r *Relay) sweep(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for subj, s := range r.subjects {
		if !s.mu.TryLock() {
			continue // a Tap or a reconcile is at it: next time
		}
		s.trim(now, r.cfg.Retain, r.cfg.RetainN)
		if len(s.kept) == 0 {
			s.gone = true
			delete(r.subjects, subj)
		}
		s.mu.Unlock()
	}
}

func (s *relaySubject) trim(now time.Time, retain time.Duration, n int) {
	i := 0
	for i < len(s.kept) && (len(s.kept)-i >= n || now.Sub(s.kept[i].at) > retain) {
		i++
	}
	if i > 0 {
		s.kept = append(s.kept[:0], s.kept[i:]...)
	}
}

func (r *Relay) reconcileAll(ctx context.Context, term uint64) {
	r.mu.Lock()
	subs := make([]*relaySubject, 0, len(r.subjects))
	for _, s := range r.subjects {
		subs = append(subs, s)
	}
	r.mu.Unlock()
	for _, s := range subs {
		s.mu.Lock()
		if s.term != term {
			r.reconcile(ctx, s, term)
		}
		s.mu.Unlock()
	}
}

// reconcile publishes, after taking the lease, the subject's kept batches
// that follow the stream's last message of the subject. The last message
// found among them marks where the previous holder stopped; when it is
// not (the previous holder published a batch this relay never received,
// or stopped before everything kept), the batches with a higher sequence
// number than its are published. The dedup window catches what the
// previous holder stored of those, and of other ranks of the pod, whose
// batches share the subject.
func (r *Relay) reconcile(ctx context.Context, s *relaySubject, term uint64) {
	from := 0
	last, err := r.stream.GetLastMsgForSubject(ctx, s.subject)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
	case err != nil:
		r.log.Warn("natsstream: relay cannot read the subject's last message; publishing every kept batch", "subject", s.subject, "err", err)
	default:
		id := last.Header.Get(jetstream.MsgIDHeader)
		found := false
		for i := len(s.kept) - 1; i >= 0; i-- {
			if s.kept[i].id == id {
				from, found = i+1, true
				break
			}
		}
		if !found {
			if lb, err := parseBatch(last.Header, nil); err == nil {
				from = len(s.kept)
				for i, k := range s.kept {
					if k.b.Rank != lb.Rank || k.b.Seq > lb.Seq {
						from = i
						break
					}
				}
			}
		}
	}
	for i := from; i < len(s.kept); i++ {
		if !r.publish(ctx, s, i) {
			return
		}
		if i < len(s.kept)-1 {
			r.republished.Add(1)
		}
	}
	s.term = term
}

// publish stores kept batch i of s, retrying until the stream stored it,
// the lease is lost or ctx is done; it reports whether it was stored.
func (r *Relay) publish(ctx context.Context, s *relaySubject, i int) bool {
	k := &s.kept[i]
	wait := 50 * time.Millisecond
	for {
		if !r.lease.held() {
			return false
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		ack, err := r.js.PublishMsg(pctx, r.cfg.message(k.b, k.id))
		cancel()
		if err == nil {
			if ack.Duplicate {
				r.dups.Add(1)
			} else {
				r.published.Add(1)
			}
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		r.retries.Add(1)
		r.log.Warn("natsstream: publish failed, retrying", "subject", s.subject, "pod", k.b.Pod, "rank", k.b.Rank, "seq", k.b.Seq, "err", err)
		select {
		case <-ctx.Done():
			return false
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

// Leader reports whether the relay holds the relay lease and publishes.
func (r *Relay) Leader() bool { return r.lease.held() }
