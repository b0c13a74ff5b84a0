package events

import (
	"log/slog"
	"time"
)

// replays reports whether step(h, seq, epoch) would replay.
func (w *worker) replays(h *holder, seq, epoch uint64) bool {
	if !w.canReplay(h) || h.conflict.Load() {
		return false
	}
	switch {
	case !h.started:
		return seq != 0
	case seq == h.next, w.heartbeat(h, seq, epoch):
		return false
	case seq > h.next:
		return true
	case seq > h.liveMax:
		return false
	}
	return seq != 0
}

// step applies w.batch, batch seq of h (payload as received, handed at
// Processor.epoch epoch), after what its sequence number says about the
// batches before it.
func (w *worker) step(h *holder, seq, epoch uint64, payload []byte) {
	switch {
	case !h.started:
		h.started = true
		w.catchUp(h, seq)
	case seq == h.next:
	case w.heartbeat(h, seq, epoch):
		w.p.c[cHeartbeats].Add(1)
		return
	case h.engine == EngineTRTLLM && seq > h.next && seq-h.next >= TRTRestartJump:
		// TensorRT-LLM's numbers start at its process's time_ns.
		w.restart(h, seq)
		w.catchUp(h, seq)
	case seq > h.next:
		w.p.c[cGaps].Add(1)
		h.c[cGaps].Add(1)
		w.p.limited.logf(slog.LevelWarn, "events: sequence gap", h.id.Pod, "rank", h.id.Rank, "expected", h.next, "seq", seq)
		if w.canReplay(h) {
			w.replay(h, h.next, seq)
		}
		if seq > h.next {
			w.unrecovered(h, h.next, seq-1, "no replay endpoint or replay failed")
		}
	case seq > h.liveMax:
		// Already applied from a replay that ran ahead of the live stream.
		w.p.c[cDups].Add(1)
		h.liveMax = seq
		return
	default:
		if w.enterConflict(h, seq) {
			return
		}
		w.restart(h, seq)
		w.catchUp(h, seq)
	}
	h.liveMax = max(h.liveMax, seq)
	if seq < h.next {
		w.p.c[cDups].Add(1)
		return
	}
	w.apply(h, &w.batch, seq, payload)
}

// heartbeat reports whether batch seq of h, in w.batch, handed at epoch,
// is an empty batch repeating the last applied number: a heartbeat of the
// same process, which must not read as a restart.
//
// Except 0 repeating 0 on a connection that came up since h last
// confirmed a message: vLLM and SGLang number a new process's batches
// from 0, so that is as likely a new process's first batch, an empty one,
// as its predecessor's heartbeat, and only the restart keeps the index a
// subset of the engine's blocks (a heartbeat would make the dead
// process's blocks a source again). TensorRT-LLM numbers from its start
// time, and no new process starts at a later number: those stay
// heartbeats.
func (w *worker) heartbeat(h *holder, seq, epoch uint64) bool {
	if w.p.cfg.Tapped || len(w.batch.Events) != 0 || !h.hasSeq.Load() || seq+1 != h.next {
		return false
	}
	if seq != 0 {
		return true
	}
	ps := h.ps.Load()
	if ps == nil {
		return true
	}
	up := ps.upAt.Load()
	return h.confirmed.Load() >= up || epoch < up
}

// catchUp fetches, when the pod has a replay endpoint, the batches before
// seq of a holder that has applied none of its engine's batches yet: it
// joined a running engine, or the engine restarted and its first messages
// were lost (a subscriber reconnecting to a restarted engine misses some).
// Whatever the holder applies is a subset of the engine's blocks, so what
// replay no longer buffers is no gap; but a replay that stops part-way
// leaves one between what it applied and seq, and the gap policy handles
// it: a batch in it may have removed a block that replay stored.
func (w *worker) catchUp(h *holder, seq uint64) {
	if h.replay == nil || seq == 0 {
		return
	}
	h.next = 0
	if w.canReplay(h) {
		w.replay(h, 0, seq)
	}
	switch {
	case h.next == 0:
		h.next = seq
	case h.next < seq:
		w.unrecovered(h, h.next, seq-1, "replay ended early")
	}
}

// restart handles a sequence number that went backwards: a new engine
// process with an empty cache.
func (w *worker) restart(h *holder, seq uint64) {
	w.p.c[cRestarts].Add(1)
	h.c[cRestarts].Add(1)
	how := "went back to"
	if seq == h.next-1 {
		how = "repeated" // a new engine's first batch numbered as the old one's last, 0 after 0
	}
	w.p.limited.logf(slog.LevelWarn, "events: engine restarted (its sequence "+how+" an applied number), clearing its entries",
		h.id.Pod, "rank", h.id.Rank, "last_applied_seq", h.next-1, "seq", seq)
	// In every model: a new process's cache is empty, and a snapshot may
	// have brought the holder in under a model its new stream does not
	// follow.
	w.removeHolder(h.id, h.model)
	if h.content != nil {
		h.content.reset()
	}
	h.next, h.liveMax = seq, seq
	h.keepStale, h.resyncing = false, false
	h.matched = false
	h.gpuBlockSize = h.gpuBlockSize[:0]
	h.setStale()
}

// enterConflict records a sequence number going backwards and, when it is
// the Config.ConflictRestarts-th within Config.ConflictWindow, puts h in
// state conflict: its entries are cleared once and its messages dropped
// until the numbers stop going backwards, rather than clearing it again
// on every message of the other stream.
func (w *worker) enterConflict(h *holder, seq uint64) bool {
	now := time.Now()
	n := w.p.cfg.ConflictRestarts
	if len(h.backs) == n {
		copy(h.backs, h.backs[1:])
		h.backs = h.backs[:n-1]
	}
	h.backs = append(h.backs, now)
	if len(h.backs) < n || now.Sub(h.backs[0]) > w.p.cfg.ConflictWindow {
		return false
	}
	h.backs = h.backs[:0]
	w.p.c[cConflicts].Add(1)
	h.c[cConflicts].Add(1)
	w.p.c[cConflictDropped].Add(1)
	w.p.limited.logf(slog.LevelError, "events: two interleaved sequence streams under one holder (two engines publishing "+
		"under one name, or a peer replaying its numbers): clearing its entries and dropping its messages until one stops; "+
		"it is no pull source meanwhile",
		h.id.Pod, "rank", h.id.Rank, "last_seq", h.next-1, "seq", seq, "restarts_within", w.p.cfg.ConflictWindow)
	w.removeHolder(h.id, h.model)
	if h.content != nil {
		h.content.reset()
	}
	h.lastBack, h.lastConflictSeq = now, seq
	h.conflict.Store(true)
	return true
}

// conflicted handles a message of h, which is in conflict: it reports true
// (the message dropped) while its numbers still went backwards within
// Config.ConflictWindow, else h leaves the state and starts again as a new
// holder from this message.
func (w *worker) conflicted(h *holder, seq uint64) bool {
	now := time.Now()
	if seq < h.lastConflictSeq {
		h.lastBack = now
	}
	h.lastConflictSeq = seq
	if now.Sub(h.lastBack) < w.p.cfg.ConflictWindow {
		w.p.c[cConflictDropped].Add(1)
		return true
	}
	w.p.limited.logf(slog.LevelWarn, "events: holder's sequence numbers consistent again, leaving state conflict as a new holder",
		h.id.Pod, "rank", h.id.Rank, "seq", seq)
	h.started, h.next, h.liveMax = false, 0, 0
	h.keepStale, h.resyncing, h.matched = false, false, false
	h.gpuBlockSize = h.gpuBlockSize[:0]
	h.setStale()
	h.conflict.Store(false)
	return false
}

// unrecovered applies the gap policy to a range of batches that are lost.
func (w *worker) unrecovered(h *holder, from, to uint64, why string) {
	w.p.c[cUnrecovered].Add(1)
	h.c[cUnrecovered].Add(1)
	if to >= h.resyncSeq {
		h.resyncing = false
	}
	if w.p.cfg.Gap == GapKeep {
		w.p.limited.logf(slog.LevelWarn, "events: lost batches, holder stale until the engine clears or restarts",
			h.id.Pod, "rank", h.id.Rank, "from", from, "to", to, "why", why)
		h.keepStale = true
	} else {
		w.p.limited.logf(slog.LevelWarn, "events: lost batches, clearing the holder's entries",
			h.id.Pod, "rank", h.id.Rank, "from", from, "to", to, "why", why)
		w.p.cfg.Sink.ClearHolder(h.model, h.id, "")
	}
	h.next = to + 1
	h.setStale()
}
