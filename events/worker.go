package events

import (
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

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
