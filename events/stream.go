package events

import (
	"log/slog"
	"time"
)

// replays reports whether step(h, seq, epoch) would replay.
func (w *worker) replays(h *holder, seq, epoch uint64) bool {
	return w.canReplay(h) && !h.conflict.Load() && decide(h.seqState(), w.seqMsg(h, seq, epoch)).replays(seq)
}

// seqState is h's stream as decide reads it.
func (h *holder) seqState() seqState {
	return seqState{started: h.started, next: h.next, liveMax: h.liveMax, hasSeq: h.hasSeq.Load(), trt: h.engine == EngineTRTLLM}
}

// seqMsg is batch seq of h, in w.batch, handed at Processor.epoch epoch,
// as decide reads it.
func (w *worker) seqMsg(h *holder, seq, epoch uint64) seqMsg {
	m := seqMsg{seq: seq, empty: len(w.batch.Events) == 0, tapped: w.p.cfg.Tapped}
	if ps := h.ps.Load(); ps != nil {
		up := ps.upAt.Load()
		m.reconnected = h.confirmed.Load() < up && epoch >= up
	}
	return m
}

// step applies w.batch, batch seq of h (payload as received, handed at
// Processor.epoch epoch), after doing what decide says its sequence
// number means for the batches before it.
func (w *worker) step(h *holder, seq, epoch uint64, payload []byte) {
	switch decide(h.seqState(), w.seqMsg(h, seq, epoch)) {
	case actJoin:
		h.started = true
		w.catchUp(h, seq)
	case actApply:
	case actHeartbeat:
		w.p.c[cHeartbeats].Add(1)
		return
	case actRestart:
		w.restart(h, seq)
		w.catchUp(h, seq)
	case actGap:
		w.gap(h, seq)
	case actDuplicate:
		w.p.c[cDups].Add(1)
		h.liveMax = seq
		return
	case actBackwards:
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

// gap closes the gap before batch seq of h from replay when it can, and
// applies the gap policy to what replay did not deliver.
func (w *worker) gap(h *holder, seq uint64) {
	w.p.c[cGaps].Add(1)
	h.c[cGaps].Add(1)
	w.p.limited.logf(slog.LevelWarn, "events: sequence gap", h.id.Pod, "rank", h.id.Rank, "expected", h.next, "seq", seq)
	if w.canReplay(h) {
		w.replay(h, h.next, seq)
	}
	if seq > h.next {
		w.unrecovered(h, h.next, seq-1, "no replay endpoint or replay failed")
	}
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

// restart handles a new engine process on h's address, which batch seq's
// number shows: its cache is empty, and its stream goes on from seq.
func (w *worker) restart(h *holder, seq uint64) {
	w.p.c[cRestarts].Add(1)
	h.c[cRestarts].Add(1)
	how := "went back to"
	if seq == h.next-1 {
		how = "repeated" // a new engine's first batch numbered as the old one's last, 0 after 0
	}
	w.p.limited.logf(slog.LevelWarn, "events: engine restarted (its sequence "+how+" an applied number), clearing its entries",
		h.id.Pod, "rank", h.id.Rank, "last_applied_seq", h.next-1, "seq", seq)
	w.clearEntries(h)
	h.resetStream()
	h.started, h.next, h.liveMax = true, seq, seq
}

// clearEntries removes h's entries in every model: a new process's cache
// is empty, and a snapshot may have brought the holder in under a model
// its new stream does not follow.
func (w *worker) clearEntries(h *holder) {
	w.removeHolder(h.id, h.model)
	if h.content != nil {
		h.content.reset()
	}
}

// resetStream forgets what h's stream said so far (a restart, another
// model, a conflict over): its next message starts it as a new holder's.
func (h *holder) resetStream() {
	h.started, h.next, h.liveMax = false, 0, 0
	h.keepStale, h.resyncing, h.matched = false, false, false
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
	w.clearEntries(h)
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
	h.resetStream()
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
