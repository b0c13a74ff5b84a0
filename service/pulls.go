package service

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/puzpuzpuz/xsync/v4"

	"github.com/kvsource/kvsource/internal/ratelog"
	"github.com/kvsource/kvsource/picker"
)

// keptPulls holds each pull decision by request id until POST /v1/done
// releases it or --inflight-ttl passes. It keeps only what releasing needs,
// not the decision's missing keys (512 KiB for a pull of a million tokens,
// which the picker allocates apart from the pull's claim so that clearing
// them frees them), and at most --kept-pulls-memory bytes of them: a
// pull past that is answered all the same, counted, and released by the
// picker's own TTL instead of by /v1/done.
type keptPulls struct {
	m      *xsync.Map[string, *keptPull]
	bytes  atomic.Int64
	budget int64
	ttl    time.Duration

	held    prometheus.GaugeFunc
	notKept prometheus.Counter
	log     *slog.Logger
	logGate ratelog.Gate
}

type keptPull struct {
	d  picker.Decision // Missing cleared
	at time.Time
}

// keptPullOverhead is what one kept pull costs beside its id: the entry, its
// map slot, the decision and the decision's claim on its source, which the
// picker allocates apart from the missing keys (48 bytes) so that clearing
// Missing frees them.
const keptPullOverhead = int64(unsafe.Sizeof(keptPull{})) + 64 + 48

func keptPullBytes(id string) int64 { return keptPullOverhead + int64(len(id)) }

func newKeptPulls(budget int64, ttl time.Duration, log *slog.Logger) *keptPulls {
	k := &keptPulls{m: xsync.NewMap[string, *keptPull](), budget: budget, ttl: ttl, log: log}
	k.held = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsource_kept_pulls_bytes",
		Help: "Bytes of the pull decisions kept for POST /v1/done, bounded by --kept-pulls-memory."},
		func() float64 { return float64(k.bytes.Load()) })
	k.notKept = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsource_kept_pulls_dropped_total",
		Help: "Pulls not kept for POST /v1/done because --kept-pulls-memory was full; they count against their source until --inflight-ttl."})
	return k
}

// keep keeps d under id, releasing a pull kept under id before, and reports
// whether it did.
func (k *keptPulls) keep(id string, d picker.Decision, now time.Time) bool {
	cost := keptPullBytes(id)
	if k.bytes.Add(cost) > k.budget {
		k.bytes.Add(-cost)
		k.notKept.Inc()
		if skipped, ok := k.logGate.Allow(time.Second); ok {
			k.log.Warn("kvsource serve: pull not kept for /v1/done: --kept-pulls-memory is full; it counts against its source until --inflight-ttl",
				"kept_bytes", k.bytes.Load(), "left_out", skipped)
		}
		return false
	}
	d.Missing = nil
	if old, loaded := k.m.LoadAndStore(id, &keptPull{d: d, at: now}); loaded {
		k.bytes.Add(-cost)
		old.d.Done()
	}
	return true
}

// release releases the pull kept under id, reporting whether there was one.
func (k *keptPulls) release(id string) bool {
	p, ok := k.m.LoadAndDelete(id)
	if ok {
		k.bytes.Add(-keptPullBytes(id))
		p.d.Done()
	}
	return ok
}

// forgetExpired drops, every half TTL until ctx is done, the pulls kept
// longer than the TTL: the picker no longer counts them either.
func (k *keptPulls) forgetExpired(ctx context.Context) {
	// A TTL of a nanosecond is valid; a ticker of zero would panic.
	t := time.NewTicker(max(k.ttl/2, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			for id, p := range k.m.All() {
				if now.Sub(p.at) <= k.ttl {
					continue
				}
				k.m.Compute(id, func(cur *keptPull, loaded bool) (*keptPull, xsync.ComputeOp) {
					if loaded && cur == p {
						k.bytes.Add(-keptPullBytes(id))
						return nil, xsync.DeleteOp
					}
					return cur, xsync.CancelOp
				})
			}
		}
	}
}
