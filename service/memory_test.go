package service

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
)

func TestServeParsesSizesWithUnits(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"2GiB", 2 << 30}, {"512MiB", 512 << 20}, {"64kib", 64 << 10}, {"1TiB", 1 << 40},
		{"1.5GiB", 3 << 29}, {"2GB", 2e9}, {"10MB", 10e6}, {"3kb", 3000}, {"1TB", 1e12},
		{"4096", 4096}, {"100B", 100}, {" 8 MiB ", 8 << 20}, {"0", 0},
	} {
		got, err := parseSize(tc.in)
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.want, got, tc.in)
	}
	for _, bad := range []string{"", "GiB", "-1GiB", "2 gigs", "1e9", "0x10", "+5MB", "1_000", "NaN", "Inf", "9999999TiB", "2GiBB"} {
		_, err := parseSize(bad)
		require.Error(t, err, "%q", bad)
	}
	for _, n := range []int64{0, 1, 1023, 1 << 10, 3 << 20, 2 << 30, 5 << 40} {
		got, err := parseSize(formatSize(n))
		require.NoError(t, err)
		require.Equal(t, n, got, formatSize(n))
	}
}

// FuzzParseSize: every input parses to a non-negative size or fails,
// never panics, and a size formatted parses back to itself.
func FuzzParseSize(f *testing.F) {
	for _, seed := range []string{"2GiB", "1.5MB", "0", "12", "7kib", "1e3", "-1", "9223372036854775807", "1.0000000001TiB"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := parseSize(s)
		if err != nil {
			return
		}
		require.GreaterOrEqual(t, n, int64(0))
		back, err := parseSize(formatSize(n))
		require.NoError(t, err)
		require.Equal(t, n, back)
	})
}

func TestServeIndexMemoryFlagSetsTheIndexBudget(t *testing.T) {
	cfg, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Equal(t, int64(2<<30), cfg.IndexMemory)
	require.Equal(t, MemoryConfig{IndexMemory: 2 << 30, EventsMaxMessage: 16 << 20, EventsQueueMemory: 64 << 20, KeptPullsMemory: 64 << 20}, cfg.MemoryConfig)
	cfg, err = parseFlags([]string{"--events-max-message", "1MiB", "--events-queue-memory", "8MiB"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, MemoryConfig{IndexMemory: 2 << 30, EventsMaxMessage: 1 << 20, EventsQueueMemory: 8 << 20, KeptPullsMemory: 64 << 20}, cfg.MemoryConfig)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--index-memory", "lots"}, `invalid size "lots"`},
		{[]string{"--events-max-message", "0"}, "--events-max-message (0), which must be positive"},
		{[]string{"--events-max-message", "128MiB"}, "--events-queue-memory (64MiB) must be at least --events-max-message (128MiB)"},
	} {
		_, err = parseFlags(tc.args, io.Discard)
		require.ErrorContains(t, err, tc.want, "%v", tc.args)
	}

	s, _ := startServe(t, "--index-memory", "40MiB")
	require.Equal(t, int64(40<<20/index.HolderBlockBytes), s.idx.Budget())
	require.Equal(t, float64(40<<20/index.HolderBlockBytes), counterValue(s, "kvsource_index_budget_holdings"))
	require.Equal(t, float64(40<<20), counterValue(s, "kvsource_index_memory_budget_bytes"))
	s, _ = startServe(t, "--index-memory", "0")
	require.Equal(t, int64(index.DefaultMaxHolderBlocks), s.idx.Budget())
	require.Equal(t, int64(1<<30+1<<28+memoryHeadroom), memoryLimit(1<<30))
}

// processRSS returns this process's resident set in bytes.
func processRSS(tb testing.TB) int64 {
	data, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		tb.Skip("no /proc/self/statm")
	}
	f := strings.Fields(string(data))
	pages, err := strconv.ParseInt(f[1], 10, 64)
	require.NoError(tb, err)
	return pages * int64(os.Getpagesize())
}

// BenchmarkIndexMemoryBudget is the memory-budget soak: an index configured
// as kvsource serve configures it for --index-memory (default 1GiB here,
// KVSOURCE_SOAK_INDEX_MEMORY to change it), with the Go memory limit serve
// sets, filled by 64 holders with chains of up to 2,048 blocks until three
// budgets' worth of holdings have been stored, so that eviction has
// replaced the whole index twice. It reports the peak resident set sampled
// along the way and fails past 1.25 times the budget plus 200 MiB.
func BenchmarkIndexMemoryBudget(b *testing.B) {
	budget := int64(1 << 30)
	if v := os.Getenv("KVSOURCE_SOAK_INDEX_MEMORY"); v != "" {
		var err error
		budget, err = parseSize(v)
		require.NoError(b, err)
	}
	cfg, err := parseFlags([]string{"--index-memory", formatSize(budget)}, io.Discard)
	require.NoError(b, err)
	log := discardLogger()
	for b.Loop() {
		prev := debug.SetMemoryLimit(-1)
		ApplyMemoryLimit(cfg.IndexMemory, log)
		runtime.GC()
		base := processRSS(b)
		ix := index.New(indexConfig(cfg, log))
		rng := rand.New(rand.NewPCG(7, 8))
		keys := make([]uint64, 2048)
		var stored, peak int64
		start := time.Now()
		for stored < 3*ix.Budget() {
			h := index.Holder{Pod: fmt.Sprintf("10.2.0.%d:8000", rng.IntN(64))}
			n := 1 + rng.IntN(len(keys))
			for i := range n {
				keys[i] = rng.Uint64()
			}
			tier := index.TierGPU
			if rng.IntN(4) == 0 {
				tier = index.TierCPU
			}
			ix.Store(index.Blocks{Model: "m", Holder: h, Tier: tier, Keys: keys[:n]})
			stored += int64(n)
			if stored%64 < 2 {
				peak = max(peak, processRSS(b))
			}
		}
		peak = max(peak, processRSS(b))
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		st := ix.Stats()
		b.ReportMetric(float64(ms.HeapAlloc)/float64(st.HolderBlocks), "heap-bytes/holding")
		require.LessOrEqual(b, st.HolderBlocks, ix.Budget())
		require.NotZero(b, st.EvictedBudget)
		bound := budget + budget/4 + 200<<20
		b.ReportMetric(float64(peak)/(1<<20), "peak-rss-MiB")
		b.ReportMetric(float64(base)/(1<<20), "base-rss-MiB")
		b.ReportMetric(float64(peak)/float64(budget), "peak-rss/budget")
		b.ReportMetric(float64(st.HolderBlocks), "holdings")
		b.ReportMetric(time.Since(start).Seconds(), "fill-s")
		runtime.KeepAlive(ix)
		debug.SetMemoryLimit(prev)
		if peak > bound {
			b.Fatalf("peak RSS %d MiB over 1.25 x %d MiB + 200 MiB = %d MiB", peak>>20, budget>>20, bound>>20)
		}
	}
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// --index-share-threshold did something before the block-major index:
// command lines that pass it still start, and are told it does nothing.
func TestTheRetiredIndexShareThresholdIsAcceptedWithAWarning(t *testing.T) {
	cfg, err := parseFlags([]string{"--index-share-threshold", "64"}, io.Discard)
	require.NoError(t, err)
	var buf bytes.Buffer
	indexConfig(cfg, slog.New(slog.NewTextHandler(&buf, nil)))
	require.Contains(t, buf.String(), "--index-share-threshold is deprecated and has no effect")

	cfg, err = parseFlags(nil, io.Discard)
	require.NoError(t, err)
	buf.Reset()
	indexConfig(cfg, slog.New(slog.NewTextHandler(&buf, nil)))
	require.Empty(t, buf.String())
}
