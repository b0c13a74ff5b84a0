package main

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/index"
)

func (s *serveService) initMetrics() {
	s.reg = prometheus.NewRegistry()
	s.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvsource_http_requests_total", Help: "HTTP answers written, by path and status code; kvsource_http_aborted_total counts those that could not be.",
	}, []string{"path", "code"})
	s.decisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvsource_pick_decisions_total", Help: "Pick decisions by reason.",
	}, []string{"reason"})
	s.pulled = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvsource_pick_pulled_blocks_total", Help: "Blocks that pick decisions told destinations to pull.",
	})
	s.reg.MustRegister(s.requests, s.decisions, s.pulled, &serveStatsCollector{s: s}, serveHashCacheCollector{s.hashCache},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
}

// serveStatsCollector exports the subscriber's and the index's counters as they
// are at scrape time.
type serveStatsCollector struct{ s *serveService }

type serveStatDesc struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(events.Stats, index.Stats) float64
}

func serveCounter(name, help string, f func(events.Stats, index.Stats) float64) serveStatDesc {
	return serveStatDesc{prometheus.NewDesc(name, help, nil, nil), prometheus.CounterValue, f}
}

func serveGauge(name, help string, f func(events.Stats, index.Stats) float64) serveStatDesc {
	return serveStatDesc{prometheus.NewDesc(name, help, nil, nil), prometheus.GaugeValue, f}
}

// serveStatDescs are the subscriber's counters, rendered from
// events.Counters, and the index's.
var serveStatDescs = append(serveEventDescs(), []serveStatDesc{
	serveGauge("kvsource_index_models", "Models with at least one holder.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Models) }),
	serveGauge("kvsource_index_holders", "(model, holder) pairs in the index.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Holders) }),
	serveGauge("kvsource_index_holdings", "(block, tier) holdings in the index.", func(_ events.Stats, i index.Stats) float64 { return float64(i.HolderBlocks) }),
	serveCounter("kvsource_index_stored_blocks_total", "Blocks stored.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Stored) }),
	serveCounter("kvsource_index_removed_blocks_total", "Holdings removed.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Removed) }),
	serveCounter("kvsource_index_cleared_blocks_total", "Holdings cleared with their holder.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Cleared) }),
	serveCounter("kvsource_index_evicted_capacity_total", "Holdings evicted past a holder's capacity.", func(_ events.Stats, i index.Stats) float64 { return float64(i.EvictedCapacity) }),
	serveCounter("kvsource_index_evicted_budget_total", "Holdings evicted past the index's budget.", func(_ events.Stats, i index.Stats) float64 { return float64(i.EvictedBudget) }),
	serveCounter("kvsource_index_rejected_tier_total", "Stores dropped for an empty tier or too many tiers.", func(_ events.Stats, i index.Stats) float64 { return float64(i.RejectedTier) }),
}...)

func serveEventDescs() []serveStatDesc {
	var out []serveStatDesc
	for _, c := range events.Counters {
		out = append(out, serveCounter("kvsource_events_"+c.Name+"_total", c.Help,
			func(e events.Stats, _ index.Stats) float64 { return float64(*c.Stat(&e)) }))
	}
	return out
}

var serveHolderStateDesc = prometheus.NewDesc("kvsource_holders", "Holders by event-stream state (live or stale).", []string{"state"}, nil)

func (c *serveStatsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range serveStatDescs {
		ch <- d.desc
	}
	ch <- serveHolderStateDesc
}

func (c *serveStatsCollector) Collect(ch chan<- prometheus.Metric) {
	es, is := c.s.sub.Stats(), c.s.idx.Stats()
	for _, d := range serveStatDescs {
		ch <- prometheus.MustNewConstMetric(d.desc, d.kind, d.value(es, is))
	}
	states := map[string]int{"live": 0, "stale": 0}
	list := c.s.idx.HolderList()
	status := c.s.sub.Status()
	for _, st := range status {
		states[st.State]++
	}
	// Holders a snapshot brought in count as stale until their pod publishes.
	states["stale"] += len(serveUnseen(list, status))
	for state, n := range states {
		ch <- prometheus.MustNewConstMetric(serveHolderStateDesc, prometheus.GaugeValue, float64(n), state)
	}
}
