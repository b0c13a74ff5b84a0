package events

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// canReplay reports whether a replay of h would be tried now.
func (w *worker) canReplay(h *holder) bool {
	return h.replay != nil && !time.Now().Before(h.replayAfter) && w.p.ctx.Err() == nil
}

// resyncPod handles a pod that lost a message to a full queue: holders with
// a replay endpoint fetch everything after what they applied; the others,
// and those whose replay failed, are stale until their next message shows
// the gap, which the gap policy then resolves. Older messages still queued
// do not end that: they precede the dropped ones. (The dropped message's
// rank is unknown, so each holder of the pod waits for the same number.)
func (w *worker) resyncPod(pod string, dropped uint64) {
	var hs []*holder
	for _, h := range w.holders {
		if h.id.Pod == pod && h.started {
			hs = append(hs, h)
		}
	}
	if len(hs) == 0 {
		return
	}
	resync := func(w *worker) {
		for _, h := range hs {
			if w.canReplay(h) {
				answered := h.c[cReplays].Load()
				// No end target: dropped is the pod's, and may belong to
				// another rank's sequence; ReplayDeadline bounds the
				// replay instead.
				w.replay(h, h.next, noTarget)
				if h.c[cReplays].Load() != answered {
					continue
				}
			}
			if !h.resyncing || dropped > h.resyncSeq {
				h.resyncSeq = dropped
			}
			h.resyncing = true
			h.setStale()
		}
	}
	// Pods past Config.MaxHolders replay on the worker (see
	// Processor.overflow).
	if _, tracked := w.p.pods.Load(pod); tracked {
		for _, h := range hs {
			if w.canReplay(h) {
				w.offload(pod, resync)
				return
			}
		}
	}
	resync(w)
}

// noTarget is the end target of a replay that takes whatever the endpoint
// has.
const noTarget = ^uint64(0)

// replay fetches the batches from seq from on and applies those that follow
// on what h applied, in order, until the endpoint's end marker or until the
// batches before seq until are covered: the live stream delivers the rest,
// and an endpoint sending ever more must not hold the pod. A range the
// engine no longer buffers is handed to the gap policy (except before h's
// first batch).
//
// vLLM's replay socket drops replies a slow reader's pipe cannot hold, so a
// reply stream can have holes, or lose its tail, although the engine still
// buffers every batch. Such a round ends at the first hole and the next
// asks again from the first missing sequence number, up to
// Config.ReplayRounds rounds within the one ReplayDeadline.
func (w *worker) replay(h *holder, from, until uint64) {
	ctx, cancel := context.WithTimeout(w.p.ctx, w.p.cfg.ReplayDeadline)
	defer cancel()
	fresh := h.next == 0 && from == 0
	for round := 1; ; round++ {
		applied, why := w.replayRound(ctx, h, from, until, fresh)
		if round > 1 {
			w.p.c[cReplayRecovered].Add(applied)
		}
		if why == "" {
			return
		}
		if applied > 0 {
			fresh = false
		}
		if round >= w.p.cfg.ReplayRounds {
			w.p.limited.logf(slog.LevelWarn, "events: replay still lost replies after the last round", h.id.Pod,
				"rank", h.id.Rank, "seq", h.next, "rounds", round, "why", why)
			return
		}
		w.p.c[cReplayRounds].Add(1)
		w.p.limited.logf(slog.LevelInfo, "events: replay replies lost in transit, asking again from the first missing batch",
			h.id.Pod, "rank", h.id.Rank, "seq", h.next, "round", round+1, "why", why)
		from = h.next
	}
}

// replayRound sends one replay request for the batches from seq from on
// and applies the replies, as replay describes. It returns how many batches
// it applied and, when the replies had holes or a lost tail that the engine
// still buffers, why; "" when the replay is over, answered or failed.
func (w *worker) replayRound(ctx context.Context, h *holder, from, until uint64, fresh bool) (applied uint64, why string) {
	answered := false
	received := 0
	err := h.replay.Replay(ctx, h.id, from, func(seq uint64, payload []byte) bool {
		first := received == 0
		received++
		if seq < h.next {
			return true
		}
		if err := w.rdec.Decode(payload, &w.rbatch); err != nil {
			w.decodeError(h.id.Pod, seq, err)
			return true
		}
		if w.rbatch.DPRank.Or(0) != h.id.Rank {
			return true
		}
		if seq > h.next && !first && !fresh {
			// The engine buffers its batches without holes, and it had
			// this round's first: the batches between were lost in
			// transit.
			why = fmt.Sprintf("replies %d to %d missing", h.next, seq-1)
			return false
		}
		if seq >= until {
			// Past the target without reaching it: the endpoint no longer
			// has the rest.
			if h.next < until && !fresh {
				w.unrecovered(h, h.next, until-1, "range no longer in the replay buffer")
			}
			answered = true
			return false
		}
		if seq > h.next && !fresh {
			w.unrecovered(h, h.next, seq-1, "range no longer in the replay buffer")
		}
		fresh = false
		w.p.c[cReplayed].Add(1)
		applied++
		w.apply(h, &w.rbatch, seq, payload)
		if h.next >= until {
			answered = true
			return false
		}
		return true
	})
	switch {
	case why != "":
		return applied, why
	case err == nil && until != noTarget && h.next < until && received > 0:
		// The end marker came, but the engine published up to until and
		// had the range from the first reply on: the rest was dropped.
		return applied, "end marker before the missing range was covered"
	case err == nil:
		w.replayAnswered(h)
	case answered:
		// fn ended the replay and the transport failed closing it.
		w.replayAnswered(h)
	case errors.Is(err, context.DeadlineExceeded) && w.p.ctx.Err() == nil:
		w.p.c[cReplayTimeouts].Add(1)
		w.replayFailed(h, fmt.Errorf("not complete after %v: %w", w.p.cfg.ReplayDeadline, err))
	case errors.Is(err, ErrReplayTimeout) && received > 0 && ctx.Err() == nil:
		// Replies came, then stopped short of the end marker: the tail
		// was dropped in transit.
		return applied, "reply stream stopped before its end marker"
	case errors.Is(err, ErrReplayTimeout):
		w.p.c[cReplayTimeouts].Add(1)
		w.replayFailed(h, err)
	default:
		w.replayFailed(h, err)
	}
	return applied, ""
}

func (w *worker) replayAnswered(h *holder) {
	w.p.c[cReplays].Add(1)
	h.c[cReplays].Add(1)
}

// replayBackoff is how long a holder whose replay failed goes without
// trying again: a dead replay endpoint must not stall its pod on every gap.
const replayBackoff = 30 * time.Second

func (w *worker) replayFailed(h *holder, err error) {
	h.replayAfter = time.Now().Add(replayBackoff)
	w.p.c[cReplayErrors].Add(1)
	w.p.limited.logf(slog.LevelWarn, "events: replay failed", h.id.Pod, "rank", h.id.Rank, "err", err)
}
