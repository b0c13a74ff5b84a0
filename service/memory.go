package service

import (
	"flag"
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/index"
)

// Memory budgets in bytes: --index-memory bounds the index's live data
// (index.Config.MemoryBytes, evicting oldest first past it) and gives the
// Go runtime a soft memory limit above it, so that the garbage of tables
// the index replaced is collected before it doubles the resident set:
// 1.25 times the budget plus memoryHeadroom for requests in flight
// (bounded by --max-inflight-requests) and the event queues, minus what
// libzmq allocates outside the Go heap.

// DefaultIndexMemory is --index-memory's default.
const DefaultIndexMemory = 2 << 30

// memoryHeadroom is what the Go memory limit allows beyond 1.25 times
// the index budget; the resident set stays within 1.25 times the budget
// plus 200 MiB, the rest left to libzmq and the binary.
const memoryHeadroom = 128 << 20

// sizeFlag is a flag holding a size in bytes, written with a unit.
type sizeFlag int64

func (s *sizeFlag) String() string { return formatSize(int64(*s)) }

func (s *sizeFlag) Set(v string) error {
	n, err := parseSize(v)
	if err != nil {
		return err
	}
	*s = sizeFlag(n)
	return nil
}

var sizeUnits = []struct {
	suffix string
	mult   int64
}{
	// Longest first, so that "KiB" is not read as "B".
	{"KIB", 1 << 10}, {"MIB", 1 << 20}, {"GIB", 1 << 30}, {"TIB", 1 << 40},
	{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
	{"B", 1},
}

// parseSize parses a size in bytes: a number, optionally with a
// fraction, and a unit, binary (KiB, MiB, GiB, TiB) or decimal (KB, MB,
// GB, TB) or B, in any case; no unit means bytes.
func parseSize(v string) (int64, error) {
	s := strings.TrimSpace(v)
	mult := int64(1)
	up := strings.ToUpper(s)
	for _, u := range sizeUnits {
		if strings.HasSuffix(up, u.suffix) {
			s, mult = strings.TrimSpace(s[:len(s)-len(u.suffix)]), u.mult
			break
		}
	}
	if s == "" || strings.ContainsAny(s, "eExXpP_+-") {
		return 0, fmt.Errorf("invalid size %q: want a number and a unit such as 512MiB or 2GiB", v)
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
		return 0, fmt.Errorf("invalid size %q: want a number and a unit such as 512MiB or 2GiB", v)
	}
	b := f * float64(mult)
	if b >= math.MaxInt64 {
		return 0, fmt.Errorf("invalid size %q: too large", v)
	}
	return int64(b), nil
}

// formatSize writes n with the largest binary unit that divides it.
func formatSize(n int64) string {
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n != 0 && n%u.mult == 0 {
			return strconv.FormatInt(n/u.mult, 10) + u.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}

// MemoryConfig is the part of Config that sets memory budgets.
type MemoryConfig struct {
	// IndexMemory bounds the index in bytes; zero leaves the index's
	// holding budget (index.DefaultMaxHolderBlocks) and no memory limit.
	IndexMemory int64
	// shareThresholdSet records --index-share-threshold, which no longer
	// does anything: the index keeps every block once (issue 30). It is
	// still accepted, with a warning, so that command lines keep working.
	shareThresholdSet bool
	// EventsMaxMessage bounds one event message in bytes
	// (events.Config.MaxMessageSize): libzmq drops the connection of a
	// peer sending more.
	EventsMaxMessage int64
	// EventsQueueMemory bounds the bytes queued for each event worker
	// (events.Config.QueueBytes).
	EventsQueueMemory int64
	// KeptPullsMemory bounds the pull decisions kept for POST /v1/done
	// (about 300 bytes and the request id each); zero:
	// DefaultKeptPullsMemory.
	KeptPullsMemory int64
}

const (
	// DefaultEventsMaxMessage is --events-max-message's default: a
	// batch storing a prompt of a million tokens, token ids included, is
	// about 5 MB of msgpack.
	DefaultEventsMaxMessage = 16 << 20
	// DefaultEventsQueueMemory is --events-queue-memory's default,
	// NATS's bound on a connection's pending bytes.
	DefaultEventsQueueMemory = 64 << 20
	// DefaultKeptPullsMemory is --kept-pulls-memory's default: some
	// 300,000 pulls in flight.
	DefaultKeptPullsMemory = 64 << 20
)

func (c *MemoryConfig) flags(fs *flag.FlagSet) {
	c.IndexMemory = DefaultIndexMemory
	c.EventsMaxMessage = DefaultEventsMaxMessage
	c.EventsQueueMemory = DefaultEventsQueueMemory
	c.KeptPullsMemory = DefaultKeptPullsMemory
	fs.Var((*sizeFlag)(&c.IndexMemory), "index-memory", "bound of the index in bytes (e.g. 512MiB, 2GiB), oldest holdings evicted past it; also sets the Go memory limit to 1.25x it plus 128MiB unless GOMEMLIMIT is set (0: a budget of 64Mi holdings, no limit)")
	fs.Func("index-share-threshold", "deprecated, no effect: the index keeps every block once, its holders as a set", func(string) error {
		c.shareThresholdSet = true
		return nil
	})
	fs.Var((*sizeFlag)(&c.EventsMaxMessage), "events-max-message", "largest event message accepted; a peer sending a larger one is disconnected")
	fs.Var((*sizeFlag)(&c.EventsQueueMemory), "events-queue-memory", "bytes of event messages queued per worker; past it messages are dropped and their pods resynced by replay")
	fs.Var((*sizeFlag)(&c.KeptPullsMemory), "kept-pulls-memory", "bytes of pull decisions kept for POST /v1/done (about 300 bytes and the request id each); past it a pull is answered but released only by --inflight-ttl")
}

func (c *MemoryConfig) check() error {
	for _, f := range []struct {
		name string
		v    int64
	}{{"--index-memory", c.IndexMemory}, {"--events-max-message", c.EventsMaxMessage}, {"--events-queue-memory", c.EventsQueueMemory}, {"--kept-pulls-memory", c.KeptPullsMemory}} {
		if f.v < 0 {
			return fmt.Errorf("%s must not be negative, got %d", f.name, f.v)
		}
	}
	if c.EventsMaxMessage <= 0 || c.EventsQueueMemory < c.EventsMaxMessage {
		return fmt.Errorf("--events-queue-memory (%s) must be at least --events-max-message (%s), which must be positive",
			formatSize(c.EventsQueueMemory), formatSize(c.EventsMaxMessage))
	}
	return nil
}

// indexConfig is the configuration of the service's index.
func indexConfig(cfg Config, log *slog.Logger) index.Config {
	if cfg.shareThresholdSet {
		log.Warn("--index-share-threshold is deprecated and has no effect: the index keeps every block once")
	}
	return index.Config{Logger: log, MemoryBytes: cfg.IndexMemory}
}

// memoryLimit is the Go memory limit for an index budget of
// indexMemory bytes.
func memoryLimit(indexMemory int64) int64 {
	return indexMemory + indexMemory/4 + memoryHeadroom
}

// ApplyMemoryLimit sets the Go runtime's memory limit for the index
// budget, unless there is none or GOMEMLIMIT sets the limit already, and
// returns the limit in effect (math.MaxInt64 for none).
func ApplyMemoryLimit(indexMemory int64, log *slog.Logger) int64 {
	if indexMemory == 0 || os.Getenv("GOMEMLIMIT") != "" {
		return debug.SetMemoryLimit(-1)
	}
	limit := memoryLimit(indexMemory)
	debug.SetMemoryLimit(limit)
	log.Info("kvsource serve: Go memory limit set for the index budget", "index_memory", formatSize(indexMemory), "memory_limit_bytes", limit)
	return limit
}

func (s *Service) initMemoryMetrics() {
	budget := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvsource_index_budget_holdings",
		Help: "Most (block, tier) holdings the index keeps, from --index-memory; past it the oldest are evicted."})
	budget.Set(float64(s.idx.Budget()))
	memory := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvsource_index_memory_budget_bytes",
		Help: "--index-memory: the index's bound in bytes, 0 for a holding budget only."})
	memory.Set(float64(s.cfg.IndexMemory))
	s.reg.MustRegister(budget, memory, s.pulls.held, s.pulls.notKept)
}
