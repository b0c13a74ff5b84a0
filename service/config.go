package service

import (
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/internal/cliflag"
	"github.com/kvsource/kvsource/picker"
)

// PodEndpoint is one --events-connect value. Model, when set, is the
// pod's model whatever its topic says: vLLM's default topic is empty.
type PodEndpoint struct {
	Pod, Endpoint, Replay, Model string
	// Engine is the engine the pod runs (engine=vllm, sglang or trtllm).
	Engine events.Engine
}

// Key modes of --keys.
const (
	// KeysEngine indexes the engines' own block keys, which the
	// service must reproduce (--algo, --seed, --block-size).
	KeysEngine = "engine"
	// KeysContent indexes kvsource content keys derived from the
	// tokens events carry, for engines whose keys no router reproduces
	// (llm-d's simulator, a random seed).
	KeysContent = "content"
)

// Config configures a Service. Its zero value is a working standalone
// service that hears no engine until events are configured: New fills in
// the defaults below for zero fields, and ParseFlags gives every flag the
// same default. Errors name the flag of the field.
type Config struct {
	// EventsBind are addresses of SUB sockets engines connect to
	// (--events-bind, e.g. tcp://*:5557).
	EventsBind []string
	// EventsAllow are the sender networks EventsBind accepts pods named by
	// DNS names from (nil: loopback); a pod named by an IP is accepted from
	// that IP only. EventsNoSenderCheck turns sender verification off.
	EventsAllow         []netip.Prefix
	EventsNoSenderCheck bool
	// EventsPodsPerSender bounds the pods, and the holders (pod x
	// data-parallel rank), one sender publishes for: the peer's address on
	// EventsBind, the pod on EventsConnect (zmq.SubscriberConfig's
	// MaxPodsPerSender, events.Config.MaxHoldersPerSender); zero:
	// DefaultEventsPodsPerSender.
	EventsPodsPerSender int
	// EventsLogBudget bounds the log lines of each kind a second across
	// all pods (events.Config.LogBudget); zero: 10.
	EventsLogBudget int
	// EventsMaxHolders bounds the holders followed
	// (events.Config.MaxHolders); zero: DefaultEventsMaxHolders.
	EventsMaxHolders int
	// SnapshotExpiry is how long holders restored from the snapshot that
	// never publish keep their entries; zero: DefaultSnapshotExpiry.
	SnapshotExpiry time.Duration
	// EventsConnect are engines' PUB sockets to connect to, and
	// EventsReplay the replay endpoints of engines that connect to
	// EventsBind.
	EventsConnect []PodEndpoint
	EventsReplay  []PodEndpoint
	// EventsEngine is the engine of the pods EventsBind hears that
	// EventsConnect does not name; zero: vLLM. When every pod runs one
	// engine other than vLLM and Algo is empty, its default keys
	// (events.Engine.Hashing) are the service's, block size included
	// unless BlockSize is set.
	EventsEngine events.Engine
	// HTTP is the address ListenAndServe listens on; empty:
	// DefaultHTTP. A Service mounted in another server ignores it.
	HTTP string
	// Algo, Seed (with SeedSet: Seed was given, perhaps as "") and
	// BlockSize are the engines' hashing: --prefix-caching-hash-algo,
	// PYTHONHASHSEED and --block-size; zero: hashing.Config's defaults
	// (vLLM's).
	Algo      string
	Seed      string
	SeedSet   bool
	BlockSize int
	// Keys is KeysEngine (the default) or KeysContent.
	Keys string
	// MinCachedTokenDelta, P2PPort and InflightTTL configure the picker;
	// zero: picker.Config's defaults.
	MinCachedTokenDelta int
	P2PPort             int
	InflightTTL         time.Duration
	// Snapshot is the index snapshot file, loaded at start-up when it
	// exists and saved every SnapshotInterval and at shutdown; empty: none.
	Snapshot string
	// Calibration is a file of measured recompute and pull times; with
	// one, pulls must also be predicted to save time.
	Calibration string
	// HashCacheBytes bounds the hash cache that spares a prompt whose
	// leading blocks were hashed recently their rehashing; zero:
	// hashing.DefaultCacheBytes, HashCacheOff: none.
	HashCacheBytes int64
	// ShutdownTimeout is how long the kvsource command's shutdown waits for
	// requests in flight; zero: DefaultShutdownTimeout.
	ShutdownTimeout time.Duration
	// ReplayDeadline bounds one pod's whole gap replay (every round); zero:
	// DefaultReplayDeadline.
	ReplayDeadline time.Duration
	// ReadTimeout bounds reading a request, body included; WriteTimeout
	// the time from the end of its headers to the end of the response;
	// IdleTimeout how long a keep-alive connection waits for the next.
	// They apply to Serve and ListenAndServe; zero: DefaultReadTimeout,
	// DefaultWriteTimeout, DefaultIdleTimeout.
	ReadTimeout, WriteTimeout, IdleTimeout time.Duration
	// MaxConnections bounds Serve's open connections, leaving descriptors
	// for the engines' sockets and snapshot saves (see conns.go); zero:
	// DefaultMaxConnections.
	MaxConnections int
	// SpeculativeTTL, when positive, records each pick's prompt on its
	// destination at once as speculative blocks (index.Speculative) that
	// score as GPU blocks until the TTL passes or the engine evicts them
	// (llm-d's speculativeTTL is 2 s), so that a burst on a new prefix
	// follows the first request instead of spreading; zero: off.
	// SpeculativeMemory bounds them; zero: index.DefaultSpeculativeBytes.
	// SpeculativeHolders bounds the destinations no engine has reported
	// from that they make holders of, until their last entry expires (any
	// client picks with destinations it makes up); zero:
	// index.DefaultSpeculativeHolders.
	SpeculativeTTL     time.Duration
	SpeculativeMemory  int64
	SpeculativeHolders int
	// NATS is the scale-out role; zero: standalone.
	NATS NATSConfig
	// KVHints are the KV hints for vLLM's KVCR tier; zero: none.
	KVHints KVHintsConfig
	Limits
	SnapshotConfig
	MemoryConfig
	RenderConfig

	// Logger receives the service's logs; nil: slog.Default().
	Logger *slog.Logger
	// Registry is where the service registers its metrics, which
	// /metrics serves; nil: a registry of its own. Give a registry
	// another server exports to serve them there too.
	Registry *prometheus.Registry
}

// Defaults of Config's zero fields and of the kvsource serve flags.
const (
	DefaultHTTP                = "127.0.0.1:8080"
	DefaultEventsPodsPerSender = 64
	DefaultEventsMaxHolders    = 4096
	DefaultSnapshotExpiry      = 10 * time.Minute
	DefaultShutdownTimeout     = 10 * time.Second
	DefaultReplayDeadline      = 10 * time.Second
	DefaultReadTimeout         = 30 * time.Second
	DefaultWriteTimeout        = 30 * time.Second
	DefaultIdleTimeout         = 2 * time.Minute
	DefaultMaxConnections      = 1024
	// HashCacheOff is the HashCacheBytes of no hash cache.
	HashCacheOff = -1
)

// engineDefaults gives Algo and BlockSize, when unset, the default keys of
// the one engine every pod runs, when that is not vLLM.
func (c *Config) engineDefaults() {
	engines := map[events.Engine]bool{}
	if len(c.EventsBind) > 0 {
		engines[c.EventsEngine] = true
	}
	for _, pe := range c.EventsConnect {
		engines[pe.Engine] = true
	}
	if len(engines) != 1 || engines[events.EngineVLLM] || c.Algo != "" {
		return // vLLM's are the defaults; a mixed fleet has no one hashing
	}
	for engine := range engines {
		h := engine.Hashing()
		c.Algo = string(h.Algo)
		if c.BlockSize == 0 {
			c.BlockSize = h.BlockSize
		}
	}
}

// setDefaults fills in the default of every zero field.
func (c *Config) setDefaults() {
	c.engineDefaults()
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.EventsPodsPerSender, DefaultEventsPodsPerSender)
	def(&c.EventsMaxHolders, DefaultEventsMaxHolders)
	def(&c.BlockSize, hashing.DefaultBlockSize)
	def(&c.MinCachedTokenDelta, picker.DefaultMinCachedTokenDelta)
	def(&c.P2PPort, picker.DefaultP2PPort)
	def(&c.MaxInflight, DefaultMaxInflight())
	def(&c.MaxConnections, DefaultMaxConnections)
	def(&c.MaxTokens, DefaultMaxTokens)
	def(&c.NATS.Replicas, 1)
	defDur(&c.SnapshotExpiry, DefaultSnapshotExpiry)
	defDur(&c.InflightTTL, picker.DefaultInflightTTL)
	defDur(&c.ShutdownTimeout, DefaultShutdownTimeout)
	defDur(&c.ReplayDeadline, DefaultReplayDeadline)
	defDur(&c.ReadTimeout, DefaultReadTimeout)
	defDur(&c.WriteTimeout, DefaultWriteTimeout)
	defDur(&c.IdleTimeout, DefaultIdleTimeout)
	defDur(&c.RequestTimeout, min(DefaultRequestTimeout, c.WriteTimeout/2))
	defDur(&c.NATS.MaxLag, natsstream.DefaultMaxLag)
	if c.HTTP == "" {
		c.HTTP = DefaultHTTP
	}
	if c.Algo == "" {
		c.Algo = string(hashing.SHA256)
	}
	if c.Keys == "" {
		c.Keys = KeysEngine
	}
	if c.HashCacheBytes == 0 {
		c.HashCacheBytes = hashing.DefaultCacheBytes
	}
	if c.SnapshotCorrupt == "" {
		c.SnapshotCorrupt = CorruptFail
	}
	if c.EventsMaxMessage == 0 {
		c.EventsMaxMessage = DefaultEventsMaxMessage
	}
	if c.EventsQueueMemory == 0 {
		c.EventsQueueMemory = max(DefaultEventsQueueMemory, c.EventsMaxMessage)
	}
	if c.MaxBodyMemory == 0 {
		c.MaxBodyMemory = defaultMaxBodyMemory(c.MaxInflight, c.MaxTokens)
	}
	if c.KeptPullsMemory == 0 {
		c.KeptPullsMemory = DefaultKeptPullsMemory
	}
	if c.NATS.Stream == "" {
		c.NATS.Stream = natsstream.DefaultStream
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

type connectList []PodEndpoint

func (l *connectList) String() string { return fmt.Sprint(*l) }

func (l *connectList) Set(v string) error {
	pe, err := ParsePodEndpoint(v)
	if err != nil {
		return err
	}
	*l = append(*l, pe)
	return nil
}

// ParsePodEndpoint parses
// POD=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=MODEL][,engine=ENGINE];
// a model name cannot contain a comma.
func ParsePodEndpoint(v string) (PodEndpoint, error) {
	const want = "POD=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=MODEL][,engine=vllm|sglang|trtllm]"
	pod, rest, ok := strings.Cut(v, "=")
	if !ok || pod == "" || rest == "" {
		return PodEndpoint{}, fmt.Errorf("want %s, got %q", want, v)
	}
	parts := strings.Split(rest, ",")
	pe := PodEndpoint{Pod: pod, Endpoint: parts[0]}
	seen := map[string]bool{}
	for _, p := range parts[1:] {
		k, val, ok := strings.Cut(p, "=")
		if !ok || (k != "replay" && k != "model" && k != "engine") || val == "" {
			return PodEndpoint{}, fmt.Errorf("unknown option %q in %q (want %s)", p, v, want)
		}
		if seen[k] {
			return PodEndpoint{}, fmt.Errorf("option %s given twice in %q", k, v)
		}
		seen[k] = true
		switch k {
		case "replay":
			pe.Replay = val
		case "model":
			pe.Model = val
		default:
			e, err := events.ParseEngine(val)
			if err != nil {
				return PodEndpoint{}, fmt.Errorf("%q: %w", v, err)
			}
			pe.Engine = e
		}
	}
	return pe, nil
}

// ParseFlags registers kvsource serve's flags on fs, parses args and
// validates the result: the configuration the kvsource command runs with.
// Every flag's default is the default New applies to the zero value of its
// field, except where a field's comment says otherwise.
func ParseFlags(fs *flag.FlagSet, args []string) (Config, error) {
	cfg := Config{}
	var bind stringList
	var connect, replay connectList
	fs.Var(&bind, "events-bind", "bind a SUB socket engines connect to, e.g. tcp://*:5557 (repeatable)")
	var allow stringList
	fs.Var(&allow, "events-allow", "a sender network (CIDR) --events-bind accepts pods named by DNS names from (repeatable; default loopback only); a pod named by an IP is accepted from that IP only")
	fs.BoolVar(&cfg.EventsNoSenderCheck, "events-no-sender-check", false, "accept any sender on --events-bind for any pod name (only where every peer that reaches the port is trusted)")
	fs.IntVar(&cfg.EventsPodsPerSender, "events-max-pods-per-sender", DefaultEventsPodsPerSender, "pods, and holders (pod x data-parallel rank), one sender may publish for (a sender is the peer's address on --events-bind, the pod on --events-connect)")
	fs.IntVar(&cfg.EventsLogBudget, "events-log-budget", 10, "event-intake log lines of each kind a second across all pods; the next line says how many were left out")
	fs.IntVar(&cfg.EventsMaxHolders, "events-max-holders", DefaultEventsMaxHolders, "holders (pod, data-parallel rank) followed; at the bound the least recently heard one, stale first, is evicted to make room")
	fs.DurationVar(&cfg.SnapshotExpiry, "snapshot-expiry", DefaultSnapshotExpiry, "how long holders restored from the snapshot that never publish keep their entries")
	fs.Var(&connect, "events-connect", "connect to a pod's PUB socket: POD=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=MODEL][,engine=vllm|sglang|trtllm] (repeatable); "+
		"model= names the pod's model when its topic does not (vLLM's and SGLang's default topic is empty), engine= the engine when it is not vLLM")
	var engine string
	fs.StringVar(&engine, "events-engine", "vllm", "the engine (vllm, sglang or trtllm) of the pods --events-bind hears; with one engine other than vLLM for every pod and no --algo, its default keys and block size are used")
	fs.Var(&replay, "events-replay", "replay endpoint of a pod that connects to --events-bind: POD=tcp://HOST:PORT, rank 0's; rank r's port is r higher (repeatable)")
	fs.StringVar(&cfg.HTTP, "http", DefaultHTTP, "HTTP listen address")
	fs.StringVar(&cfg.Algo, "algo", string(hashing.SHA256), "the engines' --prefix-caching-hash-algo (with --keys engine)")
	fs.StringVar(&cfg.Keys, "keys", KeysEngine, "index keys: engine (the engines' own, reproduced with --algo and --seed) or "+
		"content (derived from the tokens events carry, for engines whose keys cannot be reproduced, such as llm-d's simulator)")
	var seed cliflag.Seed
	fs.Var(&seed, "seed", "the engines' PYTHONHASHSEED; unset means vLLM's default, '' the empty string (required for xxhash algorithms)")
	fs.IntVar(&cfg.BlockSize, "block-size", hashing.DefaultBlockSize, "the engines' --block-size")
	fs.IntVar(&cfg.MinCachedTokenDelta, "min-cached-token-delta", picker.DefaultMinCachedTokenDelta, "smallest gain, in tokens, worth a pull")
	fs.IntVar(&cfg.P2PPort, "p2p-port", picker.DefaultP2PPort, "the engines' base P2P port (VLLM_P2P_SIDE_CHANNEL_PORT); rank r listens on it plus r")
	fs.DurationVar(&cfg.InflightTTL, "inflight-ttl", picker.DefaultInflightTTL, "how long a pull counts against its source")
	fs.StringVar(&cfg.Snapshot, "snapshot", "", "index snapshot file: loaded at start-up when it exists, saved every --snapshot-interval and at shutdown")
	fs.StringVar(&cfg.Calibration, "calibration", "", `measured recompute and pull times, JSON {"recompute": [{"tokens", "ms"}], "pull": [...], "margin"?}: pulls must also be predicted to save time`)
	hashCache := int64(hashing.DefaultCacheBytes)
	fs.Var((*sizeFlag)(&hashCache), "hash-cache-bytes", "memory bound of the cache of recent prompts' block keys (a size such as 256MiB), which spares a next turn rehashing the blocks an earlier one shares (0: off)")
	fs.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", DefaultShutdownTimeout, "how long shutdown waits for requests in flight")
	fs.DurationVar(&cfg.ReplayDeadline, "replay-deadline", DefaultReplayDeadline, "how long one pod's gap replay from its engine may take in all, every round included, before the gap counts as lost")
	fs.DurationVar(&cfg.ReadTimeout, "http-read-timeout", DefaultReadTimeout, "how long reading a request, body included, may take")
	fs.DurationVar(&cfg.WriteTimeout, "http-write-timeout", DefaultWriteTimeout, "how long answering a request may take, from the end of its headers")
	fs.DurationVar(&cfg.IdleTimeout, "http-idle-timeout", DefaultIdleTimeout, "how long an idle keep-alive connection stays open")
	fs.DurationVar(&cfg.SpeculativeTTL, "speculative-ttl", 0, "record each pick's prompt on its destination as speculative blocks that score as GPU blocks (never a pull source) until this passes or the engine evicts them; llm-d uses 2s (0: off)")
	fs.Var((*sizeFlag)(&cfg.SpeculativeMemory), "speculative-memory", "memory bound of the speculative blocks (0: 16MiB)")
	fs.IntVar(&cfg.SpeculativeHolders, "speculative-holders", 0, "most pick destinations no engine has reported from that speculative blocks are kept for at once; a pick past it records none (0: 1024)")
	fs.IntVar(&cfg.MaxConnections, "http-max-connections", DefaultMaxConnections, "HTTP connections open at once; at the bound idle ones are closed first, and with none idle a new one is refused (keep it well below the descriptor limit: engines' sockets and snapshot saves need some)")
	cfg.NATS.register(fs)
	cfg.Limits.flags(fs)
	cfg.SnapshotConfig.flags(fs)
	cfg.MemoryConfig.flags(fs)
	cfg.RenderConfig.flags(fs)
	cfg.KVHints.flags(fs)
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	given := map[string]bool{} // the flags on the command line
	fs.Visit(func(f *flag.Flag) {
		given[f.Name] = true
		cfg.NATS.set = append(cfg.NATS.set, f.Name)
	})
	if err := cfg.NATS.secretFiles(); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	for _, r := range replay {
		if r.Replay != "" || r.Model != "" {
			return cfg, fmt.Errorf("--events-replay %s: want POD=tcp://HOST:PORT", r.Pod)
		}
		r.Replay, r.Endpoint = r.Endpoint, ""
		cfg.EventsReplay = append(cfg.EventsReplay, r)
	}
	cfg.EventsBind, cfg.EventsConnect = bind, connect
	for _, a := range allow {
		p, err := netip.ParsePrefix(a)
		if err != nil {
			return cfg, fmt.Errorf("--events-allow %q: want a network such as 10.0.0.0/8: %w", a, err)
		}
		cfg.EventsAllow = append(cfg.EventsAllow, p.Masked())
	}
	cfg.Seed, cfg.SeedSet = seed.Value, seed.Given
	var err error
	if cfg.EventsEngine, err = events.ParseEngine(engine); err != nil {
		return cfg, fmt.Errorf("--events-engine: %w", err)
	}
	if !given["algo"] {
		cfg.Algo = ""
	}
	if !given["block-size"] {
		cfg.BlockSize = 0
	}
	cfg.engineDefaults()
	if cfg.Algo == "" {
		cfg.Algo = string(hashing.SHA256)
	}
	if cfg.BlockSize == 0 && !given["block-size"] {
		cfg.BlockSize = hashing.DefaultBlockSize
	}
	switch {
	case hashCache < 0:
		return cfg, fmt.Errorf("--hash-cache-bytes must not be negative, got %d", hashCache)
	case hashCache == 0:
		cfg.HashCacheBytes = HashCacheOff
	default:
		cfg.HashCacheBytes = hashCache
	}
	return cfg, cfg.Validate()
}

// Validate reports the first setting that cannot work, naming its flag. New
// validates after it has filled in the defaults of zero fields; ParseFlags
// before, so that a flag given as 0 where 0 cannot work is refused.
func (c *Config) Validate() error {
	switch {
	case c.Keys != "" && c.Keys != KeysEngine && c.Keys != KeysContent:
		return fmt.Errorf("--keys %q: want engine or content", c.Keys)
	case c.Algo == string(hashing.Content) && c.Keys != KeysContent:
		// No engine hashes with kvsource's content keys: indexing the
		// engines' keys and hashing requests with content keys matches
		// nothing.
		return fmt.Errorf("--algo content: no engine hashes with content keys; use --keys content")
	}
	if c.BlockSize < 1 {
		return fmt.Errorf("--block-size %d: must be at least 1 (the engines' block size)", c.BlockSize)
	}
	if c.MinCachedTokenDelta < 1 {
		return fmt.Errorf("--min-cached-token-delta must be at least 1, got %d", c.MinCachedTokenDelta)
	}
	if c.InflightTTL <= 0 {
		return fmt.Errorf("--inflight-ttl must be positive, got %v", c.InflightTTL)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"--http-read-timeout", c.ReadTimeout}, {"--http-write-timeout", c.WriteTimeout}, {"--http-idle-timeout", c.IdleTimeout}} {
		if d.v <= 0 {
			return fmt.Errorf("%s must be positive, got %v", d.name, d.v)
		}
	}
	if c.SpeculativeTTL < 0 || c.SpeculativeMemory < 0 || c.SpeculativeHolders < 0 {
		return fmt.Errorf("--speculative-ttl, --speculative-memory and --speculative-holders must not be negative")
	}
	if c.SpeculativeTTL > 0 && c.NATS.Role == RoleReplica {
		return fmt.Errorf("--speculative-ttl: a replica's index is the stream's; record speculative blocks on a standalone service")
	}
	if c.MaxConnections < 1 {
		return fmt.Errorf("--http-max-connections must be at least 1, got %d", c.MaxConnections)
	}
	if err := c.Limits.check(c.WriteTimeout); err != nil {
		return err
	}
	if err := c.SnapshotConfig.check(); err != nil {
		return err
	}
	if err := c.MemoryConfig.check(); err != nil {
		return err
	}
	if err := c.KVHints.check(); err != nil {
		return err
	}
	if c.SnapshotExpiry <= 0 {
		return fmt.Errorf("--snapshot-expiry must be positive, got %v", c.SnapshotExpiry)
	}
	if c.EventsMaxHolders < 1 {
		return fmt.Errorf("--events-max-holders must be at least 1, got %d", c.EventsMaxHolders)
	}
	if c.EventsLogBudget < 0 {
		return fmt.Errorf("--events-log-budget must not be negative, got %d", c.EventsLogBudget)
	}
	if c.EventsPodsPerSender < 1 {
		return fmt.Errorf("--events-max-pods-per-sender must be at least 1, got %d", c.EventsPodsPerSender)
	}
	return c.NATS.check(c)
}

// hashingConfig is the engines' hashing configuration.
func (c Config) hashingConfig() hashing.Config {
	return hashing.Config{Algo: hashing.Algo(c.Algo), Seed: c.Seed, SeedSet: c.SeedSet, BlockSize: c.BlockSize}
}

// contentConfig is the content-key configuration of --keys content: the
// service both derives and looks up these keys, so only the block size
// must be the engines'.
func (c Config) contentConfig() hashing.Config {
	return hashing.Config{Algo: hashing.Content, Seed: c.Seed, SeedSet: c.SeedSet, BlockSize: c.BlockSize}
}
