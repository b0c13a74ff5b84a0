package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/picker"
)

// kvsource serve runs the SDK for routers not written in Go: a subscriber
// receives the engines' KV events into an index, and a picker answers over
// HTTP with JSON (block keys as decimal strings):
//
//	POST /v1/score  {"model", "tokens", "lora_name"?, "cache_salt"?, "mm_items"?, "pods"?}
//	                -> {"model", "blocks", "pods": [{"pod", "dp_rank", "matched_blocks", "tiers": {"GPU", "CPU"}, "score"}]}, best first
//	POST /v1/pick   {"model", "tokens", "lora_name"?, "cache_salt"?, "mm_items"?, "request_id"?, "destination",
//	                 "destination_dp_rank"?, "candidates"?: [{"pod", "dp_rank"?, "waiting"?, "load"?}], "min_cached_token_delta"?}
//	                -> {"destination", "source" (or null), "reason", "destination_cached_blocks", "source_blocks",
//	                    "best_source_blocks", "recompute_blocks", "missing_blocks", "header", "kv_transfer_params",
//	                    "predicted_saving_ms" (with --calibration), "skipped_sources", "skipped_state"?, ...}
//	POST /v1/done   {"request_id"} releases a pull so its source no longer counts it in flight: the
//	                pick's request_id, or the kv_request_id its answer made up when it had none
//	GET  /v1/pods   {"pods": [{"pod", "model", "dp_rank", "blocks", "last_seq", "state", "inflight_pulls",
//	                 and each per-holder counter of events.Counters: "gaps", "replays", "decode_errors",
//	                 "hash_mismatches", ...}], "endpoints": [{"pod", "endpoint", "connected"}] (--events-connect)}
//	GET  /metrics   Prometheus; GET /healthz
//
// A prompt's "tokens" may come as "tokens_b64" instead: base64 (standard,
// padded) of the token ids as little-endian uint32s. A candidate without
// "dp_rank" stands for every rank of its pod. Errors
// are {"error"}: 400 for a bad request (identifiers are at most 4 KiB), 405
// for another method, 404 for an unknown path and for /v1/score of a model
// the index knows no holder of while it knows others, which /v1/pick answers
// with reason "unknown_model", 413 for more tokens than --max-tokens or a
// body over its limit, 503 with Retry-After beyond --max-inflight-requests
// or past --request-timeout (see serve_limits.go). SIGINT or SIGTERM shuts
// down gracefully, saving the --snapshot file, which start-up loads; it is
// also saved every --snapshot-interval, so a crash loses at most that (see
// serve_snapshot.go). A holder loaded from the snapshot is listed "stale" in
// /v1/pods, with its saved last_seq, until its pod publishes again; it
// scores but is never a pull source, and if it does not publish within
// --snapshot-expiry its entries are removed (so that saves drop it).
//
// /v1/pods states: "live" (heard from since start and connected: the only
// pull sources), "stale", "disconnected" (its connection went down: the
// socket monitor sees a closed connection at once, a silent one within
// three heartbeats) and "conflict" (two sequence streams under one name).
// A pick that passed over holders in another state says so in
// "skipped_sources" and "skipped_state", and answers "no_live_source" when
// only they could have extended the prefix.
//
// On --events-bind, a topic naming a pod by an IP ("kv@10.0.0.7:8000@m") is
// accepted only from that IP, and one naming it by a DNS name only from
// --events-allow networks (default loopback); see events/doc.go for the
// threat model.

func init() {
	commands["serve"] = command{summary: "run events, index and picker as an HTTP JSON service", run: runServe}
}

// servePodEndpoint is one --events-connect value. Model, when set, is the
// pod's model whatever its topic says: vLLM's default topic is empty.
type servePodEndpoint struct {
	Pod, Endpoint, Replay, Model string
}

// Key modes of --keys.
const (
	// serveKeysEngine indexes the engines' own block keys, which the
	// service must reproduce (--algo, --seed, --block-size).
	serveKeysEngine = "engine"
	// serveKeysContent indexes kvsource content keys derived from the
	// tokens events carry, for engines whose keys no router reproduces
	// (llm-d's simulator, a random seed).
	serveKeysContent = "content"
)

// serveConfig is everything kvsource serve is configured with.
type serveConfig struct {
	EventsBind []string
	// EventsAllow are the sender networks --events-bind accepts pods named
	// by DNS names from (nil: loopback); EventsNoSenderCheck turns sender
	// verification off; EventsPodsPerSender bounds the pods one sender
	// publishes for (see zmq.SubscriberConfig).
	EventsAllow         []netip.Prefix
	EventsNoSenderCheck bool
	EventsPodsPerSender int
	// EventsMaxHolders bounds the holders followed (events.Config.MaxHolders).
	EventsMaxHolders int
	// SnapshotExpiry is how long holders restored from the snapshot that
	// never publish keep their entries.
	SnapshotExpiry      time.Duration
	EventsConnect       []servePodEndpoint
	EventsReplay        []servePodEndpoint
	HTTP                string
	Algo                string
	Keys                string // serveKeysEngine or serveKeysContent
	Seed                string
	SeedSet             bool // --seed given, perhaps as ''
	BlockSize           int
	MinCachedTokenDelta int
	P2PPort             int
	InflightTTL         time.Duration
	Snapshot            string
	Calibration         string
	// HashCacheBytes bounds the hash cache that spares a prompt whose
	// leading blocks were hashed recently their rehashing; 0 turns it off.
	HashCacheBytes  int64
	ShutdownTimeout time.Duration
	// ReplayDeadline bounds one pod's whole gap replay (every round).
	ReplayDeadline time.Duration
	// ReadTimeout bounds reading a request, body included; WriteTimeout
	// the time from the end of its headers to the end of the response;
	// IdleTimeout how long a keep-alive connection waits for the next.
	ReadTimeout, WriteTimeout, IdleTimeout time.Duration
	// NATS is the scale-out role (serve_nats.go); zero: standalone.
	NATS serveNATSConfig
	serveLimits
	serveSnapshotConfig
	serveMemoryConfig
}

type serveStringList []string

func (l *serveStringList) String() string     { return strings.Join(*l, ",") }
func (l *serveStringList) Set(v string) error { *l = append(*l, v); return nil }

type serveConnectList []servePodEndpoint

func (l *serveConnectList) String() string { return fmt.Sprint(*l) }

func (l *serveConnectList) Set(v string) error {
	pe, err := serveParsePodEndpoint(v)
	if err != nil {
		return err
	}
	*l = append(*l, pe)
	return nil
}

// serveParsePodEndpoint parses
// POD=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=MODEL]; a model name
// cannot contain a comma.
func serveParsePodEndpoint(v string) (servePodEndpoint, error) {
	const want = "POD=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=MODEL]"
	pod, rest, ok := strings.Cut(v, "=")
	if !ok || pod == "" || rest == "" {
		return servePodEndpoint{}, fmt.Errorf("want %s, got %q", want, v)
	}
	parts := strings.Split(rest, ",")
	pe := servePodEndpoint{Pod: pod, Endpoint: parts[0]}
	seen := map[string]bool{}
	for _, p := range parts[1:] {
		k, val, ok := strings.Cut(p, "=")
		if !ok || (k != "replay" && k != "model") || val == "" {
			return servePodEndpoint{}, fmt.Errorf("unknown option %q in %q (want %s)", p, v, want)
		}
		if seen[k] {
			return servePodEndpoint{}, fmt.Errorf("option %s given twice in %q", k, v)
		}
		seen[k] = true
		if k == "replay" {
			pe.Replay = val
		} else {
			pe.Model = val
		}
	}
	return pe, nil
}

func parseServeFlags(args []string, stderr io.Writer) (serveConfig, error) {
	cfg := serveConfig{}
	fs := flag.NewFlagSet("kvsource serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var bind serveStringList
	var connect, replay serveConnectList
	fs.Var(&bind, "events-bind", "bind a SUB socket engines connect to, e.g. tcp://*:5557 (repeatable)")
	var allow serveStringList
	fs.Var(&allow, "events-allow", "a sender network (CIDR) --events-bind accepts pods named by DNS names from (repeatable; default loopback only); a pod named by an IP is accepted from that IP only")
	fs.BoolVar(&cfg.EventsNoSenderCheck, "events-no-sender-check", false, "accept any sender on --events-bind for any pod name (only where every peer that reaches the port is trusted)")
	fs.IntVar(&cfg.EventsPodsPerSender, "events-max-pods-per-sender", 64, "pods one sender address may publish for on --events-bind")
	fs.IntVar(&cfg.EventsMaxHolders, "events-max-holders", 4096, "holders (pod, data-parallel rank) followed; at the bound the least recently heard one, stale first, is evicted to make room")
	fs.DurationVar(&cfg.SnapshotExpiry, "snapshot-expiry", 10*time.Minute, "how long holders restored from the snapshot that never publish keep their entries")
	fs.Var(&connect, "events-connect", "connect to a pod's PUB socket: POD=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=MODEL] (repeatable); "+
		"model= names the pod's model when its topic does not (vLLM's default topic is empty)")
	fs.Var(&replay, "events-replay", "replay endpoint of a pod that connects to --events-bind: POD=tcp://HOST:PORT, rank 0's; rank r's port is r higher (repeatable)")
	fs.StringVar(&cfg.HTTP, "http", "127.0.0.1:8080", "HTTP listen address")
	fs.StringVar(&cfg.Algo, "algo", string(hashing.SHA256), "the engines' --prefix-caching-hash-algo (with --keys engine)")
	fs.StringVar(&cfg.Keys, "keys", serveKeysEngine, "index keys: engine (the engines' own, reproduced with --algo and --seed) or "+
		"content (derived from the tokens events carry, for engines whose keys cannot be reproduced, such as llm-d's simulator)")
	var seed seedFlag
	fs.Var(&seed, "seed", "the engines' PYTHONHASHSEED; unset means vLLM's default, '' the empty string (required for xxhash algorithms)")
	fs.IntVar(&cfg.BlockSize, "block-size", hashing.DefaultBlockSize, "the engines' --block-size")
	fs.IntVar(&cfg.MinCachedTokenDelta, "min-cached-token-delta", picker.DefaultMinCachedTokenDelta, "smallest gain, in tokens, worth a pull")
	fs.IntVar(&cfg.P2PPort, "p2p-port", picker.DefaultP2PPort, "the engines' base P2P port (VLLM_P2P_SIDE_CHANNEL_PORT); rank r listens on it plus r")
	fs.DurationVar(&cfg.InflightTTL, "inflight-ttl", picker.DefaultInflightTTL, "how long a pull counts against its source")
	fs.StringVar(&cfg.Snapshot, "snapshot", "", "index snapshot file: loaded at start-up when it exists, saved every --snapshot-interval and at shutdown")
	fs.StringVar(&cfg.Calibration, "calibration", "", `measured recompute and pull times, JSON {"recompute": [{"tokens", "ms"}], "pull": [...], "margin"?}: pulls must also be predicted to save time`)
	cfg.HashCacheBytes = hashing.DefaultCacheBytes
	fs.Var((*serveSize)(&cfg.HashCacheBytes), "hash-cache-bytes", "memory bound of the cache of recent prompts' block keys (a size such as 256MiB), which spares a next turn rehashing the blocks an earlier one shares (0: off)")
	fs.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", 10*time.Second, "how long shutdown waits for requests in flight")
	fs.DurationVar(&cfg.ReplayDeadline, "replay-deadline", 10*time.Second, "how long one pod's gap replay from its engine may take in all, every round included, before the gap counts as lost")
	fs.DurationVar(&cfg.ReadTimeout, "http-read-timeout", 30*time.Second, "how long reading a request, body included, may take")
	fs.DurationVar(&cfg.WriteTimeout, "http-write-timeout", 30*time.Second, "how long answering a request may take, from the end of its headers")
	fs.DurationVar(&cfg.IdleTimeout, "http-idle-timeout", 2*time.Minute, "how long an idle keep-alive connection stays open")
	cfg.NATS.register(fs)
	cfg.serveLimits.flags(fs)
	cfg.serveSnapshotConfig.flags(fs)
	cfg.serveMemoryConfig.flags(fs)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kvsource serve [--events-bind tcp://HOST:PORT]...")
		fmt.Fprintln(stderr, "                      [--events-connect POD=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=MODEL]]...")
		fmt.Fprintln(stderr, "                      [--events-replay POD=tcp://HOST:PORT]...")
		fmt.Fprintln(stderr, "                      [--http 127.0.0.1:8080] [--keys engine|content] [--algo A] [--seed S] [--block-size N]")
		fmt.Fprintln(stderr, "                      [--min-cached-token-delta N] [--snapshot FILE] [--calibration FILE]")
		fmt.Fprintln(stderr, "                      [--nats nats://HOST:4222 --role relay|replica]")
		fmt.Fprintln(stderr, "endpoints: POST /v1/score, POST /v1/pick, POST /v1/done, GET /v1/pods, GET /metrics, GET /healthz")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	fs.Visit(func(f *flag.Flag) { cfg.NATS.set = append(cfg.NATS.set, f.Name) })
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	switch {
	case cfg.Keys != serveKeysEngine && cfg.Keys != serveKeysContent:
		return cfg, fmt.Errorf("--keys %q: want engine or content", cfg.Keys)
	case cfg.Algo == string(hashing.Content) && cfg.Keys != serveKeysContent:
		// No engine hashes with kvsource's content keys: indexing the
		// engines' keys and hashing requests with content keys matches
		// nothing.
		return cfg, fmt.Errorf("--algo content: no engine hashes with content keys; use --keys content")
	}
	if cfg.BlockSize < 1 {
		return cfg, fmt.Errorf("--block-size %d: must be at least 1 (the engines' block size)", cfg.BlockSize)
	}
	if cfg.MinCachedTokenDelta < 1 {
		return cfg, fmt.Errorf("--min-cached-token-delta must be at least 1, got %d", cfg.MinCachedTokenDelta)
	}
	for _, r := range replay {
		if r.Replay != "" || r.Model != "" {
			return cfg, fmt.Errorf("--events-replay %s: want POD=tcp://HOST:PORT", r.Pod)
		}
		r.Replay, r.Endpoint = r.Endpoint, ""
		cfg.EventsReplay = append(cfg.EventsReplay, r)
	}
	if cfg.InflightTTL <= 0 {
		return cfg, fmt.Errorf("--inflight-ttl must be positive, got %v", cfg.InflightTTL)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"--http-read-timeout", cfg.ReadTimeout}, {"--http-write-timeout", cfg.WriteTimeout}, {"--http-idle-timeout", cfg.IdleTimeout}} {
		if d.v <= 0 {
			return cfg, fmt.Errorf("%s must be positive, got %v", d.name, d.v)
		}
	}
	if err := cfg.serveLimits.check(cfg.WriteTimeout); err != nil {
		return cfg, err
	}
	if err := cfg.serveSnapshotConfig.check(); err != nil {
		return cfg, err
	}
	if err := cfg.serveMemoryConfig.check(); err != nil {
		return cfg, err
	}
	cfg.EventsBind, cfg.EventsConnect = bind, connect
	for _, a := range allow {
		p, err := netip.ParsePrefix(a)
		if err != nil {
			return cfg, fmt.Errorf("--events-allow %q: want a network such as 10.0.0.0/8: %w", a, err)
		}
		cfg.EventsAllow = append(cfg.EventsAllow, p.Masked())
	}
	if cfg.SnapshotExpiry <= 0 {
		return cfg, fmt.Errorf("--snapshot-expiry must be positive, got %v", cfg.SnapshotExpiry)
	}
	if cfg.EventsMaxHolders < 1 {
		return cfg, fmt.Errorf("--events-max-holders must be at least 1, got %d", cfg.EventsMaxHolders)
	}
	if cfg.EventsPodsPerSender < 1 {
		return cfg, fmt.Errorf("--events-max-pods-per-sender must be at least 1, got %d", cfg.EventsPodsPerSender)
	}
	cfg.Seed, cfg.SeedSet = seed.value, seed.set
	if err := cfg.NATS.check(&cfg); err != nil {
		return cfg, err
	}
	return cfg, nil
}

func runServe(args []string, _ io.Reader, stdout, stderr io.Writer) int {
	var usage bytes.Buffer
	cfg, err := parseServeFlags(args, &usage)
	if errors.Is(err, flag.ErrHelp) {
		_, _ = usage.WriteTo(stdout)
		return 0
	}
	if err != nil {
		_, _ = usage.WriteTo(stderr)
		fmt.Fprintf(stderr, "kvsource serve: %v\n", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	serveApplyMemoryLimit(cfg.IndexMemory, log)
	s, err := newServeService(ctx, cfg, log)
	if err != nil {
		log.Error("kvsource serve: start-up failed", "err", err)
		return 1
	}
	if err := s.Start(ctx); err != nil {
		log.Error("kvsource serve: start-up failed", "err", err)
		return 1
	}
	fmt.Fprintf(stdout, "kvsource serve: listening on http://%s\n", s.Addr())
	<-ctx.Done()
	stop()
	log.Info("kvsource serve: shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	if err := s.Shutdown(sctx); err != nil {
		log.Error("kvsource serve: shutdown", "err", err)
		return 1
	}
	return 0
}

// hashingConfig is the engines' hashing configuration.
func (c serveConfig) hashingConfig() hashing.Config {
	return hashing.Config{Algo: hashing.Algo(c.Algo), Seed: c.Seed, SeedSet: c.SeedSet, BlockSize: c.BlockSize}
}

// contentConfig is the content-key configuration of --keys content: the
// service both derives and looks up these keys, so only the block size
// must be the engines'.
func (c serveConfig) contentConfig() hashing.Config {
	return hashing.Config{Algo: hashing.Content, Seed: c.Seed, SeedSet: c.SeedSet, BlockSize: c.BlockSize}
}
