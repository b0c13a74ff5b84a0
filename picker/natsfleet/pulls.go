package natsfleet

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/puzpuzpuz/xsync/v4"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/ratelog"
)

// Defaults of PullsConfig.
const (
	// DefaultPullTTL is picker.DefaultInflightTTL.
	DefaultPullTTL  = 30 * time.Second
	DefaultQueueLen = 4096
	// DefaultMaxRemote is far more pulls than a fleet's replicas have in
	// flight at once; each costs about 400 bytes at most.
	DefaultMaxRemote = 1 << 16
)

// PullsConfig configures a Pulls. Only JetStream is required.
type PullsConfig struct {
	natsstream.Config
	// JetStream is the client the fleet publishes and watches with.
	JetStream jetstream.JetStream
	// Name identifies this replica's pulls; default the host name and
	// process id (a random suffix is always added).
	Name string
	// TTL is how long a pull counts when its end is never heard of: the
	// bucket's TTL, equal to the picker's InflightTTL. Default
	// DefaultPullTTL. Every replica must use the same.
	TTL time.Duration
	// QueueLen bounds the starts and ends waiting to be published; past
	// it they are dropped and counted (PullsStats.Dropped), and the other
	// replicas do not see those pulls. Default DefaultQueueLen.
	QueueLen int
	// MaxRemote bounds the other replicas' pulls counted at once; past
	// it a pull is not counted (PullsStats.OverCap) until some expire or
	// end. Default DefaultMaxRemote.
	MaxRemote int
	// Logger receives the fleet's logs; default slog.Default().
	Logger *slog.Logger
}

// PullsStats are a Pulls' counters.
type PullsStats struct {
	Started, Ended uint64 // this replica's pulls published
	Dropped        uint64 // starts and ends not published: queue full or publish failed
	Remote         int    // other replicas' pulls in flight now
	// Malformed counts other replicas' pulls not counted because their
	// value is no holder (no "rank|pod", a negative rank, or a pod name
	// events.ValidPodName refuses, longer than events.MaxPodNameLen say);
	// OverCap those not counted because MaxRemote were.
	Malformed, OverCap uint64
}

// Pulls shares in-flight pulls among router replicas through a JetStream
// key-value bucket: it implements picker.Fleet. A pull this replica
// directs is a key <owner>.<token> until it is done (or its TTL passes),
// published in the background so that Pick never waits on the network;
// a watcher of the bucket counts the other owners' keys per holder.
type Pulls struct {
	cfg   PullsConfig
	kv    jetstream.KeyValue
	log   *slog.Logger
	owner string // hex of a unique owner name: a key token
	ops   chan pullOp
	next  atomic.Uint64

	// counts holds a holder only while the other replicas have a pull
	// from it in flight: holders are what anyone with a replica's
	// credentials names, so one left at zero would stay for good.
	counts *xsync.Map[index.Holder, *atomic.Int64]
	remote atomic.Int64

	started, ended, dropped, malformed, overCap atomic.Uint64
}

type pullOp struct {
	token uint64
	h     index.Holder
	end   bool
}

type remotePull struct {
	h       index.Holder
	created time.Time
}

// logBudgetInterval is how often one kind of warning may be logged: the
// pulls bucket holds what anyone with a replica's credentials wrote.
const logBudgetInterval = 10 * time.Second

// errBadPull: a pull's value names no holder.
var errBadPull = errors.New("natsfleet: bad pull")

// maxPullValue is the longest value of a pull key that can name a holder:
// a rank, '|' and a pod name.
const maxPullValue = 20 + 1 + events.MaxPodNameLen

// NewPulls creates or updates the pulls bucket, <Stream>_PULLS.
func NewPulls(ctx context.Context, cfg PullsConfig) (*Pulls, error) {
	if cfg.JetStream == nil {
		return nil, fmt.Errorf("%w: PullsConfig.JetStream is required", ErrConfig)
	}
	cfg.Config = cfg.Config.WithDefaults()
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultPullTTL
	}
	if cfg.QueueLen <= 0 {
		cfg.QueueLen = DefaultQueueLen
	}
	if cfg.MaxRemote <= 0 {
		cfg.MaxRemote = DefaultMaxRemote
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	// The pulls bucket holds what anyone with a replica's credentials
	// wrote: what the fleet logs of it is on a budget.
	log = ratelog.Budgeted(log, logBudgetInterval)
	kv, err := cfg.KeyValue(ctx, cfg.JetStream, "_PULLS", cfg.TTL)
	if err != nil {
		return nil, err
	}
	return &Pulls{cfg: cfg, kv: kv, log: log, owner: hex.EncodeToString([]byte(natsstream.OwnerName(cfg.Name))),
		ops: make(chan pullOp, cfg.QueueLen), counts: xsync.NewMap[index.Holder, *atomic.Int64]()}, nil
}

// Started implements picker.Fleet.
func (f *Pulls) Started(h index.Holder) uint64 {
	tok := f.next.Add(1)
	f.enqueue(pullOp{token: tok, h: h})
	return tok
}

// Ended implements picker.Fleet.
func (f *Pulls) Ended(token uint64) { f.enqueue(pullOp{token: token, end: true}) }

func (f *Pulls) enqueue(op pullOp) {
	select {
	case f.ops <- op:
	default:
		f.dropped.Add(1)
	}
}

// Inflight implements picker.Fleet: the other replicas' pulls from h.
func (f *Pulls) Inflight(h index.Holder) int {
	if c, ok := f.counts.Load(h); ok {
		return int(c.Load())
	}
	return 0
}

// Stats returns the fleet's counters.
func (f *Pulls) Stats() PullsStats {
	return PullsStats{Started: f.started.Load(), Ended: f.ended.Load(), Dropped: f.dropped.Load(), Remote: int(f.remote.Load()),
		Malformed: f.malformed.Load(), OverCap: f.overCap.Load()}
}

// Run publishes this replica's starts and ends and watches the others'
// until ctx is done. Started and Ended only queue until it runs.
func (f *Pulls) Run(ctx context.Context) error {
	done := make(chan struct{})
	go func() { defer close(done); f.publish(ctx) }()
	defer func() { <-done }()
	for {
		f.watch(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

func (f *Pulls) key(token uint64) string { return f.owner + "." + strconv.FormatUint(token, 10) }

func (f *Pulls) publish(ctx context.Context) {
	for {
		var op pullOp
		select {
		case <-ctx.Done():
			return
		case op = <-f.ops:
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		var err error
		if op.end {
			err = f.kv.Delete(pctx, f.key(op.token))
		} else {
			_, err = f.kv.Put(pctx, f.key(op.token), []byte(strconv.Itoa(op.h.Rank)+"|"+op.h.Pod))
		}
		cancel()
		switch {
		case err != nil:
			f.dropped.Add(1)
			f.log.Debug("natsfleet: fleet publish failed", "err", err)
		case op.end:
			f.ended.Add(1)
		default:
			f.started.Add(1)
		}
	}
}

// watch follows the bucket until ctx is done or the watcher fails; the
// counts start over from the bucket's content each time.
func (f *Pulls) watch(ctx context.Context) {
	w, err := f.kv.WatchAll(ctx)
	if err != nil {
		f.log.Warn("natsfleet: fleet watch failed", "err", err)
		return
	}
	defer w.Stop()
	// Keyed by a seeded hash of the key, not the key: keys are as long as
	// a subject may be, whoever writes them.
	seed := maphash.MakeSeed()
	pulls := map[uint64]remotePull{}
	defer func() {
		for k, p := range pulls {
			f.drop(pulls, k, p)
		}
	}()
	sweep := time.NewTicker(max(f.cfg.TTL/8, 10*time.Millisecond))
	defer sweep.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-sweep.C:
			// Expiry markers can be late or lost; the TTL is the rule.
			for k, p := range pulls {
				if time.Since(p.created) > f.cfg.TTL {
					f.drop(pulls, k, p)
				}
			}
		case e, ok := <-w.Updates():
			if !ok {
				return
			}
			if e == nil {
				continue // the initial values are all in
			}
			owner, _, _ := strings.Cut(e.Key(), ".")
			if owner == f.owner {
				continue
			}
			k := maphash.String(seed, e.Key())
			if e.Operation() != jetstream.KeyValuePut {
				if p, ok := pulls[k]; ok {
					f.drop(pulls, k, p)
				}
				continue
			}
			if time.Since(e.Created()) > f.cfg.TTL {
				continue
			}
			if _, dup := pulls[k]; dup {
				continue
			}
			h, err := parsePull(e.Value())
			if err != nil {
				f.malformed.Add(1)
				f.log.Warn("natsfleet: fleet pull names no holder, not counted", "key", truncate(e.Key(), 64), "err", err)
				continue
			}
			if len(pulls) >= f.cfg.MaxRemote {
				f.overCap.Add(1)
				f.log.Warn("natsfleet: other replicas' pulls over PullsConfig.MaxRemote, not counted", "max", f.cfg.MaxRemote)
				continue
			}
			p := remotePull{h: h, created: e.Created()}
			pulls[k] = p
			f.counts.Compute(h, func(c *atomic.Int64, loaded bool) (*atomic.Int64, xsync.ComputeOp) {
				if !loaded {
					c = new(atomic.Int64)
				}
				c.Add(1)
				return c, xsync.UpdateOp
			})
			f.remote.Add(1)
		}
	}
}

func (f *Pulls) drop(pulls map[uint64]remotePull, k uint64, p remotePull) {
	delete(pulls, k)
	f.counts.Compute(p.h, func(c *atomic.Int64, loaded bool) (*atomic.Int64, xsync.ComputeOp) {
		if !loaded || c.Add(-1) <= 0 {
			return nil, xsync.DeleteOp
		}
		return c, xsync.UpdateOp
	})
	f.remote.Add(-1)
}

// parsePull reads a pull's value, "rank|pod", as a holder, copying the pod
// name out of the value.
func parsePull(v []byte) (index.Holder, error) {
	if len(v) > maxPullValue {
		return index.Holder{}, fmt.Errorf("%w: a value of %d bytes, over %d", errBadPull, len(v), maxPullValue)
	}
	rank, pod, ok := strings.Cut(string(v), "|")
	if !ok {
		return index.Holder{}, fmt.Errorf("%w: no rank|pod", errBadPull)
	}
	r, err := strconv.Atoi(rank)
	if err != nil || r < 0 {
		return index.Holder{}, fmt.Errorf("%w: rank %q", errBadPull, truncate(rank, 32))
	}
	if err := events.ValidPodName(pod); err != nil {
		return index.Holder{}, fmt.Errorf("%w: %w", errBadPull, err)
	}
	return index.Holder{Pod: pod, Rank: r}, nil
}
