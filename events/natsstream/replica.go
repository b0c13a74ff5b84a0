package natsstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/notify"
	"github.com/kvsource/kvsource/internal/ratelog"
)

// Defaults of ReplicaConfig.
const (
	DefaultSnapshotLeaseTTL = 10 * time.Second
	DefaultMaxLag           = 10 * time.Second
	// DefaultMaxBatchBytes bounds the parts of split batches a replica
	// holds: four times the largest batch kvsource serve takes from an
	// engine by default (16 MiB).
	DefaultMaxBatchBytes = 64 << 20
)

// Metadata keys of a snapshot object.
const (
	metaStreamSeq = "stream-seq"
	metaReplica   = "replica"
	metaTaken     = "taken-unix-ns"
)

// ReplicaConfig configures a Replica. Only JetStream is required.
type ReplicaConfig struct {
	Config
	// JetStream is the client the replica consumes with.
	JetStream jetstream.JetStream
	// Name identifies the replica in leases, snapshots and logs; default
	// the host name, process id and a random suffix.
	Name string
	// Models, when set, shards by model: the replica consumes only these
	// models' batches and shares snapshots only with replicas of the same
	// set. Empty: every model.
	Models []string
	// Index configures the replica's index when no snapshot is loaded; a
	// loaded snapshot is configured with it too.
	Index index.Config
	// ContentKeys, when set (a hashing.Content hasher), applies the stream
	// in content-key mode (events.Config.ContentKeys): the index holds
	// content keys computed from the batches' token ids, as a relay's own
	// index does in that mode, so that requests hashed with the same
	// hasher match. Every replica and relay of a fleet must use the same
	// key mode and hasher settings, and so must the snapshots they share.
	ContentKeys *hashing.Hasher
	// SnapshotInterval, when positive, makes the replica compete for the
	// snapshot lease of its shard; the holder stores a snapshot in the
	// object store this often. Zero: the replica only loads snapshots.
	SnapshotInterval time.Duration
	// SnapshotLeaseTTL is the snapshot lease's TTL; default
	// DefaultSnapshotLeaseTTL.
	SnapshotLeaseTTL time.Duration
	// NoWarmStart ignores stored snapshots: the replica reads the stream
	// from its first message.
	NoWarmStart bool
	// MaxLag is how far behind the stream a healthy replica may be, in the
	// age of what it has not applied yet; default DefaultMaxLag.
	MaxLag time.Duration
	// MaxBatchBytes bounds the bytes of split batches (HeaderPart) held
	// until their last part arrives, all holders together; a part past it
	// drops its batch, counted in ReplicaStatus.DroppedParts. Default
	// DefaultMaxBatchBytes.
	MaxBatchBytes int
	// TempDir holds snapshot files while they are written and read;
	// default os.TempDir().
	TempDir string
	// Applied, when set, is called after each batch is applied, on the
	// consuming goroutine (so it must return quickly); the batch's
	// payload is valid only during the call. For latency measurements and
	// application hooks.
	Applied func(b Batch, streamSeq uint64)
	// Logger receives the replica's logs; default slog.Default().
	Logger *slog.Logger
}

// ReplicaStatus is a replica's view of its progress, for /v1/pods,
// metrics and health.
type ReplicaStatus struct {
	Name string `json:"name"`
	// Ready: the replica applied everything the stream held when it
	// started (and its snapshot, if any).
	Ready bool `json:"ready"`
	// Connected: the NATS connection is up.
	Connected bool `json:"connected"`
	// AppliedSeq is the stream sequence of the last message applied.
	AppliedSeq uint64 `json:"applied_seq"`
	// LagMessages counts the messages of the replica's subjects stored
	// and not yet applied, as the server last reported; LagSeconds is the
	// age of the oldest of them (0 when none).
	LagMessages uint64  `json:"lag_messages"`
	LagSeconds  float64 `json:"lag_seconds"`
	// SnapshotSeq is the stream sequence the newest snapshot this replica
	// loaded or stored covers, SnapshotAgeSeconds how long ago it was
	// taken (-1: none).
	SnapshotSeq        uint64  `json:"snapshot_seq"`
	SnapshotAgeSeconds float64 `json:"snapshot_age_seconds"`
	// SnapshotLeader: the replica holds its shard's snapshot lease.
	SnapshotLeader bool `json:"snapshot_leader"`
	// Batches applied, BadMessages dropped (headers or payload), Gaps and
	// Restarts seen in holders' sequence numbers.
	Batches     uint64 `json:"batches"`
	BadMessages uint64 `json:"bad_messages"`
	Gaps        uint64 `json:"gaps"`
	Restarts    uint64 `json:"restarts"`
	Snapshots   uint64 `json:"snapshots_stored"`
	// Joined counts the batches put back together from parts;
	// DroppedParts the parts dropped: out of order, of a batch whose
	// beginning the replica never saw, or past MaxBatchBytes.
	Joined       uint64 `json:"joined_batches"`
	DroppedParts uint64 `json:"dropped_parts"`
}

// Replica consumes the event stream into an index: a router replica's
// view of the fleet, the same as every other replica's of the same shard
// once they applied the same stream sequence. Open loads the newest shared
// snapshot; Run consumes from just after it.
type Replica struct {
	cfg    ReplicaConfig
	js     jetstream.JetStream
	stream jetstream.Stream
	obj    jetstream.ObjectStore
	log    *slog.Logger
	ix     *index.Index
	shard  string
	lease  *lease

	// mu is held while a message is handed to proc, and to read a
	// consistent position (with proc synced).
	mu      sync.Mutex
	proc    *events.Processor
	initial map[index.Holder]uint64 // the loaded snapshot's sequence numbers
	closed  bool                    // proc closed: no more Handle
	runCtx  context.Context
	applied uint64
	startAt uint64             // first stream sequence to consume
	cons    jetstream.Consumer // Run's
	// appliedCons is the consumer sequence of the last message applied.
	appliedCons uint64
	// joining holds the split batches whose last part has not arrived,
	// joinBytes their bytes.
	joining   map[partKey]*joining
	joinBytes int

	pending    atomic.Uint64
	oldestNs   atomic.Int64 // timestamp of the oldest unapplied message known, unix ns; 0 none
	snapSeq    atomic.Uint64
	snapTaken  atomic.Int64
	snapshots  atomic.Uint64
	badMsgs    atomic.Uint64
	joined     atomic.Uint64
	partsLost  atomic.Uint64
	ready      chan struct{}
	readyOnce  sync.Once
	readying   atomic.Bool
	running    atomic.Bool
	appliedPub atomic.Uint64
	notify     notify.Notifier // broadcast after each applied message
}

// logBudgetInterval is how often one kind of warning may be logged. A
// replica is fed whatever anyone with publish rights put on the stream,
// under whatever pod names: a limit per name (the events processor's)
// still writes a line per name, so a budget per kind of line bounds them
// all.
const logBudgetInterval = 10 * time.Second

// Open creates the stream and buckets as needed and builds the replica's
// index from its shard's newest snapshot, unless there is none or
// NoWarmStart is set. It reads from the network and honours ctx.
func Open(ctx context.Context, cfg ReplicaConfig) (*Replica, error) {
	if cfg.JetStream == nil {
		return nil, fmt.Errorf("%w: ReplicaConfig.JetStream is required", ErrConfig)
	}
	cfg.Config = cfg.Config.WithDefaults()
	if cfg.Name == "" {
		// Replicas' names key their durable state: two in one process
		// must differ.
		cfg.Name = defaultName("") + "-" + randomSuffix()
	}
	if cfg.SnapshotLeaseTTL <= 0 {
		cfg.SnapshotLeaseTTL = DefaultSnapshotLeaseTTL
	}
	if cfg.MaxLag <= 0 {
		cfg.MaxLag = DefaultMaxLag
	}
	if cfg.TempDir == "" {
		cfg.TempDir = os.TempDir()
	}
	if cfg.MaxBatchBytes <= 0 {
		cfg.MaxBatchBytes = DefaultMaxBatchBytes
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	// Everything the replica and its processor log about the stream's
	// content is on a budget per kind of line: the stream carries what
	// anyone with publish rights put there, under any pod names.
	log = ratelog.Budgeted(log.With("replica", cfg.Name), logBudgetInterval)
	s, err := cfg.ensureStream(ctx, cfg.JetStream)
	if err != nil {
		return nil, err
	}
	obj, err := cfg.snapshotStore(ctx, cfg.SnapshotInterval > 0)
	if err != nil {
		return nil, err
	}
	r := &Replica{cfg: cfg, js: cfg.JetStream, stream: s, obj: obj, log: log, shard: shardName(cfg.Models),
		ready: make(chan struct{}), joining: map[partKey]*joining{}}
	r.snapTaken.Store(-1)
	if cfg.SnapshotInterval > 0 {
		kv, err := cfg.KeyValue(ctx, cfg.JetStream, "_SNAPLEASE", cfg.SnapshotLeaseTTL)
		if err != nil {
			return nil, err
		}
		r.lease = &lease{kv: kv, key: r.shard, owner: uniqueOwner(cfg.Name), ttl: cfg.SnapshotLeaseTTL, log: log}
	}
	var seqs map[index.Holder]uint64
	if !cfg.NoWarmStart {
		// Two snapshots stored while this one loads purge the stream past
		// it: load the newer one.
		for attempt := 0; ; attempt++ {
			r.ix, seqs, err = r.loadSnapshot(ctx)
			if err != nil {
				return nil, err
			}
			info, err := s.Info(ctx)
			if err != nil {
				return nil, fmt.Errorf("natsstream: stream info: %w", err)
			}
			next := r.snapSeq.Load() + 1
			if info.State.Msgs == 0 || info.State.FirstSeq <= next {
				break
			}
			if attempt == 2 {
				return nil, fmt.Errorf("natsstream: the stream starts at %d, after the newest snapshot's %d: snapshots are purging faster than they load", info.State.FirstSeq, next-1)
			}
		}
	}
	if r.ix == nil {
		r.ix = index.New(cfg.Index)
	}
	// The events core applies the stream's batches with the rules a
	// subscriber applies engine messages with (sequencing, gaps, restarts),
	// so a replica's index equals the relay subscriber's. Handle waits for
	// room rather than drop: the stream keeps what the replica has not
	// applied, and a dropped batch would be a gap no replay can close. For
	// the same reason no byte bound drops a batch, and snapshot holders do
	// not expire by this replica's clock: every replica must apply the same
	// stream to the same index.
	r.proc, err = events.NewProcessor(events.Config{Sink: r.ix, InitialSeqs: seqs, EnqueueTimeout: 24 * time.Hour, Logger: log,
		QueueBytes: math.MaxInt64, SnapshotExpiry: time.Duration(math.MaxInt64), ContentKeys: cfg.ContentKeys, Tapped: true})
	if err != nil {
		return nil, fmt.Errorf("natsstream: %w", err)
	}
	r.initial = seqs
	r.applied = r.snapSeq.Load()
	r.appliedPub.Store(r.applied)
	r.startAt = r.applied + 1
	return r, nil
}

// snapshotStore opens the shared snapshot store. Only a snapshotter
// (store true) creates it or updates its configuration: whoever may update
// it may also give it a max_age and so delete every shard's snapshots, so
// a replica opens it as it is, with no right but to read it, and starts
// cold (nil, no error) while no snapshotter has created it.
func (c ReplicaConfig) snapshotStore(ctx context.Context, store bool) (jetstream.ObjectStore, error) {
	bucket := c.Stream + "_SNAPSHOTS"
	if !store {
		obj, err := c.JetStream.ObjectStore(ctx, bucket)
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("natsstream: object store %s: %w", bucket, err)
		}
		return obj, nil
	}
	obj, err := c.JetStream.CreateOrUpdateObjectStore(ctx, jetstream.ObjectStoreConfig{
		Bucket:      bucket,
		Description: "kvsource: index snapshots, one object per shard",
		Storage:     c.storage(),
		Replicas:    c.Replicas,
	})
	if err != nil {
		return nil, fmt.Errorf("natsstream: object store %s: %w", bucket, err)
	}
	return obj, nil
}

// shardName names a set of models in lease keys and object names.
func shardName(models []string) string {
	if len(models) == 0 {
		return "all"
	}
	m := slices.Clone(models)
	slices.Sort(m)
	m = slices.Compact(m)
	return "models-" + strconv.FormatUint(xxhash.Sum64String(strings.Join(m, "\x00")), 16)
}

// A shard's snapshots alternate between two objects, so that a replica
// reading the newest is not cut short by the next one being written: that
// overwrites the older.
func (r *Replica) objectNames() [2]string {
	return [2]string{"index-" + r.shard + "-a", "index-" + r.shard + "-b"}
}

// newestSnapshot returns the name and stream sequence of the shard's
// newest snapshot and the name the next one goes to; ok is false when
// there is none.
func (r *Replica) newestSnapshot(ctx context.Context) (newest string, seq uint64, next string, ok bool, err error) {
	names := r.objectNames()
	next = names[0]
	for _, name := range names {
		info, err := r.obj.GetInfo(ctx, name)
		if errors.Is(err, jetstream.ErrObjectNotFound) {
			next = name
			continue
		}
		if err != nil {
			return "", 0, "", false, fmt.Errorf("natsstream: snapshot info: %w", err)
		}
		s, perr := strconv.ParseUint(info.Metadata[metaStreamSeq], 10, 64)
		if perr != nil {
			continue
		}
		if !ok || s > seq {
			if ok {
				next = newest
			}
			newest, seq, ok = name, s, true
		} else {
			next = name
		}
	}
	return newest, seq, next, ok, nil
}

// loadSnapshot loads the shard's snapshot, nil when there is none. The
// snapshot and the stream sequence it covers are read from one version of
// the object: reading the metadata, then the content, could pair a newer
// snapshot with an older sequence, whose batches would then look like
// engine restarts. A version replaced while it is read loses its chunks;
// the read is then tried again, on the new one.
func (r *Replica) loadSnapshot(ctx context.Context) (*index.Index, map[index.Holder]uint64, error) {
	var err error
	for range 3 {
		var ix *index.Index
		var seqs map[index.Holder]uint64
		ix, seqs, err = r.loadSnapshotOnce(ctx)
		if err == nil || errors.Is(err, index.ErrBadSnapshot) || ctx.Err() != nil {
			return ix, seqs, err
		}
		r.log.Warn("natsstream: loading the snapshot failed, trying again", "err", err)
	}
	return nil, nil, err
}

func (r *Replica) loadSnapshotOnce(ctx context.Context) (*index.Index, map[index.Holder]uint64, error) {
	if r.obj == nil {
		return nil, nil, nil
	}
	name, _, _, ok, err := r.newestSnapshot(ctx)
	if err != nil || !ok {
		return nil, nil, err
	}
	res, err := r.obj.Get(ctx, name)
	if err != nil {
		return nil, nil, fmt.Errorf("natsstream: snapshot: %w", err)
	}
	defer res.Close()
	info, err := res.Info()
	if err != nil {
		return nil, nil, fmt.Errorf("natsstream: snapshot info: %w", err)
	}
	seq, err := strconv.ParseUint(info.Metadata[metaStreamSeq], 10, 64)
	if err != nil {
		return nil, nil, fmt.Errorf("natsstream: snapshot %s: bad %s %q", info.Name, metaStreamSeq, info.Metadata[metaStreamSeq])
	}
	f, err := os.CreateTemp(r.cfg.TempDir, "kvsource-snapshot-*")
	if err != nil {
		return nil, nil, fmt.Errorf("natsstream: load snapshot: %w", err)
	}
	path := f.Name()
	defer os.Remove(path)
	_, err = io.Copy(f, res)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, nil, fmt.Errorf("natsstream: load snapshot: %w", err)
	}
	ix, seqs, err := index.LoadFile(path, r.cfg.Index)
	if err != nil {
		return nil, nil, fmt.Errorf("natsstream: load snapshot: %w", err)
	}
	r.snapSeq.Store(seq)
	if ns, err := strconv.ParseInt(info.Metadata[metaTaken], 10, 64); err == nil {
		r.snapTaken.Store(ns)
	}
	r.log.Info("natsstream: loaded snapshot", "stream_seq", seq, "taken_by", info.Metadata[metaReplica], "bytes", info.Size)
	return ix, seqs, nil
}

// Index returns the replica's index, for a picker or a server to read.
func (r *Replica) Index() *index.Index { return r.ix }

// Ready is closed once the replica has applied everything the stream held
// for its subjects when Run started.
func (r *Replica) Ready() <-chan struct{} { return r.ready }

// WaitReady waits until the replica is ready or ctx is done.
func (r *Replica) WaitReady(ctx context.Context) error {
	select {
	case <-r.ready:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// WaitApplied waits until the replica applied stream sequence seq (or a
// later one) or ctx is done. seq is a message of the replica's subjects,
// such as a publish acknowledgement's: a replica sharded by model never
// sees other subjects' sequence numbers.
func (r *Replica) WaitApplied(ctx context.Context, seq uint64) error {
	if err := r.notify.Await(ctx, func() bool { return r.appliedPub.Load() >= seq }); err != nil {
		return err
	}
	if r.running.Load() {
		return r.proc.Sync(ctx)
	}
	return nil
}

func (r *Replica) isReady() bool {
	select {
	case <-r.ready:
		return true
	default:
		return false
	}
}

func (r *Replica) filters() []string {
	var f []string
	for _, m := range r.cfg.Models {
		f = append(f, r.cfg.ModelFilter(m))
	}
	return f
}

// Run consumes the stream until ctx is done, and, with SnapshotInterval
// set, stores snapshots while it holds its shard's lease. NATS being down
// delays it, but does not stop it: it returns nil when ctx is done (an
// error only when called twice).
func (r *Replica) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return fmt.Errorf("%w: Run called twice", ErrConfig)
	}
	r.runCtx = ctx
	if err := r.proc.Start(ctx); err != nil {
		return err
	}
	defer func() {
		r.mu.Lock()
		r.closed = true
		r.mu.Unlock()
		r.proc.Close()
	}()
	// NATS may be down or restarting: a replica waits for it rather than
	// fail, as its ordered consumer does once running.
	var cc jetstream.ConsumeContext
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		var err error
		cc, err = r.consume(ctx)
		if err == nil {
			break
		}
		r.log.Warn("natsstream: cannot start consuming, retrying", "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
	defer cc.Stop()
	if r.lease != nil {
		var wg sync.WaitGroup
		defer wg.Wait()
		wg.Go(func() { r.lease.run(ctx) })
		wg.Go(func() { r.snapshotLoop(ctx) })
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			r.refreshLag(ctx)
		}
	}
}

// consume creates the ordered consumer from startAt and starts it.
func (r *Replica) consume(ctx context.Context) (jetstream.ConsumeContext, error) {
	occ := jetstream.OrderedConsumerConfig{FilterSubjects: r.filters(), DeliverPolicy: jetstream.DeliverAllPolicy}
	if r.startAt > 1 {
		occ.DeliverPolicy, occ.OptStartSeq = jetstream.DeliverByStartSequencePolicy, r.startAt
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	cons, err := r.stream.OrderedConsumer(cctx, occ)
	if err != nil {
		return nil, fmt.Errorf("natsstream: consumer: %w", err)
	}
	info, err := cons.Info(cctx)
	if err != nil {
		return nil, fmt.Errorf("natsstream: consumer info: %w", err)
	}
	r.pending.Store(info.NumPending)
	if info.NumPending == 0 {
		r.readyOnce.Do(func() { close(r.ready) })
	}
	cc, err := cons.Consume(r.handle, jetstream.PullMaxMessages(1024))
	if err != nil {
		return nil, fmt.Errorf("natsstream: consume: %w", err)
	}
	r.cons = cons
	return cc, nil
}

// refreshLag asks the server how much is pending, since an idle or stuck
// consumer receives no metadata to read it from.
func (r *Replica) refreshLag(ctx context.Context) {
	ictx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	info, err := r.cons.Info(ictx)
	if err != nil {
		return
	}
	r.mu.Lock()
	// The server counts what it has not delivered; what the client
	// buffered and the replica has not applied yet is behind too.
	pending := info.NumPending
	if info.Delivered.Consumer > r.appliedCons {
		pending += info.Delivered.Consumer - r.appliedCons
	}
	r.pending.Store(pending)
	if pending == 0 {
		r.oldestNs.Store(0)
	} else if r.oldestNs.Load() == 0 {
		r.oldestNs.Store(time.Now().UnixNano())
	}
	r.mu.Unlock()
}

func (r *Replica) handle(m jetstream.Msg) {
	meta, err := m.Metadata()
	if err != nil {
		r.badMsgs.Add(1)
		return
	}
	b, err := parseBatch(m.Headers(), m.Data())
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	whole := false
	if err == nil {
		b, whole, err = r.join(b, m.Headers().Get(HeaderPart), meta.Sequence.Stream)
	}
	if err != nil {
		r.badMsgs.Add(1)
		r.log.Warn("natsstream: dropped stream message", "stream_seq", meta.Sequence.Stream, "subject", m.Subject(), "err", err)
	} else if whole {
		r.proc.Handle(r.runCtx, events.Message{Pod: b.Pod, Model: b.Model, Seq: b.Seq, Payload: b.Payload})
	}
	r.applied = meta.Sequence.Stream
	r.appliedCons = meta.Sequence.Consumer
	r.pending.Store(meta.NumPending)
	if meta.NumPending == 0 {
		r.oldestNs.Store(0)
	} else {
		// The next message is at most as old as this one.
		r.oldestNs.Store(meta.Timestamp.UnixNano())
	}
	r.mu.Unlock()
	if f := r.cfg.Applied; f != nil && whole {
		// The hook is told once the batch applied: the consumer waits.
		if r.proc.Sync(r.runCtx) == nil {
			f(b, meta.Sequence.Stream)
		}
	}
	r.appliedPub.Store(meta.Sequence.Stream)
	if meta.NumPending == 0 && !r.isReady() && r.readying.CompareAndSwap(false, true) {
		// Ready once what was handed so far has applied.
		go func() {
			if r.proc.Sync(r.runCtx) == nil {
				r.readyOnce.Do(func() { close(r.ready) })
			}
			r.readying.Store(false)
		}()
	}
	r.notify.Broadcast()
}

// partKey is the holder a split batch is of: parts of one holder follow
// one another, other holders' messages between them.
type partKey struct {
	model, pod string
	rank       int
}

// joining is a split batch whose last part has not arrived.
type joining struct {
	seq       uint64
	next, n   int
	streamSeq uint64 // of its first part
	buf       []byte
}

// join puts split batches back together, with r.mu held: it returns b
// and true for a whole batch, joined or never split, and false for a part
// that is not the last. A part that does not continue its holder's
// joining batch (the previous holder stopped within a batch, a batch
// purged before its end, parts lost) drops that batch, as does one past
// MaxBatchBytes: the processor then sees a gap, as it would had the whole
// batch been lost.
func (r *Replica) join(b Batch, part string, streamSeq uint64) (Batch, bool, error) {
	key := partKey{model: b.Model, pod: b.Pod, rank: b.Rank}
	j := r.joining[key]
	if part == "" {
		if j != nil {
			r.dropJoin(key, j)
		}
		return b, true, nil
	}
	i, n, err := parsePart(part)
	if err != nil {
		return b, false, err
	}
	if i == 0 {
		if j != nil {
			r.dropJoin(key, j)
		}
		j = &joining{seq: b.Seq, n: n, streamSeq: streamSeq}
		r.joining[key] = j
	} else if j == nil || j.seq != b.Seq || j.n != n || j.next != i {
		if j != nil {
			r.dropJoin(key, j)
		}
		r.partsLost.Add(1)
		return b, false, nil
	}
	if r.joinBytes+len(b.Payload) > r.cfg.MaxBatchBytes {
		r.dropJoin(key, j)
		r.partsLost.Add(1)
		return b, false, nil
	}
	j.buf = append(j.buf, b.Payload...)
	r.joinBytes += len(b.Payload)
	j.next++
	if j.next < j.n {
		return b, false, nil
	}
	delete(r.joining, key)
	r.joinBytes -= len(j.buf)
	r.joined.Add(1)
	b.Payload = j.buf
	return b, true, nil
}

// dropJoin drops key's joining batch j, counting the parts it had.
func (r *Replica) dropJoin(key partKey, j *joining) {
	delete(r.joining, key)
	r.joinBytes -= len(j.buf)
	r.partsLost.Add(uint64(j.next))
}

// Holders is the status of each holder as the replica applied its
// batches from the stream: last sequence numbers, gaps, replays and the
// other per-holder counters of events.HolderStatus. Its State is the
// replica's own view; which holders may serve pulls is the relay's (see
// natsfleet.Sources).
func (r *Replica) Holders() []events.HolderStatus { return r.proc.Status() }

// Status returns the replica's progress.
func (r *Replica) Status() ReplicaStatus {
	// Not under mu: a handed message may wait there for room in the
	// processor's queue.
	ps := r.proc.Stats()
	st := ReplicaStatus{Name: r.cfg.Name, AppliedSeq: r.appliedPub.Load(), Batches: ps.Batches,
		Gaps: ps.Gaps, Restarts: ps.Restarts, BadMessages: r.badMsgs.Load() + ps.DecodeErrors + ps.BadMessages}
	st.Ready = r.isReady()
	st.Connected = r.js.Conn().IsConnected()
	st.LagMessages = r.pending.Load()
	if ns := r.oldestNs.Load(); ns != 0 {
		st.LagSeconds = max(time.Since(time.Unix(0, ns)).Seconds(), 0)
	}
	st.SnapshotSeq = r.snapSeq.Load()
	st.SnapshotAgeSeconds = -1
	if ns := r.snapTaken.Load(); ns > 0 {
		st.SnapshotAgeSeconds = time.Since(time.Unix(0, ns)).Seconds()
	}
	st.SnapshotLeader = r.lease != nil && r.lease.held()
	st.Snapshots = r.snapshots.Load()
	st.Joined, st.DroppedParts = r.joined.Load(), r.partsLost.Load()
	return st
}

// Healthy reports whether the replica can answer for the fleet: ready,
// connected and within MaxLag; err says why not.
func (r *Replica) Healthy() error {
	st := r.Status()
	switch {
	case !st.Ready:
		return errors.New("replica not ready: still catching up with the stream")
	case !st.Connected:
		return errors.New("replica disconnected from NATS")
	case st.LagSeconds > r.cfg.MaxLag.Seconds():
		return fmt.Errorf("replica lags the stream by %.1fs (%d messages), more than %v", st.LagSeconds, st.LagMessages, r.cfg.MaxLag)
	}
	return nil
}

func (r *Replica) snapshotLoop(ctx context.Context) {
	tick := time.NewTicker(r.cfg.SnapshotInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if !r.lease.held() || !r.isReady() {
			continue
		}
		if err := r.Snapshot(ctx); err != nil {
			r.log.Warn("natsstream: snapshot failed", "err", err)
		}
	}
}

// Snapshot stores the index in the object store as its shard's newest
// snapshot, then purges the stream's messages of the shard that the
// previous snapshot covered: they are no longer needed by a replica
// starting from either, and a replica lagging by less than a snapshot
// interval still finds what it has not applied. Replicas call it on their
// own while they hold the snapshot lease; calling it directly (tests,
// a shutdown hook) skips the lease.
func (r *Replica) Snapshot(ctx context.Context) error {
	// The position and the holders' sequence numbers are read with
	// nothing handed and not applied.
	r.mu.Lock()
	seq := r.applied
	for _, j := range r.joining {
		// A replica starting from the snapshot must see each split
		// batch's first part: the position is before the earliest one
		// still joining. What it applies again of other holders is
		// older than the snapshot's sequence numbers, so dropped.
		seq = min(seq, j.streamSeq-1)
	}
	if err := r.proc.Sync(ctx); err != nil {
		r.mu.Unlock()
		return err
	}
	seqs := maps.Clone(r.initial)
	if seqs == nil {
		seqs = map[index.Holder]uint64{}
	}
	for _, hs := range r.proc.Status() {
		if last, ok := r.proc.LastSeq(hs.Holder()); ok {
			seqs[hs.Holder()] = last
		}
	}
	r.mu.Unlock()
	if seq == 0 || seq == r.snapSeq.Load() && r.snapshots.Load() > 0 {
		return nil
	}
	_, prev, name, _, err := r.newestSnapshot(ctx)
	if err != nil {
		return err
	}
	if prev >= seq {
		return nil
	}
	f, err := os.CreateTemp(r.cfg.TempDir, "kvsource-snapshot-*")
	if err != nil {
		return fmt.Errorf("natsstream: snapshot: %w", err)
	}
	path := f.Name()
	f.Close()
	defer os.Remove(path)
	taken := time.Now()
	// The index keeps changing while it is saved; seqs, read first, make a
	// replica starting from it re-apply what it may already hold, which
	// is idempotent.
	if err := r.ix.SaveFile(path, seqs); err != nil {
		return err
	}
	file, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("natsstream: snapshot: %w", err)
	}
	defer file.Close()
	meta := jetstream.ObjectMeta{Name: name, Metadata: map[string]string{
		metaStreamSeq: strconv.FormatUint(seq, 10), metaReplica: r.cfg.Name,
		metaTaken: strconv.FormatInt(taken.UnixNano(), 10),
	}}
	if _, err := r.obj.Put(ctx, meta, file); err != nil {
		return fmt.Errorf("natsstream: store snapshot: %w", err)
	}
	r.snapSeq.Store(seq)
	r.snapTaken.Store(taken.UnixNano())
	r.snapshots.Add(1)
	r.log.Info("natsstream: stored snapshot", "stream_seq", seq, "object", name)
	if prev == 0 {
		return nil
	}
	filters := r.filters()
	if len(filters) == 0 {
		filters = []string{""}
	}
	for _, f := range filters {
		opts := []jetstream.StreamPurgeOpt{jetstream.WithPurgeSequence(prev + 1)}
		if f != "" {
			opts = append(opts, jetstream.WithPurgeSubject(f))
		}
		if err := r.stream.Purge(ctx, opts...); err != nil {
			return fmt.Errorf("natsstream: purge up to %d: %w", prev, err)
		}
	}
	return nil
}
