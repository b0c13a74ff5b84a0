package events

import (
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/kvsource/kvsource/index"
)

// holder is one (pod, rank) stream. The goroutine handling its pod alone
// writes it (the pod's worker, or the replay the worker started for the
// pod); Status reads only the atomics.
type holder struct {
	id     index.Holder
	replay Replayer
	model  string
	sender string // Message.Sender of its first message
	engine Engine

	started bool
	next    uint64 // sequence number expected next
	liveMax uint64 // highest sequence number received live
	// resyncing: a message of this pod was dropped on a full queue and its
	// gap is not resolved yet: no batch at or past resyncSeq, the highest
	// dropped sequence number, has applied and no gap has covered it.
	resyncing bool
	resyncSeq uint64
	keepStale bool // GapKeep: entries may be outdated

	lastLog     time.Time
	replayAfter time.Time // no replay before: the last one failed
	matched     bool      // a hash agreement check ever passed
	content     *contentMap
	statModel   atomic.Pointer[string]
	// gpuBlockSize is the block size of the holder's latest GPU-tier
	// BlockStored of each KV cache group (0: none seen), what its
	// offload-tier events are checked against.
	gpuBlockSize []int
	lastChunkLog time.Time

	// backs are the times of the latest sequence numbers that went
	// backwards, at most Config.ConflictRestarts; in conflict, lastBack
	// is the latest and lastConflictSeq the latest number received.
	backs           []time.Time
	lastBack        time.Time
	lastConflictSeq uint64

	c counters // those of Counters kept per holder
	// ps is the state of the holder's pod, its connection's included; nil
	// only while the holder is being made.
	ps atomic.Pointer[podState]
	// confirmed is the highest Processor.epoch a message the holder
	// handled was stamped with: at its pod's latest reconnect or later,
	// the message was sent after it.
	confirmed atomic.Uint64
	lastSeq   atomic.Uint64
	stale     atomic.Bool
	hasSeq    atomic.Bool  // lastSeq is a batch applied (or InitialSeqs)
	heard     atomic.Bool  // a batch applied since the processor started
	heardAt   atomic.Int64 // Unix nanoseconds of its latest message
	conflict  atomic.Bool  // in state conflict
	// evicted: Processor.evict forgot it; its worker clears its entries.
	evicted atomic.Bool
}

func (h *holder) status(p *Processor) HolderStatus {
	st := HolderStatus{Pod: h.id.Pod, Rank: h.id.Rank, LastSeq: h.lastSeq.Load(), State: p.state(h)}
	for _, c := range Counters {
		if c.Holder != nil {
			*c.Holder(&st) = h.c[c.id].Load()
		}
	}
	if m := h.statModel.Load(); m != nil {
		st.Model = *m
	}
	return st
}

func (h *holder) setStale() { h.stale.Store(h.keepStale || h.resyncing) }

// holder returns the holder of rank of m's pod, creating it when new (at
// Config.MaxHolders after evicting another); nil, the message counted and
// logged as dropped, when there was no room.
func (w *worker) holder(m *message, rank int) *holder {
	id := index.Holder{Pod: m.Pod, Rank: rank}
	h := w.holders[id]
	if h != nil && h.evicted.Load() {
		w.evictHolder(h)
		h = nil
	}
	if h == nil {
		// The sender's bound first: a sender at it must not evict others.
		if !w.p.addSender(m.Sender) {
			w.p.c[cSenderHolders].Add(1)
			w.p.limited.logAny(slog.LevelWarn, "events: sender has the most holders it may, dropping a new holder's message",
				logName(m.Pod), "rank", rank, "seq", m.Seq, "sender", m.Sender, "max_holders_per_sender", w.p.cfg.MaxHoldersPerSender)
			return nil
		}
		if w.p.nHolders.Add(1) > int64(w.p.cfg.MaxHolders) {
			evicted := w.p.evict()
			w.p.nHolders.Add(-1)
			if !evicted {
				w.p.removeSender(m.Sender)
				w.p.limited.logAny(slog.LevelWarn, "events: holder limit reached and no holder to evict, dropping a new holder's message",
					m.Pod, "rank", rank, "seq", m.Seq, "max_holders", w.p.cfg.MaxHolders)
				return nil
			}
		}
		h = &holder{id: id, sender: m.Sender}
		if seq, ok := w.p.cfg.InitialSeqs[id]; ok && !w.snapshotExpired {
			h.started, h.next, h.liveMax = true, seq+1, seq
			h.lastSeq.Store(seq)
			h.hasSeq.Store(true)
			w.pruneModels(id, m.Model)
		}
		if w.p.cfg.ContentKeys != nil {
			h.content = newContentMap(w.p.cfg.ContentMapSize)
		}
		w.holders[id] = h
		w.p.holders.Store(id, h)
	}
	if h.ps.Load() == nil {
		// Not m.ps: it is the overflow past the bound, or a state
		// forgotten while m was handed.
		ps := w.p.holderState(m.Pod)
		ps.holders.Add(1)
		h.ps.Store(ps)
	}
	h.replay, h.engine = m.Replay, m.Engine
	h.heardAt.Store(time.Now().UnixNano())
	if h.model != m.Model {
		if h.model != "" {
			w.switchModel(h, m.Model, m.Seq)
		}
		h.model = m.Model
		h.statModel.Store(&m.Model)
	}
	return h
}

// evictHolder clears the entries of h, which Processor.evict forgot,
// unless it was replaced already; behind its pod's running replay, if any.
func (w *worker) evictHolder(h *holder) {
	if w.holders[h.id] != h {
		return
	}
	if pq := w.busy[h.id.Pod]; pq != nil {
		pq.queue = append(pq.queue, pendingItem{evict: h})
		return
	}
	delete(w.holders, h.id)
	w.removeHolder(h.id, h.model)
	w.detach(h)
}

// detach undoes holder's count of h in its pod's state, for a holder
// forgotten: the pod's state goes with its last holder.
func (w *worker) detach(h *holder) {
	w.p.removeSender(h.sender)
	if ps := h.ps.Load(); ps != nil && ps.holders.Add(-1) == 0 {
		w.p.forgetPod(h.id.Pod)
	}
}

func (w *worker) removeHolder(id index.Holder, model string) {
	if r, ok := w.p.cfg.Sink.(HolderRemover); ok {
		r.RemoveHolder(id)
		return
	}
	w.p.cfg.Sink.ClearHolder(model, id, "")
}

// expire removes the holders of Config.InitialSeqs this worker has not
// heard from, and stops applying InitialSeqs to new holders.
func (w *worker) expire() {
	w.snapshotExpired = true
	for id := range w.p.cfg.InitialSeqs {
		if w.p.workerOf(id.Pod) != w {
			continue
		}
		h := w.holders[id]
		if h != nil && (h.heard.Load() || w.busy[id.Pod] != nil) {
			continue
		}
		if h != nil {
			delete(w.holders, id)
			w.p.holders.Delete(id)
			w.p.nHolders.Add(-1)
			w.detach(h)
		}
		w.p.cfg.Sink.(HolderRemover).RemoveHolder(id)
		w.p.c[cExpired].Add(1)
		w.p.limited.logAny(slog.LevelInfo, "events: holder restored from the snapshot and never heard from, removed",
			id.Pod, "rank", id.Rank, "after", w.p.cfg.SnapshotExpiry)
	}
}

// pruneModels forgets what an index snapshot brought in for holder id
// under any model but the one its first message names: only the entries
// under the model a holder's stream follows are kept (see switchModel),
// and the snapshot's other models are no stream's.
func (w *worker) pruneModels(id index.Holder, model string) {
	switch sink := w.p.cfg.Sink.(type) {
	case HolderPruner:
		sink.RemoveHolderExcept(id, model)
	case HolderRemover:
		sink.RemoveHolder(id)
	}
}

// switchModel handles the first message of h under another model than
// its stream's so far. An engine serves one model, so this is a new
// process on the address (Kubernetes reuses a dead pod's IP for another
// deployment) with an empty cache, whatever its sequence number says: its
// entries go, in every model, and its stream starts again as a new
// holder's. Only the entries under the model a holder's stream follows
// are ever kept, so that a holder is a source only for blocks its stream
// vouches for, and a sender's model states are bounded by its holders.
func (w *worker) switchModel(h *holder, model string, seq uint64) {
	w.p.c[cRestarts].Add(1)
	h.c[cRestarts].Add(1)
	w.p.limited.logf(slog.LevelWarn, "events: engine publishes another model (a new process on the address), clearing its entries",
		h.id.Pod, "rank", h.id.Rank, "model", logName(h.model), "new_model", logName(model), "seq", seq)
	w.clearEntries(h)
	h.resetStream()
}
