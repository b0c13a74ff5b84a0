package service

import (
	"io"
	"reflect"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// TestServeExportsEveryEventsCounter gives each events.Stats field its own
// value and requires a metric reporting it, so that a counter added to the
// subscriber is not left out of /metrics.
func TestServeExportsEveryEventsCounter(t *testing.T) {
	t.Parallel()
	typ := reflect.TypeFor[events.Stats]()
	for i := range typ.NumField() {
		f := typ.Field(i)
		t.Run(f.Name, func(t *testing.T) {
			var st events.Stats
			reflect.ValueOf(&st).Elem().Field(i).SetUint(1000 + uint64(i))
			var names []string
			for _, d := range statDescs {
				if d.value(st, index.Stats{}) == float64(1000+i) {
					names = append(names, d.desc.String())
				}
			}
			require.Len(t, names, 1, "metrics reporting events.Stats.%s", f.Name)
		})
	}
}

// TestServeExportsEveryHashCacheStat does the same for hashing.CacheStats.
func TestServeExportsEveryHashCacheStat(t *testing.T) {
	t.Parallel()
	typ := reflect.TypeFor[hashing.CacheStats]()
	for i := range typ.NumField() {
		f := typ.Field(i)
		t.Run(f.Name, func(t *testing.T) {
			var st hashing.CacheStats
			reflect.ValueOf(&st).Elem().Field(i).SetInt(1000 + int64(i))
			var names []string
			for _, d := range hashCacheDescs {
				if d.value(st) == float64(1000+i) {
					names = append(names, d.desc.String())
				}
			}
			require.Len(t, names, 1, "metrics reporting hashing.CacheStats.%s", f.Name)
		})
	}
}

func TestServeHashCacheIsOnByDefaultCountsHitsAndTurnsOffWithZero(t *testing.T) {
	tokens := make([]uint32, 64*16)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	s, base := startServe(t)
	require.NotNil(t, s.hashCache)
	for _, n := range []int{48 * 16, 64 * 16} { // a first turn, then its next
		code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": tokens[:n]})
		require.Equal(t, 200, code, "%s", body)
	}
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Equal(t, "48", metricValue(metrics, "kvsource_hash_cache_hit_blocks_total"))
	require.Equal(t, "64", metricValue(metrics, "kvsource_hash_cache_miss_blocks_total"))
	require.Equal(t, "0.42857142857142855", metricValue(metrics, "kvsource_hash_cache_hit_ratio"))
	require.Equal(t, "2", metricValue(metrics, "kvsource_hash_cache_chains"))

	s, base = startServe(t, "--hash-cache-bytes", "0")
	require.Nil(t, s.hashCache)
	code, body := call(t, "POST", base+"/v1/score", map[string]any{"model": "m", "tokens": tokens})
	require.Equal(t, 200, code, "%s", body)
	_, metrics = call(t, "GET", base+"/metrics", nil)
	require.NotContains(t, string(metrics), "kvsource_hash_cache")

	_, err := parseFlags([]string{"--hash-cache-bytes", "-1"}, io.Discard)
	require.ErrorContains(t, err, "flag -hash-cache-bytes")
	// Sizes take units, as --index-memory's do.
	cfg, err := parseFlags([]string{"--hash-cache-bytes", "16MiB"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, int64(16<<20), cfg.HashCacheBytes)
	cfg, err = parseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Equal(t, int64(hashing.DefaultCacheBytes), cfg.HashCacheBytes)
}

// metricValue returns the value of the unlabelled metric name in a
// /metrics page, "" when absent.
func metricValue(metrics []byte, name string) string {
	for line := range strings.SplitSeq(string(metrics), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			return v
		}
	}
	return ""
}
