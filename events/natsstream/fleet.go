package natsstream

import (
	"context"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/puzpuzpuz/xsync/v4"

	"github.com/kvsource/kvsource/index"
)

// Defaults of FleetConfig.
const (
	// DefaultPullTTL is picker.DefaultInflightTTL.
	DefaultPullTTL  = 30 * time.Second
	DefaultQueueLen = 4096
)

// FleetConfig configures a Fleet. Only JetStream is required.
type FleetConfig struct {
	Config
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
	// it they are dropped and counted (FleetStats.Dropped), and the other
	// replicas do not see those pulls. Default DefaultQueueLen.
	QueueLen int
	// Logger receives the fleet's logs; default slog.Default().
	Logger *slog.Logger
}

// FleetStats are a Fleet's counters.
type FleetStats struct {
	Started, Ended uint64 // this replica's pulls published
	Dropped        uint64 // starts and ends not published: queue full or publish failed
	Remote         int    // other replicas' pulls in flight now
}

// Fleet shares in-flight pulls among router replicas through a JetStream
// key-value bucket: it implements picker.Fleet. A pull this replica
// directs is a key <owner>.<token> until it is done (or its TTL passes),
// published in the background so that Pick never waits on the network;
// a watcher of the bucket counts the other owners' keys per holder.
type Fleet struct {
	cfg   FleetConfig
	kv    jetstream.KeyValue
	log   *slog.Logger
	owner string // hex of a unique owner name: a key token
	ops   chan fleetOp
	next  atomic.Uint64

	counts *xsync.Map[index.Holder, *atomic.Int64]
	remote atomic.Int64

	started, ended, dropped atomic.Uint64
}

type fleetOp struct {
	token uint64
	h     index.Holder
	end   bool
}

type remotePull struct {
	h       index.Holder
	created time.Time
}

// NewFleet creates or updates the pulls bucket.
func NewFleet(ctx context.Context, cfg FleetConfig) (*Fleet, error) {
	if cfg.JetStream == nil {
		return nil, fmt.Errorf("%w: FleetConfig.JetStream is required", ErrConfig)
	}
	cfg.Config = cfg.Config.withDefaults()
	cfg.Name = defaultName(cfg.Name)
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultPullTTL
	}
	if cfg.QueueLen <= 0 {
		cfg.QueueLen = DefaultQueueLen
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	kv, err := cfg.ensureKV(ctx, cfg.JetStream, "_PULLS", cfg.TTL)
	if err != nil {
		return nil, err
	}
	return &Fleet{cfg: cfg, kv: kv, log: log, owner: hex.EncodeToString([]byte(uniqueOwner(cfg.Name))),
		ops: make(chan fleetOp, cfg.QueueLen), counts: xsync.NewMap[index.Holder, *atomic.Int64]()}, nil
}

// Started implements picker.Fleet.
func (f *Fleet) Started(h index.Holder) uint64 {
	tok := f.next.Add(1)
	f.enqueue(fleetOp{token: tok, h: h})
	return tok
}

// Ended implements picker.Fleet.
func (f *Fleet) Ended(token uint64) { f.enqueue(fleetOp{token: token, end: true}) }

func (f *Fleet) enqueue(op fleetOp) {
	select {
	case f.ops <- op:
	default:
		f.dropped.Add(1)
	}
}

// Inflight implements picker.Fleet: the other replicas' pulls from h.
func (f *Fleet) Inflight(h index.Holder) int {
	if c, ok := f.counts.Load(h); ok {
		return int(c.Load())
	}
	return 0
}

// Stats returns the fleet's counters.
func (f *Fleet) Stats() FleetStats {
	return FleetStats{Started: f.started.Load(), Ended: f.ended.Load(), Dropped: f.dropped.Load(), Remote: int(f.remote.Load())}
}

// Run publishes this replica's starts and ends and watches the others'
// until ctx is done. Started and Ended only queue until it runs.
func (f *Fleet) Run(ctx context.Context) error {
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

func (f *Fleet) key(token uint64) string { return f.owner + "." + strconv.FormatUint(token, 10) }

func (f *Fleet) publish(ctx context.Context) {
	for {
		var op fleetOp
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
			f.log.Debug("natsstream: fleet publish failed", "err", err)
		case op.end:
			f.ended.Add(1)
		default:
			f.started.Add(1)
		}
	}
}

// watch follows the bucket until ctx is done or the watcher fails; the
// counts start over from the bucket's content each time.
func (f *Fleet) watch(ctx context.Context) {
	w, err := f.kv.WatchAll(ctx)
	if err != nil {
		f.log.Warn("natsstream: fleet watch failed", "err", err)
		return
	}
	defer w.Stop()
	pulls := map[string]remotePull{}
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
			if e.Operation() != jetstream.KeyValuePut {
				if p, ok := pulls[e.Key()]; ok {
					f.drop(pulls, e.Key(), p)
				}
				continue
			}
			rank, pod, ok := strings.Cut(string(e.Value()), "|")
			r, err := strconv.Atoi(rank)
			if !ok || err != nil || time.Since(e.Created()) > f.cfg.TTL {
				continue
			}
			if _, dup := pulls[e.Key()]; dup {
				continue
			}
			p := remotePull{h: index.Holder{Pod: pod, Rank: r}, created: e.Created()}
			pulls[e.Key()] = p
			c, _ := f.counts.LoadOrCompute(p.h, func() (*atomic.Int64, bool) { return new(atomic.Int64), false })
			c.Add(1)
			f.remote.Add(1)
		}
	}
}

func (f *Fleet) drop(pulls map[string]remotePull, k string, p remotePull) {
	delete(pulls, k)
	if c, ok := f.counts.Load(p.h); ok {
		c.Add(-1)
	}
	f.remote.Add(-1)
}
