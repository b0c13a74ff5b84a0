package service

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/index"
)

func (s *Service) initMetrics() {
	s.reg = s.cfg.Registry
	if s.reg == nil {
		// A registry of its own also exports the process: an injected one
		// belongs to a program that decides that for itself.
		s.reg = prometheus.NewRegistry()
		s.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	s.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvsource_http_requests_total", Help: "HTTP answers written, by path and status code; kvsource_http_aborted_total counts those that could not be.",
	}, []string{"path", "code"})
	s.decisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvsource_pick_decisions_total", Help: "Pick decisions by reason.",
	}, []string{"reason"})
	s.pulled = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvsource_pick_pulled_blocks_total", Help: "Blocks that pick decisions told destinations to pull.",
	})
	s.reg.MustRegister(s.requests, s.decisions, s.pulled, &statsCollector{s: s}, hashCacheCollector{s.hashCache})
	if sp := s.spec; sp != nil {
		s.reg.MustRegister(
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsource_speculative_recorded_total", Help: "Picks whose prompt was recorded on the destination as speculative blocks."},
				func() float64 { return float64(sp.Stats().Recorded) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsource_speculative_expired_total", Help: "Speculative entries removed for --speculative-ttl or --speculative-memory."},
				func() float64 { return float64(sp.Stats().Expired) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsource_speculative_refused_total", Help: "Picks whose prompt was not recorded as speculative blocks: a destination past --speculative-holders, or a prompt larger than --speculative-memory."},
				func() float64 { return float64(sp.Stats().Refused) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsource_speculative_replaced_total", Help: "Engine stores that met a holder's guessed blocks, and evictions that took guesses out."},
				func() float64 { return float64(sp.Stats().Replaced) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsource_speculative_holders", Help: "Pick destinations no engine has reported from that speculative blocks are kept for, bounded by --speculative-holders."},
				func() float64 { return float64(sp.Stats().Holders) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsource_speculative_bytes", Help: "Bytes of the speculative entries kept, bounded by --speculative-memory."},
				func() float64 { return float64(sp.Stats().Bytes) }),
		)
	}
}

// statsCollector exports the subscriber's and the index's counters as they
// are at scrape time.
type statsCollector struct{ s *Service }

type statDesc struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(events.Stats, index.Stats) float64
}

func counter(name, help string, f func(events.Stats, index.Stats) float64) statDesc {
	return statDesc{prometheus.NewDesc(name, help, nil, nil), prometheus.CounterValue, f}
}

func gauge(name, help string, f func(events.Stats, index.Stats) float64) statDesc {
	return statDesc{prometheus.NewDesc(name, help, nil, nil), prometheus.GaugeValue, f}
}

// statDescs are the subscriber's counters, rendered from
// events.Counters, and the index's.
var statDescs = append(eventDescs(), []statDesc{
	gauge("kvsource_index_models", "Models with at least one holder.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Models) }),
	gauge("kvsource_index_holders", "(model, holder) pairs in the index.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Holders) }),
	gauge("kvsource_index_holdings", "(block, tier) holdings in the index.", func(_ events.Stats, i index.Stats) float64 { return float64(i.HolderBlocks) }),
	gauge("kvsource_index_shared_blocks", "Blocks two or more holders hold (the index keeps each block once, its holders as a set).", func(_ events.Stats, i index.Stats) float64 { return float64(i.SharedBlocks) }),
	counter("kvsource_index_stored_blocks_total", "Blocks stored.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Stored) }),
	counter("kvsource_index_removed_blocks_total", "Holdings removed.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Removed) }),
	counter("kvsource_index_cleared_blocks_total", "Holdings cleared with their holder.", func(_ events.Stats, i index.Stats) float64 { return float64(i.Cleared) }),
	counter("kvsource_index_evicted_capacity_total", "Holdings evicted past a holder's capacity.", func(_ events.Stats, i index.Stats) float64 { return float64(i.EvictedCapacity) }),
	counter("kvsource_index_evicted_budget_total", "Holdings evicted past the index's budget.", func(_ events.Stats, i index.Stats) float64 { return float64(i.EvictedBudget) }),
	counter("kvsource_index_rejected_tier_total", "Stores dropped for an empty tier or too many tiers.", func(_ events.Stats, i index.Stats) float64 { return float64(i.RejectedTier) }),
}...)

func eventDescs() []statDesc {
	var out []statDesc
	for _, c := range events.Counters {
		out = append(out, counter("kvsource_events_"+c.Name+"_total", c.Help,
			func(e events.Stats, _ index.Stats) float64 { return float64(*c.Stat(&e)) }))
	}
	return out
}

var holderStateDesc = prometheus.NewDesc("kvsource_holders", "Holders by event-stream state (live or stale).", []string{"state"}, nil)

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range statDescs {
		ch <- d.desc
	}
	ch <- holderStateDesc
}

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	es, is := c.s.sub.Stats(), c.s.idx.Stats()
	for _, d := range statDescs {
		ch <- prometheus.MustNewConstMetric(d.desc, d.kind, d.value(es, is))
	}
	states := map[string]int{"live": 0, "stale": 0}
	list := c.s.idx.HolderList()
	status := c.s.sub.Status()
	for _, st := range status {
		states[st.State]++
	}
	// Holders a snapshot brought in count as stale until their pod publishes.
	states["stale"] += len(unseen(list, status))
	for state, n := range states {
		ch <- prometheus.MustNewConstMetric(holderStateDesc, prometheus.GaugeValue, float64(n), state)
	}
}
