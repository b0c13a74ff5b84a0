package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/ratelog"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/picker/natsfleet"
)

// kvsource serve --nats URL --role relay|replica scales out over NATS
// JetStream (package events/natsstream):
//
//   - relay: receives the engines' events as a standalone serve does (and
//     answers the same API from its own index), and appends every batch
//     to the shared stream. Run two for high availability: one publishes,
//     the other takes over.
//   - replica: takes no engine sockets; its index is the stream's, warm
//     started from the newest shared snapshot, and its picker counts the
//     other replicas' in-flight pulls. /v1/pods adds a "replica" object
//     (applied stream sequence, lag in messages and seconds, snapshot age),
//     /healthz answers 503 while the replica lags more than --nats-max-lag,
//     and Prometheus gets kvsource_replica_* gauges. With --keys content
//     it applies the stream in content-key mode, as the relay does; every
//     relay and replica of a fleet must be given the same --keys,
//     --block-size and --seed.

// NATSConfig is what the --nats flags configure.
type NATSConfig struct {
	URL              string
	Role             string
	Name             string
	Stream           string
	Models           string
	SnapshotInterval time.Duration
	MaxLag           time.Duration
	Replicas         int
	// Conn is how the connection authenticates and is secured (see the
	// natsstream package doc's Security section).
	Conn natsstream.ConnConfig
	// Bind has a replica use the relays' stream and buckets without the
	// rights to create or change them (natsstream.Config.Bind).
	Bind bool
	// MaxControlLine is the server's max_control_line, for a relay
	// (natsstream.RelayConfig.MaxControlLine); zero: the server's default.
	MaxControlLine int
	// set names the flags given on the command line; secretFiles reads
	// the password and token they name, after parsing.
	set         []string
	secretFiles func() error
}

// replicaFlags are the flags only a replica acts on.
var replicaFlags = []string{"nats-models", "nats-snapshot-interval", "nats-max-lag", "nats-bind"}

// relayFlags are the flags only a relay acts on.
var relayFlags = []string{"nats-max-control-line"}

const (
	RoleRelay   = "relay"
	RoleReplica = "replica"
)

func (c *NATSConfig) register(fs *flag.FlagSet) {
	fs.StringVar(&c.URL, "nats", "", "NATS server URL(s), comma-separated, e.g. nats://nats.nats.svc:4222: share the event stream over JetStream")
	fs.StringVar(&c.Role, "role", "", "with --nats: relay (engines' events to the stream) or replica (stream to this index)")
	fs.StringVar(&c.Name, "nats-name", "", "this relay's or replica's name in leases and logs (default host name and pid)")
	fs.StringVar(&c.Stream, "nats-stream", natsstream.DefaultStream, "the JetStream stream; buckets are named after it")
	fs.StringVar(&c.Models, "nats-models", "", "replica: comma-separated models to consume (sharding by model); default every model")
	fs.DurationVar(&c.SnapshotInterval, "nats-snapshot-interval", time.Minute, "replica: compete for the snapshot lease and store a shared snapshot this often (0: never; a NATS user with only a replica's permissions, not a snapshotter's, needs 0)")
	fs.IntVar(&c.Replicas, "nats-replicas", 1, "JetStream replication of the stream and buckets when this process creates them (3 on a three-node cluster)")
	fs.DurationVar(&c.MaxLag, "nats-max-lag", natsstream.DefaultMaxLag, "replica: /healthz fails while the replica lags the stream by more")
	fs.StringVar(&c.Conn.CredsFile, "nats-creds", "", "NATS credentials file (a user JWT and its nkey seed, as nsc writes it)")
	fs.StringVar(&c.Conn.NKeySeedFile, "nats-nkey", "", "file holding a NATS user nkey seed (SU...)")
	fs.StringVar(&c.Conn.User, "nats-user", "", "NATS user name (with the password from $KVSOURCE_NATS_PASSWORD or --nats-password-file)")
	var passwordFile, tokenFile string
	fs.StringVar(&passwordFile, "nats-password-file", "", "file holding the NATS user's password (or set $KVSOURCE_NATS_PASSWORD); kept off the command line, where ps shows it")
	fs.StringVar(&tokenFile, "nats-token-file", "", "file holding a NATS token (or set $KVSOURCE_NATS_TOKEN)")
	fs.StringVar(&c.Conn.TLSCA, "nats-tls-ca", "", "PEM file of the CAs that sign the NATS server's certificate (requires TLS)")
	fs.StringVar(&c.Conn.TLSCert, "nats-tls-cert", "", "PEM client certificate for NATS mutual TLS, with --nats-tls-key")
	fs.StringVar(&c.Conn.TLSKey, "nats-tls-key", "", "PEM key of --nats-tls-cert")
	fs.BoolVar(&c.Bind, "nats-bind", false, "replica: use the relays' stream and buckets without creating or updating them (for a NATS user with only a replica's permissions; start the relays first)")
	fs.IntVar(&c.MaxControlLine, "nats-max-control-line", natsstream.DefaultMaxControlLine, "relay: the NATS server's max_control_line; a batch whose subject is longer is dropped and counted")
	c.secretFiles = func() error {
		var err error
		if c.Conn.Password, err = secret(passwordFile, "KVSOURCE_NATS_PASSWORD", "--nats-password-file"); err != nil {
			return err
		}
		c.Conn.Token, err = secret(tokenFile, "KVSOURCE_NATS_TOKEN", "--nats-token-file")
		return err
	}
}

// secret reads a secret from file, else from the environment variable env.
func secret(file, env, flag string) (string, error) {
	if file == "" {
		return os.Getenv(env), nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("%s: %w", flag, err)
	}
	return strings.TrimRight(string(b), "\r\n"), nil
}

func (c *NATSConfig) check(cfg *Config) error {
	switch {
	case c.URL == "" && c.Role == "":
		return nil
	case c.URL == "":
		return errors.New("--role needs --nats")
	case c.Role != RoleRelay && c.Role != RoleReplica:
		return fmt.Errorf("--role must be relay or replica, got %q", c.Role)
	case c.Role == RoleReplica && (len(cfg.EventsBind) > 0 || len(cfg.EventsConnect) > 0 || len(cfg.EventsReplay) > 0):
		return errors.New("a replica reads the stream: --events-bind, --events-connect and --events-replay are the relay's")
	case c.Role == RoleReplica && cfg.Snapshot != "":
		return errors.New("a replica shares snapshots through JetStream: --snapshot is for standalone and relay")
	case c.Role == RoleRelay && slices.ContainsFunc(c.set, func(f string) bool { return slices.Contains(replicaFlags, f) }):
		return fmt.Errorf("--%s are a replica's flags; a relay has no use for them", strings.Join(replicaFlags, ", --"))
	case c.Role == RoleReplica && slices.ContainsFunc(c.set, func(f string) bool { return slices.Contains(relayFlags, f) }):
		return fmt.Errorf("--%s are a relay's flags; a replica has no use for them", strings.Join(relayFlags, ", --"))
	case c.Replicas < 1:
		return fmt.Errorf("--nats-replicas must be at least 1, got %d", c.Replicas)
	case c.MaxLag <= 0:
		return fmt.Errorf("--nats-max-lag must be positive, got %v", c.MaxLag)
	}
	for s := range strings.SplitSeq(c.URL, ",") {
		if strings.TrimSpace(s) == "" {
			continue // the client skips empty entries too
		}
		u, err := natsURL(s)
		if err != nil || u.Hostname() == "" || !slices.Contains([]string{"nats", "tls", "ws", "wss"}, u.Scheme) {
			return fmt.Errorf("--nats %q: want nats://HOST:PORT (or tls://, ws://, wss://), comma-separated", redactNATS(s))
		}
	}
	return nil
}

// natsRole is a serve's relay or replica; every method is a no-op on nil
// (no --nats).
type natsRole struct {
	cfg     NATSConfig
	nc      *nats.Conn
	relay   *natsstream.Relay
	replica *natsstream.Replica
	pulls   *natsfleet.Pulls
	// sources carries the relay's holder states to the replicas, whose
	// pickers pull only from holders the relay has live.
	sources *natsfleet.Sources
	wg      sync.WaitGroup
	// lastErr is the newest failed connection attempt's error.
	lastErr atomic.Pointer[error]
}

// newServeNATS connects to NATS and sets up the role's streams and
// buckets, within natsSetupTimeout or until ctx is done. contentKeys is
// the --keys content hasher, nil with engine keys: a replica applies the
// stream with it, so that its index holds the keys its requests hash to.
func newServeNATS(ctx context.Context, cfg Config, contentKeys *hashing.Hasher, log *slog.Logger) (*natsRole, error) {
	c := cfg.NATS
	if c.URL == "" {
		return nil, nil
	}
	n := &natsRole{cfg: c}
	var err error
	// Every failed attempt, at start-up as later, is logged (at most one
	// line a second): a server that is down is never silent.
	var retries ratelog.Gate
	security, err := c.Conn.Options()
	if err != nil {
		return nil, fmt.Errorf("--nats: %w", err)
	}
	n.nc, err = nats.Connect(c.URL, append(security, nats.Name("kvsource "+c.Role), nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true),
		nats.ReconnectWait(natsRetryWait),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) {
			n.lastErr.Store(&err)
			if skipped, ok := retries.Allow(time.Second); ok {
				log.Warn("kvsource serve: NATS connection attempt failed, retrying", "nats", redactNATS(c.URL), "err", err,
					"every", natsRetryWait, "left_out", skipped)
			}
		}))...)
	if err != nil {
		return nil, fmt.Errorf("--nats %s: %w", redactNATS(c.URL), err)
	}
	ctx, cancel := context.WithTimeout(ctx, natsSetupTimeout)
	defer cancel()
	if err := n.awaitConnected(ctx, log); err != nil {
		n.nc.Close()
		return nil, err
	}
	js, err := jetstream.New(n.nc)
	if err != nil {
		n.nc.Close()
		return nil, fmt.Errorf("--nats %s: %w", redactNATS(c.URL), err)
	}
	log.Info("kvsource serve: setting up on NATS", "nats", redactNATS(c.URL), "role", c.Role, "stream", c.Stream,
		"server_version", n.nc.ConnectedServerVersion())
	shared := natsstream.Config{Stream: c.Stream, Replicas: c.Replicas, Bind: c.Bind}
	if c.Role == RoleRelay {
		n.relay, err = natsstream.NewRelay(ctx, natsstream.RelayConfig{Config: shared, JetStream: js, Name: c.Name, Logger: log,
			MaxControlLine: c.MaxControlLine})
	} else {
		var models []string
		if c.Models != "" {
			models = strings.Split(c.Models, ",")
		}
		n.replica, err = natsstream.Open(ctx, natsstream.ReplicaConfig{Config: shared, JetStream: js, Name: c.Name, Models: models,
			SnapshotInterval: c.SnapshotInterval, MaxLag: c.MaxLag, ContentKeys: contentKeys, Logger: log})
		if err == nil {
			n.pulls, err = natsfleet.NewPulls(ctx, natsfleet.PullsConfig{Config: shared, JetStream: js, Name: c.Name,
				TTL: cfg.InflightTTL, Logger: log})
		}
	}
	if err == nil {
		// The table outlasts a relay failover (see DefaultSourcesTTL).
		n.sources, err = natsfleet.NewSources(ctx, natsfleet.SourcesConfig{Config: shared, JetStream: js, Logger: log,
			TTL: natsfleet.DefaultSourcesTTL})
	}
	if err != nil {
		if !n.nc.IsConnected() {
			err = fmt.Errorf("--nats %s: connection lost while setting up (%s): %w", redactNATS(c.URL),
				natsDialError(context.WithoutCancel(ctx), c.URL), err)
		}
		n.nc.Close()
		return nil, err
	}
	return n, nil
}

const (
	// natsSetupTimeout bounds connecting and setting up the streams and
	// buckets at start-up.
	natsSetupTimeout = 30 * time.Second
	// natsReportAfter is how long start-up waits for a first connection
	// before it says why there is none; it goes on trying until
	// natsSetupTimeout.
	natsReportAfter = 2 * time.Second
	// natsRetryWait is the pause between connection attempts.
	natsRetryWait = time.Second
)

// MinNATSServer is the oldest nats-server kvsource runs on: JetStream's
// per-message TTLs and subject delete markers (the lease and the sources
// table) came in 2.11.
var MinNATSServer = [3]int{2, 11, 0}

// ErrNATSServerTooOld is returned by New for a server older than
// MinNATSServer.
var ErrNATSServerTooOld = errors.New("nats-server too old")

// awaitConnected waits for the first connection until ctx is done, saying
// after natsReportAfter why there is none yet, and checks the server's
// version.
func (n *natsRole) awaitConnected(ctx context.Context, log *slog.Logger) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	report := time.After(natsReportAfter)
	for !n.nc.IsConnected() {
		// Refused credentials do not get better by retrying.
		if last := n.lastErr.Load(); last != nil && isNATSAuthError(*last) {
			return fmt.Errorf("--nats %s: the server refuses the credentials (--nats-creds, --nats-nkey, --nats-user, a token or the URL's): %w",
				redactNATS(n.cfg.URL), *last)
		}
		select {
		case <-ctx.Done():
			why := "no answer"
			if last := n.lastErr.Load(); last != nil {
				why = (*last).Error()
			}
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				why = natsDialError(context.WithoutCancel(ctx), n.cfg.URL)
			}
			return fmt.Errorf("--nats %s: not connected (%s): %w", redactNATS(n.cfg.URL), why, ctx.Err())
		case <-report:
			log.Warn("kvsource serve: NATS not reachable yet, still trying", "nats", redactNATS(n.cfg.URL),
				"why", natsDialError(ctx, n.cfg.URL), "gives_up_after", natsSetupTimeout)
		case <-tick.C:
		}
	}
	return checkNATSVersion(n.nc.ConnectedServerVersion(), redactNATS(n.cfg.URL))
}

func isNATSAuthError(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) || errors.Is(err, nats.ErrAuthRevoked) ||
		strings.Contains(strings.ToLower(err.Error()), "authorization violation")
}

// checkNATSVersion refuses a server older than MinNATSServer, saying what
// is needed and how to get it.
func checkNATSVersion(version, url string) error {
	var v [3]int
	core, _, _ := strings.Cut(strings.TrimPrefix(version, "v"), "-")
	parts := strings.Split(core, ".")
	for i := 0; i < len(v) && i < len(parts); i++ {
		n, err := strconv.Atoi(parts[i])
		if err != nil {
			return fmt.Errorf("--nats %s: unreadable server version %q: %w", url, version, ErrNATSServerTooOld)
		}
		v[i] = n
	}
	if slices.Compare(v[:], MinNATSServer[:]) < 0 {
		return fmt.Errorf("--nats %s: nats-server %s is older than %d.%d, which kvsource needs for JetStream's per-message TTLs "+
			"(run one with `go tool nats-server -js` from this repository, or the nats:2.11 image or newer): %w",
			url, version, MinNATSServer[0], MinNATSServer[1], ErrNATSServerTooOld)
	}
	return nil
}

// natsURL parses one server of a --nats list as the client does: a
// URL without a scheme is nats://.
func natsURL(s string) (*url.URL, error) {
	s = strings.TrimSpace(s)
	if !strings.Contains(s, "://") {
		s = "nats://" + s
	}
	return url.Parse(s)
}

// redactNATS is a --nats list with the passwords of its URLs hidden,
// for logs and errors.
func redactNATS(urls string) string {
	var out []string
	for s := range strings.SplitSeq(urls, ",") {
		s = strings.TrimSpace(s)
		u, err := natsURL(s)
		switch {
		case err != nil:
			// Unparsed: hide whatever stands before the host.
			start := 0
			if i := strings.Index(s, "://"); i >= 0 {
				start = i + 3
			}
			if j := strings.LastIndexByte(s, '@'); j >= start {
				s = s[:start] + "xxxxx" + s[j:]
			}
		case u.User != nil:
			// A user without a password is a token to nats.go.
			if _, ok := u.User.Password(); !ok {
				u.User = url.User("xxxxx")
			}
			s = u.Redacted()
		}
		out = append(out, s)
	}
	return strings.Join(out, ",")
}

// natsDialError says why the first server of a NATS URL list takes no
// connection: the client, which retries in the background, reports only
// that no server was available. The dial takes a second at most.
func natsDialError(ctx context.Context, urls string) string {
	first, _, _ := strings.Cut(urls, ",")
	u, err := natsURL(first)
	if err != nil {
		return err.Error()
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"ws": "80", "wss": "443"}[u.Scheme]
	}
	if port == "" {
		port = "4222" // nats://, tls://
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", net.JoinHostPort(u.Hostname(), port))
	if err != nil {
		return err.Error()
	}
	conn.Close()
	return "the server takes TCP connections but no NATS session came up"
}

// relayDropped exports a relay's batches never published, by why.
type relayDropped struct{ r *natsstream.Relay }

var relayDroppedDesc = prometheus.NewDesc("kvsource_relay_dropped_total",
	"Batches the relay never published, by reason: subject_too_long (over --nats-max-control-line), too_big, failed (every attempt), expired (trimmed before publishing); replicas see each as a gap.",
	[]string{"reason"}, nil)

func (d relayDropped) Describe(ch chan<- *prometheus.Desc) { ch <- relayDroppedDesc }

func (d relayDropped) Collect(ch chan<- prometheus.Metric) {
	st := d.r.Stats()
	for reason, v := range map[string]uint64{"subject_too_long": st.TooLong, "too_big": st.TooBig, "failed": st.Failed, "expired": st.Expired} {
		ch <- prometheus.MustNewConstMetric(relayDroppedDesc, prometheus.CounterValue, float64(v), reason)
	}
}

// pickerSources is the picker's Config.Sources on a replica: the relay's
// holder states. Elsewhere nil: the service's own subscriber knows them.
func (n *natsRole) pickerSources() func(index.Holder) (string, bool) {
	if n == nil || n.replica == nil {
		return nil
	}
	return n.sources.Source
}

// tap is the subscriber's Config.Tap: the relay's, else none.
func (n *natsRole) tap() func(events.TapBatch) {
	if n == nil || n.relay == nil {
		return nil
	}
	return n.relay.Tap
}

// pickerFleet is the picker's Config.Fleet: a replica's, else none.
func (n *natsRole) pickerFleet() picker.Fleet {
	if n == nil || n.pulls == nil {
		return nil
	}
	return n.pulls
}

// start runs the relay and its holder states (from status), or the
// replica, its fleet and the states it picks by, until ctx is done.
func (n *natsRole) start(ctx context.Context, status func() []events.HolderStatus) {
	if n == nil {
		return
	}
	if n.relay != nil {
		n.wg.Go(func() { _ = n.relay.Run(ctx) })
		n.wg.Go(func() { _ = n.sources.Publish(ctx, status, n.relay.Leader) })
	}
	if n.replica != nil {
		n.wg.Go(func() { _ = n.replica.Run(ctx) })
		n.wg.Go(func() { _ = n.pulls.Run(ctx) })
		n.wg.Go(func() { _ = n.sources.Watch(ctx) })
	}
}

// stop waits for the relay's or replica's goroutines (a relay's releases
// its lease) until ctx is done, then closes the connection.
func (n *natsRole) stop(ctx context.Context) error {
	if n == nil {
		return nil
	}
	defer n.nc.Close()
	done := make(chan struct{})
	go func() { n.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("nats: %s did not stop: %w", n.cfg.Role, ctx.Err())
	}
}

// healthy is nil unless this is a replica that cannot answer for the
// fleet, or a relay that cannot publish.
func (n *natsRole) healthy() error {
	switch {
	case n == nil:
		return nil
	case n.replica != nil:
		return n.replica.Healthy()
	case !n.nc.IsConnected():
		return errors.New("relay disconnected from NATS: the engines' batches are kept, not published")
	}
	return n.relay.Healthy()
}

// handleReplicaPods is a replica's /v1/pods: the holders its index has,
// their in-flight pulls fleet-wide, and the replica's progress.
func (s *Service) handleReplicaPods(w http.ResponseWriter, _ *http.Request) {
	st := s.nats.replica.Status()
	lagging := s.nats.healthy() != nil
	applied := map[index.Holder]events.HolderStatus{}
	for _, hs := range s.nats.replica.Holders() {
		applied[hs.Holder()] = hs
	}
	pods := []Pod{}
	for _, hm := range s.idx.HolderList() {
		// The relay's state of the holder; a replica lagging the stream
		// has entries older than that says.
		state, _ := s.nats.sources.Source(hm.Holder)
		if lagging && state == events.StateLive {
			state = events.StateStale
		}
		hs := applied[hm.Holder]
		pods = append(pods, Pod{Pod: hm.Holder.Pod, Model: hm.Model, DPRank: hm.Holder.Rank,
			Blocks: s.holderBlocks(hm.Model, hm.Holder), LastSeq: hs.LastSeq, State: state,
			InflightPulls: s.pk.Inflight(hm.Holder) + s.nats.pulls.Inflight(hm.Holder), Counters: holderCounters(&hs)})
	}
	slices.SortStableFunc(pods, func(a, b Pod) int {
		return index.Holder{Pod: a.Pod, Rank: a.DPRank}.Compare(index.Holder{Pod: b.Pod, Rank: b.DPRank})
	})
	// endpoints: a replica dials no engine, but answers in the same shape.
	writeJSON(w, http.StatusOK, map[string]any{"pods": pods, "endpoints": []Endpoint{}, "replica": st})
}

// registerMetrics adds the relay's or replica's gauges and counters.
func (n *natsRole) registerMetrics(reg *prometheus.Registry) {
	if n == nil {
		return
	}
	gauge := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, f)
	}
	counter := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, f)
	}
	b := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	src := n.sources
	if n.relay != nil {
		reg.MustRegister(
			counter("kvsource_sources_tables_written_total", "Holder-state tables this relay wrote for the replicas (while it leads).", func() float64 { return float64(src.Stats().Written) }),
			counter("kvsource_sources_table_write_errors_total", "Holder-state table writes that failed; replicas pull from no holder once no table arrives for the TTL.", func() float64 { return float64(src.Stats().WriteErrors) }),
		)
	}
	if n.replica != nil {
		reg.MustRegister(
			counter("kvsource_sources_tables_received_total", "Holder-state tables received from the leading relay.", func() float64 { return float64(src.Stats().Updates) }),
			counter("kvsource_sources_tables_malformed_total", "Holder-state tables dropped as malformed.", func() float64 { return float64(src.Stats().Malformed) }),
			counter("kvsource_sources_tables_not_holder_total", "Holder-state tables dropped (or held back until the lease's update) as not from the relay lease's holder.", func() float64 { return float64(src.Stats().NotHolder) }),
			gauge("kvsource_sources_table_holders", "Holders in the newest holder-state table; -1 while there is none (no holder is a pull source).", func() float64 { return float64(src.Stats().Holders) }),
		)
	}
	if r := n.relay; r != nil {
		reg.MustRegister(
			gauge("kvsource_relay_leader", "1 while this relay holds the relay lease and publishes.", func() float64 { return b(r.Stats().Leader) }),
			counter("kvsource_relay_published_total", "Batches the stream stored from this relay.", func() float64 { return float64(r.Stats().Published) }),
			counter("kvsource_relay_duplicates_total", "Batches the stream already had (another relay's, or a retry).", func() float64 { return float64(r.Stats().Duplicates) }),
			counter("kvsource_relay_retries_total", "Publishes that failed and were retried.", func() float64 { return float64(r.Stats().Retries) }),
			counter("kvsource_relay_republished_total", "Kept batches published on taking the lease over.", func() float64 { return float64(r.Stats().Republished) }),
			counter("kvsource_relay_split_total", "Batches over the server's max_payload published in parts.", func() float64 { return float64(r.Stats().Split) }),
			counter("kvsource_relay_parts_total", "Parts the split batches were published in.", func() float64 { return float64(r.Stats().Parts) }),
			gauge("kvsource_relay_backlog", "Batches tapped while leading and not published yet.", func() float64 { return float64(r.Stats().Backlog) }),
			gauge("kvsource_relay_backlog_seconds", "Age of the oldest batch not published yet.", func() float64 { return r.Stats().BacklogSeconds }),
			gauge("kvsource_relay_max_payload_bytes", "The NATS server's max_payload, as its INFO announced.", func() float64 { return float64(r.Stats().MaxPayload) }),
			relayDropped{r},
		)
	}
	if r := n.replica; r != nil {
		f := n.pulls
		reg.MustRegister(
			gauge("kvsource_replica_ready", "1 once the replica applied what the stream held when it started.", func() float64 { return b(r.Status().Ready) }),
			gauge("kvsource_replica_applied_stream_seq", "Stream sequence of the last message applied.", func() float64 { return float64(r.Status().AppliedSeq) }),
			gauge("kvsource_replica_lag_messages", "Messages of the replica's subjects stored and not applied yet.", func() float64 { return float64(r.Status().LagMessages) }),
			gauge("kvsource_replica_lag_seconds", "Age of the oldest message not applied yet.", func() float64 { return r.Status().LagSeconds }),
			gauge("kvsource_replica_snapshot_age_seconds", "Age of the newest snapshot loaded or stored; -1 for none.", func() float64 { return r.Status().SnapshotAgeSeconds }),
			counter("kvsource_replica_batches_total", "Batches applied from the stream.", func() float64 { return float64(r.Status().Batches) }),
			counter("kvsource_replica_bad_messages_total", "Stream messages dropped: bad headers or payload.", func() float64 { return float64(r.Status().BadMessages) }),
			counter("kvsource_replica_gaps_total", "Holder sequence gaps seen in the stream.", func() float64 { return float64(r.Status().Gaps) }),
			counter("kvsource_replica_restarts_total", "Engine restarts seen in the stream.", func() float64 { return float64(r.Status().Restarts) }),
			counter("kvsource_replica_snapshots_stored_total", "Shared snapshots this replica stored.", func() float64 { return float64(r.Status().Snapshots) }),
			counter("kvsource_replica_joined_batches_total", "Batches put back together from a relay's parts.", func() float64 { return float64(r.Status().Joined) }),
			counter("kvsource_replica_dropped_parts_total", "Parts dropped: out of order, or of a batch that could not be joined.", func() float64 { return float64(r.Status().DroppedParts) }),
			gauge("kvsource_fleet_remote_pulls", "Pulls other replicas have in flight.", func() float64 { return float64(f.Stats().Remote) }),
			counter("kvsource_fleet_dropped_total", "Pull starts and ends not shared: queue full or publish failed.", func() float64 { return float64(f.Stats().Dropped) }),
			counter("kvsource_fleet_malformed_pulls_total", "Other replicas' pulls not counted: their value names no holder (a pod name over 253 bytes, say).", func() float64 { return float64(f.Stats().Malformed) }),
			counter("kvsource_fleet_over_cap_pulls_total", "Other replicas' pulls not counted: 65,536 were in flight already.", func() float64 { return float64(f.Stats().OverCap) }),
		)
	}
}
