package natsfleet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/ratelog"
)

// DefaultSourcesInterval is SourcesConfig.Interval's default.
const DefaultSourcesInterval = time.Second

// DefaultSourcesTTL is the TTL that keeps the table across a relay's
// failover with the default lease TTL and interval: the dead leader's last
// table can be an interval old when it dies, its lease expires up to a TTL
// later, the standby tries to take it every quarter TTL and writes at
// once, and a second more covers the server's expiry and the network (a
// SIGKILL failover measured 5.8 s to the new lease, tables up to 7.8 s
// apart before the first write came at once).
const DefaultSourcesTTL = natsstream.DefaultLeaseTTL*5/4 + 3*DefaultSourcesInterval

// SourcesConfig configures a Sources. Only JetStream is required.
type SourcesConfig struct {
	natsstream.Config
	// JetStream is the client the table is written and watched with.
	JetStream jetstream.JetStream
	// Interval is how often the leading relay writes the table; default
	// DefaultSourcesInterval.
	Interval time.Duration
	// TTL is how long a table counts without a newer one: when no relay
	// writes for that long, every holder stops being a source. Default
	// three Intervals; to keep the table across a relay failover, at
	// least 1.25 times the relays' lease TTL plus three Intervals
	// (DefaultSourcesTTL, which kvsource serve uses). Relays and replicas
	// must use the same.
	TTL time.Duration
	// Relay, on a relay, is the relay whose lease vouches for the tables
	// Publish writes: each names the lease owner, and replicas take a table
	// only from the lease's current holder. Nil: the owner the lease
	// bucket names at each write.
	Relay *natsstream.Relay
	// Logger receives the logs; default slog.Default().
	Logger *slog.Logger
}

// Sources carries which holders may serve pulls from the relay, whose
// subscriber hears the engines and sees their connections, to the
// replicas, which pick but hear no engine: a replica's index alone cannot
// tell a live holder from one whose engine was killed a second ago.
//
// The leading relay writes its processor's holder states as one value of
// a key-value bucket (<Stream>_SOURCES) every Interval, naming itself as
// the relay lease's owner; a replica watches it and the lease (key
// "relay" of <Stream>_RELAY), and answers Source from the newest table
// that names the lease's current holder: a table anyone else wrote is
// dropped and counted (SourcesStats.NotHolder). A holder the table does
// not list, or every holder once the table is older than TTL, is no
// source: the replica never pulls from a holder no relay vouches for.
type Sources struct {
	cfg   SourcesConfig
	kv    jetstream.KeyValue
	log   *slog.Logger
	table atomic.Pointer[map[index.Holder]string]

	written, writeErrors, updates, malformed, notHolder atomic.Uint64
	// warns limits the warnings: a table is written, and a watch
	// retried, every Interval.
	warns ratelog.Limiter
}

// sourcesKey is the table's key: one table, the leading relay's.
const sourcesKey = "table"

// NewSources creates or updates the sources bucket.
func NewSources(ctx context.Context, cfg SourcesConfig) (*Sources, error) {
	if cfg.JetStream == nil {
		return nil, fmt.Errorf("%w: SourcesConfig.JetStream is required", ErrConfig)
	}
	cfg.Config = cfg.Config.WithDefaults()
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultSourcesInterval
	}
	if cfg.TTL <= 0 {
		cfg.TTL = 3 * cfg.Interval
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	// JetStream's expiry markers need a TTL of a second at least; the
	// watcher drops a table older than TTL itself.
	kv, err := cfg.KeyValue(ctx, cfg.JetStream, "_SOURCES", max(cfg.TTL, time.Second))
	if err != nil {
		return nil, err
	}
	return &Sources{cfg: cfg, kv: kv, log: log, warns: ratelog.Limiter{Interval: time.Minute}}, nil
}

// Publish writes status's holder states every Interval while leader
// reports true, and at once when it turns true, so that a failover leaves
// the replicas no longer without a table than it must; until ctx is done.
// A relay runs it with its subscriber's Status and its own Leader.
func (s *Sources) Publish(ctx context.Context, status func() []events.HolderStatus, leader func() bool) error {
	// Leadership is checked every quarter Interval, at most 250 ms apart.
	period := max(min(s.cfg.Interval/4, 250*time.Millisecond), time.Millisecond)
	tick := time.NewTicker(period)
	defer tick.Stop()
	var buf []byte
	var last time.Time // of the last write, zero while not leading
	for {
		if !leader() {
			last = time.Time{}
		} else if last.IsZero() || time.Since(last) >= s.cfg.Interval-period/2 {
			// (Half a tick early: the tick an Interval on may come a
			// moment before a full Interval has passed.)
			last = time.Now()
			pctx, cancel := context.WithTimeout(ctx, s.cfg.Interval)
			owner, err := s.owner(pctx)
			if err == nil {
				buf = appendSourcesTable(buf[:0], owner, status())
				_, err = s.kv.Put(pctx, sourcesKey, buf)
			}
			cancel()
			if err != nil && ctx.Err() == nil {
				s.writeErrors.Add(1)
				s.warn("natsfleet: sources table write failed; replicas stop pulling from holders when no table arrives for the TTL",
					"err", err, "bytes", len(buf), "ttl", s.cfg.TTL)
			} else if err == nil {
				s.written.Add(1)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// owner is the lease owner the table names: Relay's, or the lease
// bucket's holder.
func (s *Sources) owner(ctx context.Context) (string, error) {
	if s.cfg.Relay != nil {
		return s.cfg.Relay.Owner(), nil
	}
	kv, err := s.cfg.JetStream.KeyValue(ctx, s.cfg.Stream+"_RELAY")
	if err != nil {
		return "", fmt.Errorf("natsfleet: relay lease bucket: %w", err)
	}
	e, err := kv.Get(ctx, natsstream.RelayLeaseKey)
	if err != nil {
		return "", fmt.Errorf("natsfleet: relay lease: %w", err)
	}
	return string(e.Value()), nil
}

// Watch follows the table until ctx is done.
func (s *Sources) Watch(ctx context.Context) error {
	for {
		s.watch(ctx)
		s.table.Store(nil)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(s.cfg.Interval):
		}
	}
}

func (s *Sources) watch(ctx context.Context) {
	w, err := s.kv.Watch(ctx, sourcesKey)
	if err != nil {
		s.warn("natsfleet: sources watch failed", "err", err)
		return
	}
	defer w.Stop()
	// The lease bucket is the relays': a replica binds to it, and waits
	// for a relay to create it.
	lkv, err := s.cfg.JetStream.KeyValue(ctx, s.cfg.Stream+"_RELAY")
	if err != nil {
		s.warn("natsfleet: relay lease bucket not found; no table counts until a relay runs", "err", err)
		return
	}
	lw, err := lkv.Watch(ctx, natsstream.RelayLeaseKey)
	if err != nil {
		s.warn("natsfleet: relay lease watch failed", "err", err)
		return
	}
	defer lw.Stop()
	// holder is the lease's holder, "" while nobody holds it: the table
	// taken stays until its TTL, as it must across a failover, but none
	// other is. A table that names a holder before the lease's update
	// says so (the two watches do not keep each other's order) waits in
	// early, the newest only.
	var holder string
	var early struct {
		owner string
		t     map[index.Holder]string
		at    time.Time
	}
	// Expiry markers can be late or lost: a table older than TTL is
	// dropped here too. A table's age is this process's time since it
	// arrived, not the server's stamp, which another clock wrote; only the
	// table there already when the watch starts is aged by its stamp
	// (never into the future).
	check := time.NewTicker(s.cfg.Interval)
	defer check.Stop()
	var at time.Time
	initial := true
	for {
		select {
		case <-ctx.Done():
			return
		case <-check.C:
			if !at.IsZero() && time.Since(at) > s.cfg.TTL {
				s.table.Store(nil)
				at = time.Time{}
			}
		case e, ok := <-lw.Updates():
			if !ok {
				return
			}
			if e == nil {
				continue
			}
			holder = ""
			if e.Operation() == jetstream.KeyValuePut {
				holder = string(e.Value())
			}
			if holder != "" && early.owner == holder && time.Since(early.at) <= s.cfg.TTL {
				t := early.t // its own variable: early is reused
				s.table.Store(&t)
				at = early.at
				s.updates.Add(1)
				early.t, early.owner = nil, ""
			}
		case e, ok := <-w.Updates():
			if !ok {
				return
			}
			if e == nil {
				initial = false // the values there at the start are in
				continue
			}
			if e.Operation() != jetstream.KeyValuePut {
				s.table.Store(nil)
				at = time.Time{}
				continue
			}
			owner, t, err := parseSourcesTable(e.Value())
			if err != nil {
				s.malformed.Add(1)
				s.warn("natsfleet: dropped a malformed sources table", "err", err)
				continue
			}
			arrived := time.Now()
			if initial && e.Created().Before(arrived) {
				arrived = e.Created()
			}
			if owner != holder {
				s.notHolder.Add(1)
				early.owner, early.t, early.at = owner, t, arrived
				if holder == "" {
					// The lease's first update has not arrived: at start-up
					// the table often comes first, and waits for it.
					s.log.Debug("natsfleet: a sources table waits for the relay lease's update", "owner", truncate(owner, 256))
				} else if _, _, ok := s.warns.Allow("not_holder", ""); ok {
					s.log.Warn("natsfleet: dropped a sources table not from the relay lease's holder (yet)",
						"owner", truncate(owner, 256), "holder", holder)
				}
				continue
			}
			s.table.Store(&t)
			at = arrived
			s.updates.Add(1)
		}
	}
}

// Source implements picker.Config.Sources: whether the leading relay's
// newest table lists h as live. A holder it does not list, or any holder
// while there is no table, is events.StateStale.
func (s *Sources) Source(h index.Holder) (state string, ok bool) {
	t := s.table.Load()
	if t == nil {
		return events.StateStale, false
	}
	st, known := (*t)[h]
	if !known {
		return events.StateStale, false
	}
	return st, st == events.StateLive
}

// warn logs at most once a minute, whatever the message.
func (s *Sources) warn(msg string, args ...any) {
	if _, _, ok := s.warns.Allow("warn", ""); ok {
		s.log.Warn(msg, args...)
	}
}

// SourcesStats are a Sources' counters.
type SourcesStats struct {
	Written, WriteErrors uint64 // tables this relay wrote, and failed to
	Updates, Malformed   uint64 // tables this replica took, and dropped as malformed
	// NotHolder counts the tables this replica dropped, or held back
	// until the lease's update, as not from the lease's holder.
	NotHolder uint64
	Holders   int // holders in the table now, -1 for none
}

// Stats returns the counters.
func (s *Sources) Stats() SourcesStats {
	st := SourcesStats{Written: s.written.Load(), WriteErrors: s.writeErrors.Load(), Updates: s.updates.Load(),
		Malformed: s.malformed.Load(), NotHolder: s.notHolder.Load(), Holders: -1}
	if t := s.table.Load(); t != nil {
		st.Holders = len(*t)
	}
	return st
}

// The table is a line naming the relay lease's owner, "owner <owner>\n",
// then one line per holder, "state rank pod\n": pod names are printable
// ASCII without spaces (events.ValidPodName), states are words.
func appendSourcesTable(b []byte, owner string, hs []events.HolderStatus) []byte {
	b = append(b, "owner "...)
	b = append(b, owner...)
	b = append(b, '\n')
	for _, h := range hs {
		b = append(b, h.State...)
		b = append(b, ' ')
		b = strconv.AppendInt(b, int64(h.Rank), 10)
		b = append(b, ' ')
		b = append(b, h.Pod...)
		b = append(b, '\n')
	}
	return b
}

var errSourcesTable = errors.New("natsfleet: bad sources table line")

func parseSourcesTable(b []byte) (owner string, _ map[index.Holder]string, _ error) {
	first, b, _ := bytes.Cut(b, []byte{'\n'})
	o, ok := bytes.CutPrefix(first, []byte("owner "))
	if !ok || len(o) == 0 || bytes.IndexByte(o, '\n') >= 0 {
		return "", nil, fmt.Errorf("%w: no owner line: %q", errSourcesTable, truncate(string(first), 64))
	}
	t := map[index.Holder]string{}
	for len(b) > 0 {
		line, rest, _ := bytes.Cut(b, []byte{'\n'})
		b = rest
		state, tail, ok1 := bytes.Cut(line, []byte{' '})
		rank, pod, ok2 := bytes.Cut(tail, []byte{' '})
		r, err := strconv.Atoi(string(rank))
		if !ok1 || !ok2 || err != nil || r < 0 || events.ValidPodName(string(pod)) != nil {
			return "", nil, fmt.Errorf("%w: %q", errSourcesTable, line)
		}
		t[index.Holder{Pod: string(pod), Rank: r}] = string(state)
	}
	return string(o), t, nil
}
