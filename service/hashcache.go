package service

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/hashing"
)

// hashCacheCollector exports the hash cache's counters as they are at
// scrape time; with the cache off (--hash-cache-bytes 0) it exports
// nothing.
type hashCacheCollector struct{ c *hashing.Cache }

type hashCacheDesc struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(hashing.CacheStats) float64
}

var hashCacheDescs = []hashCacheDesc{
	{prometheus.NewDesc("kvsource_hash_cache_requests_total", "Prompts of at least one full block hashed through the hash cache.", nil, nil),
		prometheus.CounterValue, func(s hashing.CacheStats) float64 { return float64(s.Requests) }},
	{prometheus.NewDesc("kvsource_hash_cache_hit_blocks_total", "Blocks whose keys came from the hash cache.", nil, nil),
		prometheus.CounterValue, func(s hashing.CacheStats) float64 { return float64(s.HitBlocks) }},
	{prometheus.NewDesc("kvsource_hash_cache_miss_blocks_total", "Blocks the hash cache did not have, hashed.", nil, nil),
		prometheus.CounterValue, func(s hashing.CacheStats) float64 { return float64(s.MissBlocks) }},
	{prometheus.NewDesc("kvsource_hash_cache_evictions_total", "Remembered prompts dropped to stay within --hash-cache-bytes.", nil, nil),
		prometheus.CounterValue, func(s hashing.CacheStats) float64 { return float64(s.Evictions) }},
	{prometheus.NewDesc("kvsource_hash_cache_bytes", "Estimated memory of the remembered prompts.", nil, nil),
		prometheus.GaugeValue, func(s hashing.CacheStats) float64 { return float64(s.Bytes) }},
	{prometheus.NewDesc("kvsource_hash_cache_chains", "Remembered prompts.", nil, nil),
		prometheus.GaugeValue, func(s hashing.CacheStats) float64 { return float64(s.Chains) }},
	{prometheus.NewDesc("kvsource_hash_cache_hit_ratio", "Hit blocks over hit and miss blocks since start-up (0 before any); rate() the two counters for a recent ratio.", nil, nil),
		prometheus.GaugeValue, func(s hashing.CacheStats) float64 {
			if n := s.HitBlocks + s.MissBlocks; n > 0 {
				return float64(s.HitBlocks) / float64(n)
			}
			return 0
		}},
}

func (c hashCacheCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range hashCacheDescs {
		ch <- d.desc
	}
}

func (c hashCacheCollector) Collect(ch chan<- prometheus.Metric) {
	if c.c == nil {
		return
	}
	st := c.c.Stats()
	for _, d := range hashCacheDescs {
		ch <- prometheus.MustNewConstMetric(d.desc, d.kind, d.value(st))
	}
}
