package events

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsource/kvsource/hashing"
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

// message is one handed message on its way to a worker.
type message struct {
	Message
	ps      *podState // Processor.overflow past Config.MaxHolders pods
	tracked bool      // ps is the pod's own: its replays may run off the worker
	epoch   uint64    // Processor.epoch when it was handed
}

// pending is a pod whose replay runs off the worker, and what arrived for
// the pod meanwhile, handled in order once the replay ends.
type pending struct {
	queue []pendingItem
}

// resync queues a resync of the pod after its queued messages, merged
// with one queued last, so that drops cannot grow the queue.
func (pq *pending) resync(dropped uint64) {
	if n := len(pq.queue); n > 0 && pq.queue[n-1].resync {
		pq.queue[n-1].dropped = max(pq.queue[n-1].dropped, dropped)
		return
	}
	pq.queue = append(pq.queue, pendingItem{resync: true, dropped: dropped})
}

type pendingItem struct {
	m       message
	resync  bool    // a resync of the pod, not a message
	dropped uint64  // of a resync: the highest dropped sequence number
	evict   *holder // an eviction of the pod's holder, not a message
}

// chore is work another goroutine posts to a worker: an eviction of one of
// its holders, or the expiry of the snapshot's holders it has not heard
// from.
type chore struct {
	evict  *holder
	expire bool
}

type worker struct {
	p       *Processor
	in      chan message
	holders map[index.Holder]*holder

	// The decode and apply buffers. A replay running off the worker has a
	// worker value of its own, sharing only p.
	dec, rdec     *Decoder
	xdec          *Decoder // extra-keys tuples of the batch dec decoded
	batch, rbatch Batch
	keys, keys2   []uint64
	extra         [][]hashing.ExtraKey
	pairTokens    []uint32 // checkTokens' buffer
	indexRun      run      // apply's pending index call

	// congested is Handle's: an enqueue to this worker timed out and none
	// has succeeded since.
	congested atomic.Bool

	busy     map[string]*pending // pods whose replay runs off the worker
	finished chan string         // pods whose off-worker replay ended
	inflight int                 // off-worker replays running

	// queued is the payload bytes of the messages handed to this worker
	// and not yet closed, those waiting behind a replay included
	// (Config.QueueBytes); shared with its off-worker replays.
	queued *atomic.Int64

	resyncMu   sync.Mutex
	resyncPods map[string]uint64 // pod -> highest dropped sequence number
	chores     []chore
	resyncSig  chan struct{}
	// snapshotExpired: Config.InitialSeqs no longer applies to new holders.
	snapshotExpired bool
}

func newWorker(p *Processor) *worker {
	return &worker{
		p: p, in: make(chan message, p.cfg.QueueLen), holders: map[index.Holder]*holder{},
		queued: new(atomic.Int64), dec: NewDecoder(), rdec: NewDecoder(), xdec: NewDecoder(),
		busy: map[string]*pending{}, finished: make(chan string),
		resyncPods: map[string]uint64{}, resyncSig: make(chan struct{}, 1),
	}
}

// offWorker returns a worker value with buffers of its own for a replay
// running on another goroutine.
func (w *worker) offWorker() *worker {
	return &worker{p: w.p, queued: w.queued, dec: NewDecoder(), rdec: NewDecoder(), xdec: NewDecoder()}
}

func (w *worker) run() {
	in := w.in
	for in != nil || w.inflight > 0 {
		select {
		case m, ok := <-in:
			if !ok {
				in = nil
				continue
			}
			w.route(m)
		case pod := <-w.finished:
			w.inflight--
			w.resume(pod)
		case <-w.resyncSig:
			w.resync()
		}
	}
}

// route handles m, or queues it behind its pod's running replay.
func (w *worker) route(m message) {
	if pq := w.busy[m.Pod]; pq != nil {
		if len(pq.queue) >= w.p.cfg.QueueLen {
			w.p.c[cQueueFull].Add(1)
			w.p.limited.logf(slog.LevelWarn, "events: too many messages behind a replay; dropping, the pod marked for resync",
				m.Pod, "seq", m.Seq)
			w.closeMessage(m)
			pq.resync(m.Seq)
			return
		}
		pq.queue = append(pq.queue, pendingItem{m: m})
		return
	}
	w.handle(m)
}

// offload runs fn, which replays for pod, on a goroutine of its own with
// its own buffers; the pod's messages wait behind it, others do not.
func (w *worker) offload(pod string, fn func(ow *worker)) {
	w.busy[pod] = &pending{}
	w.inflight++
	ow := w.offWorker()
	go func() {
		fn(ow)
		w.finished <- pod
	}()
}

// resume handles what arrived for pod while its replay ran, in order, until
// one of them starts another replay.
func (w *worker) resume(pod string) {
	pq := w.busy[pod]
	delete(w.busy, pod)
	for i, it := range pq.queue {
		if next := w.busy[pod]; next != nil {
			next.queue = append(next.queue, pq.queue[i:]...)
			return
		}
		switch {
		case it.evict != nil:
			w.evictHolder(it.evict)
		case it.resync:
			w.resyncPod(pod, it.dropped)
		default:
			w.handle(it.m)
		}
	}
}

// closeMessage records that m was handled, for Sync.
func (w *worker) closeMessage(m message) {
	w.queued.Add(-int64(len(m.Payload)))
	if m.ps != nil {
		m.ps.closed.Add(1)
	}
	if m.tracked && m.ps.holders.Load() == 0 {
		// Its messages made no holder (malformed, dropped): it must not
		// keep a pod state for good.
		w.p.forgetPod(m.Pod)
	}
	w.p.applied.Broadcast()
}

// dropped is Handle's, after dropping m on a full queue.
func (w *worker) dropped(m message) {
	w.p.c[cQueueFull].Add(1)
	w.closeMessage(m)
	w.markResync(m.Pod, m.Seq)
}

// markResync records that message seq of pod was dropped.
func (w *worker) markResync(pod string, seq uint64) {
	w.resyncMu.Lock()
	if old, ok := w.resyncPods[pod]; !ok || seq > old {
		w.resyncPods[pod] = seq
	}
	w.resyncMu.Unlock()
	select {
	case w.resyncSig <- struct{}{}:
	default:
	}
}

// post queues c for the worker's goroutine.
func (w *worker) post(c chore) {
	w.resyncMu.Lock()
	w.chores = append(w.chores, c)
	w.resyncMu.Unlock()
	select {
	case w.resyncSig <- struct{}{}:
	default:
	}
}

func (w *worker) resync() {
	w.resyncMu.Lock()
	pods := w.resyncPods
	w.resyncPods = map[string]uint64{}
	chores := w.chores
	w.chores = nil
	w.resyncMu.Unlock()
	for _, c := range chores {
		if c.expire {
			w.expire()
		} else {
			w.evictHolder(c.evict)
		}
	}
	for pod, dropped := range pods {
		if pq := w.busy[pod]; pq != nil {
			pq.resync(dropped)
			continue
		}
		w.resyncPod(pod, dropped)
	}
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

// canReplay reports whether a replay of h would be tried now.
func (w *worker) canReplay(h *holder) bool {
	return h.replay != nil && !time.Now().Before(h.replayAfter) && w.p.ctx.Err() == nil
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
	w.removeHolder(h.id, h.model)
	if h.content != nil {
		h.content.reset()
	}
	h.started, h.next, h.liveMax = false, 0, 0
	h.keepStale, h.resyncing, h.matched = false, false, false
	h.gpuBlockSize = h.gpuBlockSize[:0]
	h.setStale()
}

// handle decodes m and steps its holder's state machine, on another
// goroutine when that replays.
func (w *worker) handle(m message) {
	if err := w.dec.Decode(m.Payload, &w.batch); err != nil {
		w.decodeError(m.Pod, m.Seq, err)
		w.closeMessage(m)
		return
	}
	h := w.holder(&m, w.batch.DPRank.Or(0))
	if h == nil || (h.conflict.Load() && w.conflicted(h, m.Seq)) {
		w.closeMessage(m)
		return
	}
	if m.tracked && w.replays(h, m.Seq, m.epoch) {
		w.offload(m.Pod, func(ow *worker) {
			// The payload decoded before; only the buffers differ.
			_ = ow.dec.Decode(m.Payload, &ow.batch)
			ow.step(h, m.Seq, m.epoch, m.Payload)
			confirm(h, m.epoch)
			ow.closeMessage(m)
		})
		return
	}
	w.step(h, m.Seq, m.epoch, m.Payload)
	confirm(h, m.epoch)
	w.closeMessage(m)
}

// confirm records that h handled a message stamped with epoch: its
// sequence number showed whether the engine restarted, and step cleared
// the entries if it did.
func confirm(h *holder, epoch uint64) {
	if epoch > h.confirmed.Load() {
		h.confirmed.Store(epoch)
	}
}

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

func (w *worker) decodeError(pod string, seq uint64, err error) {
	w.p.c[cDecodeErrors].Add(1)
	if n := w.p.errCount(pod); n != nil {
		n.Add(1)
	}
	w.p.limited.logf(slog.LevelError, "events: dropped malformed payload", pod, "seq", seq, "err", err)
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

// run is a run of consecutive events that apply as one index call.
// SGLang publishes every page as an event of its own, a one-token page at
// its default page size: a Store or Remove per page would cost the index
// its per-call work (the holder's lock, the model's lookup) for every
// block, about half of the ingest rate at page size 1.
type run struct {
	kind   EventType // EventBlockStored or EventBlockRemoved; EventUnknown: none
	tier   string
	group  int
	parent index.Parent
	keys   []uint64
}

// extends reports whether an event of kind in tier and group whose first
// block's parent is parent (ok: it has one) continues the run.
func (r *run) extends(kind EventType, tier string, group int, parent uint64, ok bool) bool {
	if r.kind != kind || r.tier != tier || r.group != group {
		return false
	}
	return kind == EventBlockRemoved || (ok && len(r.keys) > 0 && r.keys[len(r.keys)-1] == parent)
}

// flush applies the pending run of h, if any.
func (w *worker) flush(h *holder) {
	r := &w.indexRun
	switch r.kind {
	case EventBlockStored:
		w.p.cfg.Sink.Store(index.Blocks{Model: h.model, Holder: h.id, Tier: r.tier, Group: r.group, Parent: r.parent, Keys: r.keys})
	case EventBlockRemoved:
		w.p.cfg.Sink.Remove(h.model, h.id, r.tier, r.group, r.keys)
	}
	r.kind, r.keys = EventUnknown, r.keys[:0]
}

// pend adds keys to the pending run, starting a new one (after applying
// the pending one) unless they continue it.
func (w *worker) pend(h *holder, kind EventType, tier string, group int, parent Opt[uint64], keys []uint64) {
	p, ok := parent.Get()
	r := &w.indexRun
	if !r.extends(kind, tier, group, p, ok) {
		w.flush(h)
		r.kind, r.tier, r.group, r.parent = kind, tier, group, index.Parent{}
		if ok {
			r.parent = index.ParentKey(p)
		}
	}
	r.keys = append(r.keys, keys...)
}

// apply applies one batch of h with sequence number seq to the sink.
// payload is the batch as received, for Config.Tap.
func (w *worker) apply(h *holder, b *Batch, seq uint64, payload []byte) {
	if tap := w.p.cfg.Tap; tap != nil {
		tap(TapBatch{Model: h.model, Pod: h.id.Pod, Rank: h.id.Rank, Seq: seq, Payload: payload})
	}
	sink := w.p.cfg.Sink
	var blocks uint64
	for i := range b.Events {
		e := &b.Events[i]
		switch e.Type {
		case EventBlockStored:
			blocks += uint64(len(e.BlockHashes))
			if e.ZeroParent {
				w.p.c[cZeroParents].Add(1)
			}
			// A chunked offload event's block size is not the engine's
			// hashing block size; the agreement check would blame the
			// router's settings for it.
			chunked := w.checkOffloadBlockSize(h, e, seq)
			if w.p.cfg.Hasher != nil && !chunked {
				w.checkAgreement(h, e, seq)
			}
			if h.content != nil {
				w.flush(h)
				w.storeContent(h, e, seq)
				continue
			}
			switch {
			case len(e.BlockHashes) == 0:
			case len(e.TokenIDs) > len(e.BlockHashes)*e.BlockSize:
				// A hybrid group skipped blocks: which ones is unknown, so
				// neither the parent nor any two keys are known to be
				// consecutive, and the index must not chain them.
				w.flush(h)
				for j := range e.BlockHashes {
					sink.Store(index.Blocks{Model: h.model, Holder: h.id, Tier: e.Medium, Group: e.GroupIdx.Or(0), Keys: e.BlockHashes[j : j+1]})
				}
			default:
				w.pend(h, EventBlockStored, e.Medium, e.GroupIdx.Or(0), e.Parent, e.BlockHashes)
			}
		case EventBlockRemoved:
			blocks += uint64(len(e.BlockHashes))
			keys := e.BlockHashes
			if h.content != nil {
				keys = w.resolve(h, keys)
			}
			if len(keys) > 0 {
				w.pend(h, EventBlockRemoved, e.Medium, e.GroupIdx.Or(0), Opt[uint64]{}, keys)
			}
		case EventAllBlocksCleared:
			w.flush(h)
			// vLLM's prefix-cache reset; every tier is cleared, so that no
			// pull is ever sent for a block the reset dropped.
			sink.ClearHolder(h.model, h.id, "")
			h.keepStale = false
		default:
			w.p.c[cUnknown].Add(1)
			continue
		}
	}
	w.flush(h)
	w.p.c[cEvents].Add(uint64(len(b.Events)))
	w.p.c[cBlocks].Add(blocks)
	w.p.c[cBatches].Add(1)
	h.next = seq + 1
	if seq >= h.resyncSeq {
		h.resyncing = false
	}
	h.lastSeq.Store(seq)
	h.hasSeq.Store(true)
	h.heard.Store(true)
	h.setStale()
	w.p.applied.Broadcast()
}

// request returns the hashing request for tokens, the leading blocks of e,
// that reproduces e's extra keys: the event's own tuples when it carries
// any, else its LoRA name. Only those blocks' tuples are converted, so that
// checking the leading blocks of a long event stays cheap.
func (w *worker) request(e *Event, tokens []uint32) (hashing.Request, error) {
	req := hashing.Request{Tokens: tokens}
	extra, ok := e.ExtraKeys.Get()
	if !ok {
		// SGLang's BlockStoredWithMetadata names the salt; vLLM's salt is
		// in its extra keys.
		req.LoRAName, req.CacheSalt = e.LoRAName, e.CacheSalt
		return req, nil
	}
	if e.BlockSize > 0 {
		extra = extra[:min(len(extra), len(tokens)/e.BlockSize)]
	}
	some := false
	for _, raw := range extra {
		if raw != nil {
			some = true
			break
		}
	}
	if !some {
		return req, nil
	}
	w.extra = w.extra[:0]
	for _, raw := range extra {
		if raw == nil {
			w.extra = append(w.extra, nil)
			continue
		}
		keys, err := w.xdec.extraKeyTuple(raw)
		if err != nil {
			return req, err
		}
		w.extra = append(w.extra, keys)
	}
	req.Extra = w.extra
	return req, nil
}

// checkTokens returns the tokens of e's first n blocks for rehashing; with
// eagle, for an event of EAGLE pairs, the token after them too, which
// SGLang's bigram keys hash.
func (w *worker) checkTokens(e *Event, n int, eagle bool) []uint32 {
	t := e.TokenIDs[:n*e.BlockSize]
	if !e.Bigram || !eagle {
		return t
	}
	next := e.BigramNext
	if len(e.TokenIDs) > len(t) {
		next = e.TokenIDs[len(t)]
	}
	w.pairTokens = append(append(w.pairTokens[:0], t...), next)
	return w.pairTokens
}

// checkBlocks is how many leading blocks the hash agreement check rehashes.
const checkBlocks = 2

// checkAgreement recomputes the keys of a BlockStored that starts at block 0
// and compares them with the engine's.
func (w *worker) checkAgreement(h *holder, e *Event, seq uint64) {
	n := len(e.BlockHashes)
	// Block size 0 is a token-less offload event (vLLM's newer connector):
	// nothing to rehash, though its lengths agree.
	if e.Parent.ok || n == 0 || e.GroupIdx.Or(0) != 0 || e.BlockSize <= 0 || len(e.TokenIDs) != n*e.BlockSize {
		return
	}
	w.p.c[cHashChecks].Add(1)
	h.c[cHashChecks].Add(1)
	cfg := w.p.cfg.Hasher.Config()
	cause := ""
	if e.BlockSize != cfg.BlockSize {
		cause = fmt.Sprintf("block size: the engine uses %d, the router %d", e.BlockSize, cfg.BlockSize)
	} else {
		// Algorithm, seed and key form all show in block 0 and the chaining
		// in block 1, so two blocks keep the check cheap on every event.
		n = min(n, checkBlocks)
		req, err := w.request(e, w.checkTokens(e, n, cfg.Algo == hashing.SGLangEAGLE))
		if err == nil {
			if req.Extra != nil {
				req.Extra = req.Extra[:n]
			}
			w.keys, err = w.p.cfg.Hasher.BlockKeys(w.keys[:0], req)
		}
		switch {
		case err != nil:
			cause = "cannot recompute: " + err.Error()
		case len(w.keys) != n:
			cause = fmt.Sprintf("recomputed %d blocks for the engine's %d", len(w.keys), n)
		default:
			for i, k := range w.keys {
				if k != e.BlockHashes[i] {
					cause = fmt.Sprintf("block %d differs", i)
					break
				}
			}
		}
	}
	if cause == "" {
		h.matched = true
		return
	}
	// Without the event's extra keys a multimodal item or cache salt the
	// router cannot see changes the hash; such a lone mismatch on a holder
	// that agreed before is not evidence of a settings mismatch.
	if !e.ExtraKeys.ok && e.BlockSize == cfg.BlockSize && h.matched {
		return
	}
	w.p.c[cHashMismatches].Add(1)
	h.c[cHashMismatches].Add(1)
	now := time.Now()
	if now.Sub(h.lastLog) < w.p.cfg.MismatchLogInterval {
		return
	}
	h.lastLog = now
	// Diagnose rehashes with every algorithm and a few seeds; the log
	// interval bounds how often.
	diag := cause
	n = min(len(e.BlockHashes), checkBlocks)
	if req, err := w.request(e, w.checkTokens(e, n, true)); err == nil {
		if req.Extra != nil {
			req.Extra = req.Extra[:n]
		}
		diag = hashing.Diagnose(cfg, e.BlockSize, req, e.BlockHashes[:n]).Explain(w.p.cfg.ContentKeysHint)
	}
	// Per holder and interval, but holders are a peer's to make up: the
	// kind's budget bounds them all.
	leftOut, ok := w.p.limited.allow(hashMismatchLog)
	if !ok {
		return
	}
	args := []any{"pod", h.id.Pod, "rank", h.id.Rank, "model", h.model, "seq", seq, "detail", cause,
		"router_algo", string(cfg.Algo), "router_seed", cfg.Seed, "router_block_size", cfg.BlockSize, "engine_block_size", e.BlockSize,
		"mismatches", h.c[cHashMismatches].Load()}
	w.p.log.Error(hashMismatchLog+diag, withLeftOut(args, leftOut)...)
}

// The messages of the lines a holder limits by itself, whose kind's budget
// bounds all holders together.
const (
	hashMismatchLog   = "events: engine block hashes disagree with the router's hashing; lookups for this holder will miss: "
	chunkedOffloadLog = "events: offload tier stores chunks of several GPU blocks, keyed by each chunk's last block; " +
		"CPU-tier lookups will undercount: configure the offloading connector's block_size equal to the GPU block size"
)

// maxTrackedGroups bounds the KV cache groups whose GPU block size a holder
// remembers: group_idx is the peer's to choose.
const maxTrackedGroups = 16

// checkOffloadBlockSize learns the GPU tier's block size from GPU-tier
// BlockStored events and reports whether e, an offload-tier BlockStored,
// shows chunked offloading: a non-zero block size other than the GPU
// tier's (or, before any GPU-tier event, the router's hashing block size).
// vLLM's offloading connector then keys each chunk of several GPU blocks by
// its last block's hash, so the index sees every k-th block of the tier.
// Events with block size 0 cannot be told apart and pass as exact.
func (w *worker) checkOffloadBlockSize(h *holder, e *Event, seq uint64) bool {
	g := e.GroupIdx.Or(0)
	if e.BlockSize <= 0 || g < 0 || g >= maxTrackedGroups {
		return false
	}
	if e.Medium == mediumGPU {
		if g >= len(h.gpuBlockSize) {
			h.gpuBlockSize = append(h.gpuBlockSize, make([]int, g+1-len(h.gpuBlockSize))...)
		}
		h.gpuBlockSize[g] = e.BlockSize
		return false
	}
	want, from := 0, "gpu_events"
	if g < len(h.gpuBlockSize) {
		want = h.gpuBlockSize[g]
	}
	if want == 0 {
		want, from = w.routerBlockSize(), "router_hasher"
	}
	if want == 0 || e.BlockSize == want {
		return false
	}
	w.p.c[cChunkedOffload].Add(1)
	n := h.c[cChunkedOffload].Add(1)
	now := time.Now()
	if now.Sub(h.lastChunkLog) < w.p.cfg.MismatchLogInterval {
		return true
	}
	h.lastChunkLog = now
	args := []any{"pod", h.id.Pod, "rank", h.id.Rank, "model", h.model, "seq", seq, "tier", e.Medium,
		"block_size", e.BlockSize, "expected_block_size", want, "expected_from", from, "chunked_offload", n}
	if e.BlockSize%want == 0 {
		args = append(args, "blocks_per_chunk", e.BlockSize/want)
	}
	leftOut, ok := w.p.limited.allow(chunkedOffloadLog)
	if !ok {
		return true
	}
	w.p.log.Warn(chunkedOffloadLog, withLeftOut(args, leftOut)...)
	return true
}

// routerBlockSize is the block size the router hashes with, 0 when the
// subscriber has no hasher.
func (w *worker) routerBlockSize() int {
	switch {
	case w.p.cfg.Hasher != nil:
		return w.p.cfg.Hasher.Config().BlockSize
	case w.p.cfg.ContentKeys != nil:
		return w.p.cfg.ContentKeys.Config().BlockSize
	}
	return 0
}
