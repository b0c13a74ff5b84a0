package natsstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/internal/ratelog"
)

// Defaults of RelayConfig.
const (
	DefaultLeaseTTL        = 5 * time.Second
	DefaultRetain          = 30 * time.Second
	DefaultRetainN         = 4096
	DefaultPublishers      = 4
	DefaultPublishAttempts = 8
	// DefaultMaxControlLine is the NATS server's default max_control_line,
	// which its INFO does not announce.
	DefaultMaxControlLine = 4096
	// DefaultMaxParts bounds the parts a batch is split into: a 16 MiB
	// batch in 64 KiB messages.
	DefaultMaxParts = 256
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
	// publishes what the dead relay did not. They also bound what waits to
	// be published while the stream cannot take it: a batch trimmed
	// before it was published is dropped (RelayStats.Expired), a gap to
	// the replicas. Retain must exceed LeaseTTL with room to spare.
	// Defaults DefaultRetain, DefaultRetainN.
	Retain  time.Duration
	RetainN int
	// Publishers is how many subjects are published at once, each by its
	// own goroutine, in order within a subject; default DefaultPublishers.
	Publishers int
	// PublishAttempts bounds the attempts at one message while connected
	// to NATS (waiting for a reconnection counts none): past it the batch
	// is dropped (RelayStats.Failed). Default DefaultPublishAttempts.
	PublishAttempts int
	// MaxControlLine is the NATS server's max_control_line, which bounds
	// a subject's length: a batch whose subject (model and pod names) is
	// too long is dropped (RelayStats.TooLong) rather than sent, since
	// the server closes a connection that sends one. Default
	// DefaultMaxControlLine, the server's default; the server does not
	// announce it.
	MaxControlLine int
	// MaxParts bounds the messages one batch over the server's
	// max_payload (which the server announces) is split into; a batch
	// needing more is dropped (RelayStats.TooBig). Default
	// DefaultMaxParts.
	MaxParts int
	// Logger receives the relay's logs; default slog.Default().
	Logger *slog.Logger
}

// RelayStats are a relay's counters since it was created, and its backlog.
type RelayStats struct {
	Tapped      uint64 `json:"tapped"`      // batches received from the subscriber
	Published   uint64 `json:"published"`   // batches the stream stored
	Duplicates  uint64 `json:"duplicates"`  // batches the stream already had (the other relay's, or a retry)
	Retries     uint64 `json:"retries"`     // publish attempts that failed and were retried
	Republished uint64 `json:"republished"` // retained batches published on taking over
	// Split counts the batches over the server's max_payload published in
	// Parts messages.
	Split uint64 `json:"split"`
	Parts uint64 `json:"parts"`
	// Dropped is the sum of the batches never published: TooLong (a
	// subject over the control-line limit), TooBig (more than MaxParts
	// parts, or headers alone over max_payload), Failed (PublishAttempts
	// failed attempts) and Expired (trimmed by Retain or RetainN before
	// they could be published). Replicas see each as a gap.
	Dropped uint64 `json:"dropped"`
	TooLong uint64 `json:"dropped_subject_too_long"`
	TooBig  uint64 `json:"dropped_too_big"`
	Failed  uint64 `json:"dropped_failed"`
	Expired uint64 `json:"dropped_expired"`
	// Backlog is the batches tapped while leading and not published yet,
	// BacklogSeconds the age of the oldest of them.
	Backlog        int     `json:"backlog"`
	BacklogSeconds float64 `json:"backlog_seconds"`
	// MaxPayload is the server's max_payload, as its INFO announced.
	MaxPayload int64 `json:"max_payload"`
	Leader     bool  `json:"leader"` // the relay holds the lease and publishes
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

	// ready holds the subjects with batches to publish, each once; wake
	// has a token when it is not empty.
	qmu   sync.Mutex
	ready []*relaySubject
	wake  chan struct{}

	tapped, published, dups, retries, republished atomic.Uint64
	split, parts                                  atomic.Uint64
	tooLong, tooBig, failed, expired              atomic.Uint64

	// warns limits the warnings of each kind of drop or retry.
	warns ratelog.Limiter
}

// relaySubject is one subject's retained batches, oldest first, and how
// far they are published. Its mutex is never held across a network call,
// so that Tap never waits on the stream.
type relaySubject struct {
	mu      sync.Mutex
	subject string
	kept    []kept
	total   uint64 // batches ever kept: the next kept's n
	next    uint64 // n of the next batch to publish
	term    uint64 // the lease term the subject was reconciled in
	// republish is the n up to which batches are published as a takeover's
	// reconciliation (RelayStats.Republished).
	republish uint64
	queued    bool // in Relay.ready or being published
	// gone marks a subject sweep removed from the map: a Tap that found
	// it just before looks it up again.
	gone bool
}

type kept struct {
	b  Batch
	id string
	at time.Time
	n  uint64
}

// NewRelay creates or updates the stream and the lease bucket.
func NewRelay(ctx context.Context, cfg RelayConfig) (*Relay, error) {
	if cfg.JetStream == nil {
		return nil, fmt.Errorf("%w: RelayConfig.JetStream is required", ErrConfig)
	}
	cfg.Config = cfg.Config.WithDefaults()
	cfg.Bind = false // the relay is what creates them
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
	if cfg.Publishers <= 0 {
		cfg.Publishers = DefaultPublishers
	}
	if cfg.PublishAttempts <= 0 {
		cfg.PublishAttempts = DefaultPublishAttempts
	}
	if cfg.MaxControlLine <= 0 {
		cfg.MaxControlLine = DefaultMaxControlLine
	}
	if cfg.MaxParts <= 0 {
		cfg.MaxParts = DefaultMaxParts
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
	kv, err := cfg.KeyValue(ctx, cfg.JetStream, "_RELAY", cfg.LeaseTTL)
	if err != nil {
		return nil, err
	}
	r := &Relay{cfg: cfg, js: cfg.JetStream, stream: s, log: log, subjects: map[string]*relaySubject{},
		warns: ratelog.Limiter{Interval: 10 * time.Second},
		wake:  make(chan struct{}, 1),
		lease: &lease{kv: kv, key: RelayLeaseKey, owner: uniqueOwner(cfg.Name), ttl: cfg.LeaseTTL, log: log}}
	bg := context.Background()
	r.ctx.Store(&bg)
	return r, nil
}

// RelayLeaseKey is the relay lease's key in <Stream>_RELAY; its value is
// the holder's owner name (Relay.Owner), which the sources table repeats.
const RelayLeaseKey = "relay"

// Owner is the name the relay holds the relay lease under, unique to this
// process.
func (r *Relay) Owner() string { return r.lease.owner }

// Run holds or waits for the relay lease until ctx is done, and publishes
// what Tap kept while it holds it, first what a previous holder left out
// each time it takes the lease. Tap publishes only while Run runs. It
// returns once the lease is released, so that a caller closing the
// connection after it does not lose the release and leave the standby to
// wait out the lease's TTL.
func (r *Relay) Run(ctx context.Context) error {
	r.ctx.Store(&ctx)
	var wg sync.WaitGroup
	wg.Go(func() { r.lease.run(ctx) })
	defer wg.Wait()
	for range r.cfg.Publishers {
		wg.Go(func() { r.publisher(ctx) })
	}
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
			r.queueAll()
			done = term
		}
	}
}

// Stats returns the relay's counters and backlog.
func (r *Relay) Stats() RelayStats {
	st := RelayStats{Tapped: r.tapped.Load(), Published: r.published.Load(), Duplicates: r.dups.Load(),
		Retries: r.retries.Load(), Republished: r.republished.Load(), Split: r.split.Load(), Parts: r.parts.Load(),
		TooLong: r.tooLong.Load(), TooBig: r.tooBig.Load(), Failed: r.failed.Load(), Expired: r.expired.Load(),
		MaxPayload: r.js.Conn().MaxPayload(), Leader: r.lease.held()}
	st.Dropped = st.TooLong + st.TooBig + st.Failed + st.Expired
	if !st.Leader {
		return st
	}
	term := r.lease.term()
	now := time.Now()
	r.mu.Lock()
	for _, s := range r.subjects {
		s.mu.Lock()
		if s.term == term && len(s.kept) > 0 && s.next < s.total {
			i := max(s.next, s.kept[0].n) - s.kept[0].n
			st.Backlog += len(s.kept) - int(i)
			st.BacklogSeconds = max(st.BacklogSeconds, now.Sub(s.kept[i].at).Seconds())
		}
		s.mu.Unlock()
	}
	r.mu.Unlock()
	return st
}

// Healthy reports whether the relay can put batches on the stream:
// connected to NATS and, while it leads, with no batch waiting longer
// than the lease's TTL; err says why not. Drops are counted in Stats, not
// held against health: one engine's unpublishable batch does not make
// the relay unfit for the others.
func (r *Relay) Healthy() error {
	if !r.js.Conn().IsConnected() {
		return errors.New("relay disconnected from NATS")
	}
	if st := r.Stats(); st.BacklogSeconds > r.cfg.LeaseTTL.Seconds() {
		return fmt.Errorf("relay stalled: %d batches wait to be published, the oldest for %.1fs", st.Backlog, st.BacklogSeconds)
	}
	return nil
}

// Tap takes one batch from an events.Processor (its Config.Tap, as a
// zmq.Subscriber's Events config sets it): it keeps it and, while the
// relay holds the lease, hands its subject to the publishers. It never
// waits on the stream, so that one batch the stream refuses, or NATS
// being down, does not hold the subscriber's worker and every pod on it:
// what waits is bounded by Retain and RetainN, past which it is dropped
// and counted.
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
	now := time.Now()
	r.trim(s, now)
	s.kept = append(s.kept, kept{b: b, id: msgID(b.Model, b.Pod, b.Rank, b.Seq, b.Payload), at: now, n: s.total})
	s.total++
	queue := !s.queued && r.lease.held()
	s.queued = s.queued || queue
	s.mu.Unlock()
	if queue {
		r.enqueue(s)
	}
}

func (r *Relay) enqueue(s *relaySubject) {
	r.qmu.Lock()
	r.ready = append(r.ready, s)
	r.qmu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// dequeue waits for a subject to publish; nil when ctx is done.
func (r *Relay) dequeue(ctx context.Context) *relaySubject {
	for {
		r.qmu.Lock()
		if len(r.ready) > 0 {
			s := r.ready[0]
			r.ready[0] = nil
			r.ready = r.ready[1:]
			more := len(r.ready) > 0
			r.qmu.Unlock()
			if more {
				// Pass the token on to the next idle publisher.
				select {
				case r.wake <- struct{}{}:
				default:
				}
			}
			return s
		}
		r.qmu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-r.wake:
		}
	}
}

// queueAll hands every subject to the publishers, on taking the lease:
// each is reconciled, then published on.
func (r *Relay) queueAll() {
	r.mu.Lock()
	subs := make([]*relaySubject, 0, len(r.subjects))
	for _, s := range r.subjects {
		subs = append(subs, s)
	}
	r.mu.Unlock()
	for _, s := range subs {
		s.mu.Lock()
		queue := !s.queued
		s.queued = true
		s.mu.Unlock()
		if queue {
			r.enqueue(s)
		}
	}
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
			continue // a Tap or a publisher is at it: next time
		}
		r.trim(s, now)
		if len(s.kept) == 0 && !s.queued {
			s.gone = true
			delete(r.subjects, subj)
		}
		s.mu.Unlock()
	}
}

// trim drops s's batches past Retain or RetainN, counting those that were
// due to be published in this term and were not.
func (r *Relay) trim(s *relaySubject, now time.Time) {
	i := 0
	for i < len(s.kept) && (len(s.kept)-i >= r.cfg.RetainN || now.Sub(s.kept[i].at) > r.cfg.Retain) {
		i++
	}
	if i == 0 {
		return
	}
	if s.term == r.lease.term() && r.lease.held() && s.next <= s.kept[i-1].n {
		lost := s.kept[i-1].n + 1 - max(s.next, s.kept[0].n)
		r.expired.Add(lost)
		k := s.kept[i-1].b
		r.warn("expired", "natsstream: relay dropped batches it could not publish in time; replicas see a gap",
			"subject", s.subject, "pod", k.Pod, "rank", k.Rank, "seq", k.Seq, "batches", lost, "retain", r.cfg.Retain, "retain_n", r.cfg.RetainN)
	}
	s.kept = append(s.kept[:0], s.kept[i:]...)
}

// publisher publishes the subjects Tap and queueAll hand it until ctx is
// done.
func (r *Relay) publisher(ctx context.Context) {
	for {
		s := r.dequeue(ctx)
		if s == nil {
			return
		}
		r.drain(ctx, s)
	}
}

// drain publishes s's batches in order until none is left, the lease is
// lost or ctx is done; a new term reconciles s first.
func (r *Relay) drain(ctx context.Context, s *relaySubject) {
	s.mu.Lock()
	defer func() { s.queued = false; s.mu.Unlock() }()
	for ctx.Err() == nil && r.lease.held() {
		if term := r.lease.term(); s.term != term {
			s.mu.Unlock()
			last, err := r.stream.GetLastMsgForSubject(ctx, s.subject)
			s.mu.Lock()
			r.reconcile(s, term, last, err)
			continue
		}
		if len(s.kept) == 0 || s.next >= s.total {
			return
		}
		k := s.kept[max(s.next, s.kept[0].n)-s.kept[0].n]
		term := s.term
		s.mu.Unlock()
		ok := r.publish(ctx, s, k)
		s.mu.Lock()
		if !ok || s.term != term {
			continue // lost the lease, or retook it: check again
		}
		if k.n < s.republish {
			r.republished.Add(1)
		}
		s.next = max(s.next, k.n+1)
	}
}

// reconcile sets where s goes on from after taking the lease in term: the
// kept batches that follow the stream's last message of the subject
// (last, or err reading it). The last message found among them marks
// where the previous holder stopped (all of a batch it split is published
// again when it stopped within it); when it is not (the previous holder
// published a batch this relay never received, or stopped before
// everything kept), the batches with a higher sequence number than its
// are published. The dedup window catches what the previous holder
// stored of those, and of other ranks of the pod, whose batches share the
// subject.
func (r *Relay) reconcile(s *relaySubject, term uint64, last *jetstream.RawStreamMsg, err error) {
	from := 0
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
	case err != nil:
		r.log.Warn("natsstream: relay cannot read the subject's last message; publishing every kept batch", "subject", s.subject, "err", err)
	default:
		id, part, _ := strings.Cut(last.Header.Get(jetstream.MsgIDHeader), "-")
		i, n, perr := parsePart(part)
		whole := part == "" || perr == nil && i == n-1
		found := false
		for j := len(s.kept) - 1; j >= 0; j-- {
			if s.kept[j].id == id {
				from, found = j, true
				if whole {
					from++
				}
				break
			}
		}
		if !found {
			if lb, err := parseBatch(last.Header, nil); err == nil {
				from = len(s.kept)
				for j, k := range s.kept {
					if k.b.Rank != lb.Rank || k.b.Seq > lb.Seq {
						from = j
						break
					}
				}
			}
		}
	}
	s.next, s.republish = s.total, s.total
	if from < len(s.kept) {
		s.next = s.kept[from].n
	}
	if s.total > 0 {
		// The newest is published as the live batch it is.
		s.republish = s.total - 1
	}
	s.term = term
}

// Errors of a batch that cannot be published.
var (
	errTooLong = errors.New("subject over the server's control-line limit")
	errTooBig  = errors.New("batch needs more parts than MaxParts, or its headers alone exceed max_payload")
)

// messages returns the message or messages batch k is published as: one,
// or when it exceeds the server's max_payload parts of its payload in
// order, each with header Kvs-Part "i/n" and message id <id>-<i>/<n>,
// which replicas put back together.
func (r *Relay) messages(subject string, k kept) ([]*nats.Msg, error) {
	nc := r.js.Conn()
	// HPUB <subject> <reply> <header bytes> <total bytes>\r\n
	if line := len("HPUB ") + len(subject) + 1 + len(nc.NewRespInbox()) + 2*21 + 2; line > r.cfg.MaxControlLine {
		return nil, fmt.Errorf("%w: a %d-byte line against %d", errTooLong, line, r.cfg.MaxControlLine)
	}
	m := r.cfg.message(k.b, k.id)
	maxPayload := nc.MaxPayload()
	if maxPayload <= 0 {
		maxPayload = 1 << 20 // not connected yet: the server's default
	}
	hdr := headerSize(m.Header)
	if int64(hdr+len(m.Data)) <= maxPayload {
		return []*nats.Msg{m}, nil
	}
	// Room for the longest Kvs-Part header and id suffix.
	const partOverhead = 64
	room := maxPayload - int64(hdr) - partOverhead
	if room <= 0 {
		return nil, fmt.Errorf("%w: %d header bytes against max_payload %d", errTooBig, hdr, maxPayload)
	}
	n := (int64(len(m.Data)) + room - 1) / room
	if n > int64(r.cfg.MaxParts) {
		return nil, fmt.Errorf("%w: %d bytes need %d parts of %d, more than %d", errTooBig, len(m.Data), n, room, r.cfg.MaxParts)
	}
	msgs := make([]*nats.Msg, n)
	for i := range msgs {
		part := formatPart(i, int(n))
		pm := r.cfg.message(k.b, k.id+"-"+part)
		pm.Header.Set(HeaderPart, part)
		pm.Data = k.b.Payload[int64(i)*room : min(int64(i+1)*room, int64(len(k.b.Payload)))]
		msgs[i] = pm
	}
	return msgs, nil
}

// headerSize is the bytes h takes on the wire: NATS/1.0, a line per
// value, an empty line.
func headerSize(h nats.Header) int {
	n := len("NATS/1.0\r\n\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(": ") + len(v) + len("\r\n")
		}
	}
	return n
}

// publish stores batch k on subject: its messages in order, each retried
// with backoff until the stream stored it, PublishAttempts attempts failed
// while connected, the lease is lost or ctx is done. It reports whether
// the batch is done with (stored, or dropped and counted); false means
// the lease was lost or ctx is done, and it is to be published again.
func (r *Relay) publish(ctx context.Context, s *relaySubject, k kept) bool {
	subject := s.subject
	msgs, err := r.messages(subject, k)
	if err != nil {
		kind, counter := "too_big", &r.tooBig
		if errors.Is(err, errTooLong) {
			kind, counter = "too_long", &r.tooLong
		}
		counter.Add(1)
		r.warn(kind, "natsstream: relay dropped a batch it cannot publish; replicas see a gap",
			"subject", truncate(subject, 256), "pod", truncate(k.b.Pod, 256), "rank", k.b.Rank, "seq", k.b.Seq, "bytes", len(k.b.Payload), "err", err)
		return true
	}
	stored := false
	for _, m := range msgs {
		wait := 50 * time.Millisecond
		for attempt := 0; ; {
			if !r.lease.held() || ctx.Err() != nil {
				return false
			}
			if !r.retained(s, k.n) {
				return true // trimmed while it was retried, and counted
			}
			if !r.js.Conn().IsConnected() {
				// An outage is no fault of this batch: wait, counting
				// no attempt, as long as it is retained.
				if !sleep(ctx, wait) {
					return false
				}
				wait = min(2*wait, time.Second)
				continue
			}
			pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			ack, err := r.js.PublishMsg(pctx, m)
			cancel()
			if err == nil {
				stored = stored || !ack.Duplicate
				break
			}
			if ctx.Err() != nil {
				return false
			}
			if attempt++; attempt >= r.cfg.PublishAttempts {
				r.failed.Add(1)
				r.warn("failed", "natsstream: relay dropped a batch after failed attempts; replicas see a gap",
					"subject", subject, "pod", k.b.Pod, "rank", k.b.Rank, "seq", k.b.Seq, "attempts", attempt, "err", err)
				return true
			}
			r.retries.Add(1)
			r.warn("retry", "natsstream: publish failed, retrying",
				"subject", subject, "pod", k.b.Pod, "rank", k.b.Rank, "seq", k.b.Seq, "err", err)
			if !sleep(ctx, wait) {
				return false
			}
			wait = min(2*wait, time.Second)
		}
	}
	if len(msgs) > 1 {
		r.split.Add(1)
		r.parts.Add(uint64(len(msgs)))
	}
	if stored {
		r.published.Add(1)
	} else {
		r.dups.Add(1)
	}
	return true
}

// retained reports whether s still keeps its batch n.
func (r *Relay) retained(s *relaySubject, n uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.kept) > 0 && s.kept[0].n <= n
}

// warn logs msg, a warning of kind, at most once every ten seconds per
// kind, with how many lines of the kind were left out since the last.
func (r *Relay) warn(kind, msg string, args ...any) {
	if skipped, _, ok := r.warns.Allow(kind, ""); ok {
		r.log.Warn(msg, append(args, "left_out", skipped)...)
	}
}

// truncate shortens s to at most n bytes for a log line.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// sleep waits d or until ctx is done; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Leader reports whether the relay holds the relay lease and publishes.
func (r *Relay) Leader() bool { return r.lease.held() }

// Flush waits until every batch tapped so far while leading is published
// or dropped, or ctx is done.
func (r *Relay) Flush(ctx context.Context) error {
	for {
		if st := r.Stats(); st.Backlog == 0 && !r.queuedAny() {
			return nil
		}
		if !sleep(ctx, 5*time.Millisecond) {
			return ctx.Err()
		}
	}
}

func (r *Relay) queuedAny() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.subjects {
		s.mu.Lock()
		q := s.queued
		s.mu.Unlock()
		if q {
			return true
		}
	}
	return false
}
