package events

import (
	"log/slog"
	"sync/atomic"
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
	// StateReconnected: its connection is up again after it went down,
	// and the holder has not applied a message since. A reconnect alone
	// cannot tell a network blip from a new engine process on the same
	// address, whose cache is empty: the holder's next message shows
	// which (its sequence continuing: live again; a restart: its entries
	// cleared first).
	StateReconnected = "reconnected"
	// StateConflict: two interleaved sequence streams arrive under its
	// name (see Config.ConflictWindow); its entries are cleared and its
	// messages dropped until they stop.
	StateConflict = "conflict"
)

// Source reports whether holder h may serve a pull now, and its state: a
// holder is a source only while it is live, that is heard from since the
// processor started (a snapshot alone lets it score, never serve), its
// connection up and a message applied since it last came up, its entries
// trusted and its stream not in conflict. A holder the processor does not
// know is StateStale: the index may hold it from a snapshot.
// picker.Config.Sources takes this method.
func (p *Processor) Source(h index.Holder) (state string, ok bool) {
	v, known := p.holders.Load(h)
	if !known {
		return StateStale, false
	}
	st := p.state(v.(*holder))
	return st, st == StateLive
}

func (p *Processor) state(h *holder) string {
	ps := h.ps.Load()
	switch {
	case h.conflict.Load():
		return StateConflict
	case ps != nil && ps.down.Load():
		return StateDisconnected
	case h.stale.Load() || !h.heard.Load():
		return StateStale
	case ps != nil && h.confirmed.Load() < ps.upAt.Load():
		return StateReconnected
	}
	return StateLive
}

// PodConnected is the transport's report that pod's connection went up or
// down (a ZMQ socket monitor's connect and disconnect events, a JetStream
// consumer's liveness). A pod it never reported down counts as connected:
// a transport that cannot tell leaves it so. The holders of a pod that is
// down are StateDisconnected and no pull source; their entries stay, and
// score, until the pod publishes again or is evicted. Once it is up again
// they are StateReconnected, no pull source either, each until it applies
// a message handed after the report. The report must come from the
// goroutine that hands the pod's messages, in the order the transport saw
// connection and messages. Only pods with holders or messages in flight
// are tracked (a report of any other pod has nothing to change), and a pod
// is forgotten with its last holder, so tracking stays exact however many
// pods came and went. Safe for concurrent use.
func (p *Processor) PodConnected(pod string, up bool) {
	ps, ok := p.pods.Load(pod)
	if !ok {
		return
	}
	if up {
		if ps.down.Swap(false) {
			ps.upAt.Store(p.epoch.Add(1))
			p.limited.logf(slog.LevelInfo, "events: pod connected again; its holders are no pull source until their next message "+
				"shows whether the engine restarted", pod)
		}
		return
	}
	if !ps.down.Swap(true) {
		p.c[cDisconnects].Add(1)
		p.limited.logf(slog.LevelWarn, "events: pod disconnected; its holders are no pull source until it reconnects and publishes", pod)
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
	r := &refusal{n: p.refusals.Add(1), sender: sender}
	if slot, ok := p.refused.LoadOrNew(pod, maxRefusedPods, newRefusalSlot); ok {
		slot.Store(r)
	}
	p.applied.Broadcast()
}

func newRefusalSlot() *atomic.Pointer[refusal] { return new(atomic.Pointer[refusal]) }

// logName bounds a peer's name for a log line.
func logName(pod string) string {
	const max = 64
	if len(pod) > max {
		return pod[:max] + "..."
	}
	return pod
}

// addSender counts a new holder of sender, and reports false, counting
// nothing, when sender has Config.MaxHoldersPerSender already.
func (p *Processor) addSender(sender string) bool {
	if sender == "" {
		return true
	}
	p.senderMu.Lock()
	defer p.senderMu.Unlock()
	if p.senders[sender] >= p.cfg.MaxHoldersPerSender {
		return false
	}
	p.senders[sender]++
	return true
}

// removeSender undoes addSender for a holder forgotten.
func (p *Processor) removeSender(sender string) {
	if sender == "" {
		return
	}
	p.senderMu.Lock()
	defer p.senderMu.Unlock()
	if p.senders[sender]--; p.senders[sender] <= 0 {
		delete(p.senders, sender)
	}
}

// evict makes room for one holder at Config.MaxHolders: it picks a holder
// of a sender over its share first, then one not live, then the least
// recently heard (see Config.MaxHolders), forgets it and has its worker
// clear its entries. It reports whether it found one.
func (p *Processor) evict() bool {
	p.evictMu.Lock()
	defer p.evictMu.Unlock()
	// Held while choosing, so that the shares are those of one moment;
	// only new holders and forgotten ones wait for it.
	p.senderMu.Lock()
	share := p.cfg.MaxHolders / max(1, len(p.senders))
	var victim *holder
	var victimOver, victimLive bool
	var victimAt int64
	p.holders.Range(func(_, v any) bool {
		h := v.(*holder)
		over := h.sender != "" && p.senders[h.sender] > share
		live := p.state(h) == StateLive
		at := h.heardAt.Load()
		better := victim == nil
		switch {
		case better:
		case over != victimOver:
			better = over
		case live != victimLive:
			better = !live
		default:
			better = at < victimAt
		}
		if better {
			victim, victimOver, victimLive, victimAt = h, over, live, at
		}
		return true
	})
	p.senderMu.Unlock()
	if victim == nil || !victim.evicted.CompareAndSwap(false, true) {
		return false
	}
	p.holders.Delete(victim.id)
	p.c[cEvicted].Add(1)
	p.limited.logAny(slog.LevelWarn, "events: holder limit reached, forgetting a holder", logName(victim.id.Pod),
		"rank", victim.id.Rank, "state", p.state(victim), "sender", victim.sender, "sender_over_share", victimOver,
		"heard", time.Since(time.Unix(0, victimAt)).Round(time.Millisecond), "max_holders", p.cfg.MaxHolders)
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
