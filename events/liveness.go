package events

import (
	"log/slog"
	"time"

	"github.com/kvsource/kvsource/index"
)

// A holder's states, as HolderStatus.State and Processor.Source report
// them. Only a live holder is a pull source; every holder scores.
const (
	// StateLive: heard from since the processor started, its entries
	// follow its engine's events and its connection is up.
	StateLive = "live"
	// StateStale: its entries may include blocks the engine no longer
	// has (GapKeep after an unrecovered gap, a dropped message not yet
	// resolved), or it is known only from a snapshot and not heard from
	// since the processor started.
	StateStale = "stale"
	// StateDisconnected: its transport reported its connection down.
	StateDisconnected = "disconnected"
	// StateConflict: two interleaved sequence streams arrive under its
	// name (see Config.ConflictWindow); its entries are cleared and its
	// messages dropped until they stop.
	StateConflict = "conflict"
)

// Source reports whether holder h may serve a pull now, and its state: a
// holder is a source only while it is live, that is heard from since the
// processor started (a snapshot alone lets it score, never serve), its
// connection up, its entries trusted and its stream not in conflict. A
// holder the processor does not know is StateStale: the index may hold it
// from a snapshot. picker.Config.Sources takes this method.
func (p *Processor) Source(h index.Holder) (state string, ok bool) {
	v, known := p.holders.Load(h)
	if !known {
		return StateStale, false
	}
	st := p.state(v.(*holder))
	return st, st == StateLive
}

func (p *Processor) state(h *holder) string {
	switch {
	case h.conflict.Load():
		return StateConflict
	case p.isDown(h.id.Pod):
		return StateDisconnected
	case h.stale.Load() || !h.heard.Load():
		return StateStale
	}
	return StateLive
}

func (p *Processor) isDown(pod string) bool {
	if p.nDown.Load() == 0 {
		return false
	}
	_, down := p.down.Load(pod)
	return down
}

// PodConnected is the transport's report that pod's connection went up or
// down (a ZMQ socket monitor's connect and disconnect events, a JetStream
// consumer's liveness). A pod it never reported down counts as connected:
// a transport that cannot tell leaves it so. The holders of a pod that is
// down are StateDisconnected and no pull source; their entries stay, and
// score, until the pod publishes again or is evicted. Safe for concurrent
// use; a transport reports only pods it tracks (the processor keeps at
// most twice Config.MaxHolders pods down).
func (p *Processor) PodConnected(pod string, up bool) {
	if up {
		if _, was := p.down.LoadAndDelete(pod); was {
			p.nDown.Add(-1)
			p.limited.logf(slog.LevelInfo, "events: pod connected again", pod)
		}
		return
	}
	if p.nDown.Load() >= 2*int64(p.cfg.MaxHolders) {
		p.limited.logAny(slog.LevelWarn, "events: too many pods down to track another; it stays listed as connected", pod)
		return
	}
	if _, was := p.down.LoadOrStore(pod, struct{}{}); !was {
		p.nDown.Add(1)
		p.c[cDisconnects].Add(1)
		p.limited.logf(slog.LevelWarn, "events: pod disconnected; its holders are no pull source until it reconnects", pod)
	}
}

// SenderMismatch counts, in Stats.Messages and Stats.SenderMismatch, a
// message its transport refused because its sender may not publish for
// the pod it names, and logs it rate-limited (across pods: the names are
// the sender's choice).
func (p *Processor) SenderMismatch(pod, sender string, seq uint64) {
	p.c[cMessages].Add(1)
	p.c[cSenderMismatch].Add(1)
	p.limited.logAny(slog.LevelWarn, "events: dropped message from a sender that may not publish for its pod", logName(pod),
		"sender", sender, "seq", seq, "fix", p.cfg.SenderCheckHint)
	p.recordRefusal(pod, sender)
}

// recordRefusal keeps pod's latest refusal for WaitApplied and wakes its
// waiters; past maxRefusedPods pods only those already kept are updated.
func (p *Processor) recordRefusal(pod, sender string) {
	r := refusal{n: p.refusals.Add(1), sender: sender}
	if _, loaded := p.refused.Swap(pod, r); !loaded && p.nRefused.Add(1) > maxRefusedPods {
		p.refused.Delete(pod)
		p.nRefused.Add(-1)
	}
	p.applied.Broadcast()
}

// logName bounds a peer's name for a log line.
func logName(pod string) string {
	const max = 64
	if len(pod) > max {
		return pod[:max] + "..."
	}
	return pod
}

// evict makes room for one holder at Config.MaxHolders: it picks the
// least recently heard holder, those not live first, forgets it and has
// its worker clear its entries. It reports whether it found one.
func (p *Processor) evict() bool {
	p.evictMu.Lock()
	defer p.evictMu.Unlock()
	var victim *holder
	var victimLive bool
	var victimAt int64
	p.holders.Range(func(_, v any) bool {
		h := v.(*holder)
		live := p.state(h) == StateLive
		at := h.heardAt.Load()
		if victim == nil || (victimLive && !live) || (live == victimLive && at < victimAt) {
			victim, victimLive, victimAt = h, live, at
		}
		return true
	})
	if victim == nil || !victim.evicted.CompareAndSwap(false, true) {
		return false
	}
	p.holders.Delete(victim.id)
	p.c[cEvicted].Add(1)
	p.limited.logAny(slog.LevelWarn, "events: holder limit reached, forgetting the least recently heard holder", victim.id.Pod,
		"rank", victim.id.Rank, "state", p.state(victim), "heard", time.Since(time.Unix(0, victimAt)).Round(time.Millisecond),
		"max_holders", p.cfg.MaxHolders)
	p.workerOf(victim.id.Pod).post(chore{evict: victim})
	return true
}

func (p *Processor) workerOf(pod string) *worker {
	return p.workers[podHash(pod)%uint32(len(p.workers))]
}

// expireSnapshot has each worker remove the InitialSeqs holders it has not
// heard from.
func (p *Processor) expireSnapshot() {
	for _, w := range p.workers {
		w.post(chore{expire: true})
	}
}
