package events

import (
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// holder is one (pod, rank) stream. The worker owning the pod alone writes
// it; Status reads only the atomics.
type holder struct {
	id    index.Holder
	src   *source
	model string

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

	lastSeq, gaps, replays, unrecovered, restarts atomic.Uint64
	hashChecks, hashMismatches, chunkedOffload    atomic.Uint64
	stale                                         atomic.Bool
}

func (h *holder) status() HolderStatus {
	st := HolderStatus{
		Pod: h.id.Pod, Rank: h.id.Rank, LastSeq: h.lastSeq.Load(), Gaps: h.gaps.Load(),
		Replays: h.replays.Load(), Unrecovered: h.unrecovered.Load(), Restarts: h.restarts.Load(),
		HashChecks: h.hashChecks.Load(), HashMismatches: h.hashMismatches.Load(),
		ChunkedOffload: h.chunkedOffload.Load(), State: "live",
	}
	if m := h.statModel.Load(); m != nil {
		st.Model = *m
	}
	if h.stale.Load() {
		st.State = "stale"
	}
	return st
}

func (h *holder) setStale() { h.stale.Store(h.keepStale || h.resyncing) }

type worker struct {
	s       *Subscriber
	in      chan message
	holders map[index.Holder]*holder

	dec, rdec     *Decoder
	xdec          *Decoder // extra-keys tuples of the batch dec decoded
	batch, rbatch Batch
	keys, keys2   []uint64
	extra         [][]hashing.ExtraKey

	// congested is the receive loop's: an enqueue to this worker timed out
	// and none has succeeded since.
	congested bool
	// queued is the payload bytes of the messages queued for this worker
	// and of the one it is applying (Config.QueueBytes).
	queued atomic.Int64

	resyncMu   sync.Mutex
	resyncPods map[string]uint64 // pod -> highest dropped sequence number
	resyncSig  chan struct{}
}

func newWorker(s *Subscriber) *worker {
	return &worker{
		s: s, in: make(chan message, s.cfg.QueueLen), holders: map[index.Holder]*holder{},
		dec: NewDecoder(), rdec: NewDecoder(), xdec: NewDecoder(),
		resyncPods: map[string]uint64{}, resyncSig: make(chan struct{}, 1),
	}
}

func (w *worker) run() {
	for {
		select {
		case m, ok := <-w.in:
			if !ok {
				return
			}
			w.handle(m)
			w.queued.Add(-int64(len(m.payload)))
		case <-w.resyncSig:
			w.resync()
		}
	}
}

// markResync is called by the receive loop after dropping message seq of
// pod.
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

// resync handles pods that lost a message to a full queue: holders with a
// replay endpoint fetch everything after what they applied; the others, and
// those whose replay failed, are stale until their next message shows the
// gap, which the gap policy then resolves. Older messages still queued do
// not end that: they precede the dropped ones. (The dropped message's rank
// is unknown, so each holder of the pod waits for the same number.)
func (w *worker) resync() {
	w.resyncMu.Lock()
	pods := w.resyncPods
	w.resyncPods = map[string]uint64{}
	w.resyncMu.Unlock()
	for _, h := range w.holders {
		dropped, ok := pods[h.id.Pod]
		if !ok || !h.started {
			continue
		}
		if ep := replayFor(h.src, h.id.Rank); ep != "" {
			answered := h.replays.Load()
			// No end target: dropped is the pod's, and may belong to another
			// rank's sequence; ReplayDeadline bounds the replay instead.
			w.replay(h, ep, h.next, noTarget)
			if h.replays.Load() != answered {
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

// replayFor returns the replay endpoint serving rank of src, "" when none.
func replayFor(src *source, rank int) string {
	if src.replay == "" || !src.perRank || rank == 0 {
		return src.replay
	}
	return offsetPort(src.replay, rank)
}

// offsetPort adds off to a tcp:// endpoint's port, as vLLM does for
// data-parallel ranks; other transports get a "_dp<rank>" suffix.
func offsetPort(ep string, off int) string {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return ep + "_dp" + strconv.Itoa(off)
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return ep
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return ep
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+off))
}

// holder returns the holder of rank of src, creating it when new; nil, the
// message counted and logged as dropped, when it is new and the subscriber
// holds Config.MaxHolders holders already.
func (w *worker) holder(src *source, rank int, model string, seq uint64) *holder {
	id := index.Holder{Pod: src.pod, Rank: rank}
	h := w.holders[id]
	if h == nil {
		if w.s.nHolders.Add(1) > int64(w.s.cfg.MaxHolders) {
			w.s.nHolders.Add(-1)
			w.s.c.holderLimit.Add(1)
			// Limited across pods: a peer inventing names must not flood
			// the log either.
			w.s.limited.logAny(slog.LevelWarn, "events: holder limit reached, dropping a new holder's message",
				src.pod, "rank", rank, "seq", seq, "max_holders", w.s.cfg.MaxHolders)
			return nil
		}
		h = &holder{id: id}
		if seq, ok := w.s.cfg.InitialSeqs[id]; ok {
			h.started, h.next, h.liveMax = true, seq+1, seq
			h.lastSeq.Store(seq)
		}
		if w.s.cfg.ContentKeys != nil {
			h.content = newContentMap(w.s.cfg.ContentMapSize)
		}
		w.holders[id] = h
		w.s.holders.Store(id, h)
	}
	h.src = src
	if h.model != model {
		h.model = model
		h.statModel.Store(&model)
	}
	return h
}

func (w *worker) handle(m message) {
	if err := w.dec.Decode(m.payload, &w.batch); err != nil {
		w.decodeError(m.src.pod, m.seq, err)
		return
	}
	h := w.holder(m.src, w.batch.DPRank, m.model, m.seq)
	if h == nil {
		return
	}
	seq := m.seq
	switch {
	case !h.started:
		h.started = true
		w.catchUp(h, seq)
	case seq == h.next:
	case seq > h.next:
		w.s.c.gaps.Add(1)
		h.gaps.Add(1)
		w.s.limited.logf(slog.LevelWarn, "events: sequence gap", h.id.Pod, "rank", h.id.Rank, "expected", h.next, "seq", seq)
		if ep := replayFor(h.src, h.id.Rank); ep != "" {
			w.replay(h, ep, h.next, seq)
		}
		if seq > h.next {
			w.unrecovered(h, h.next, seq-1, "no replay endpoint or replay failed")
		}
	case seq > h.liveMax:
		// Already applied from a replay that ran ahead of the live stream.
		w.s.c.dups.Add(1)
		h.liveMax = seq
		return
	default:
		w.restart(h, seq)
		w.catchUp(h, seq)
	}
	h.liveMax = max(h.liveMax, seq)
	if seq < h.next {
		w.s.c.dups.Add(1)
		return
	}
	w.apply(h, &w.batch, seq)
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
	ep := replayFor(h.src, h.id.Rank)
	if ep == "" || seq == 0 {
		return
	}
	h.next = 0
	w.replay(h, ep, 0, seq)
	switch {
	case h.next == 0:
		h.next = seq
	case h.next < seq:
		w.unrecovered(h, h.next, seq-1, "replay ended early")
	}
}

func (w *worker) decodeError(pod string, seq uint64, err error) {
	w.s.c.decodeErrors.Add(1)
	if pc := w.s.podCounters(pod); pc != nil {
		pc.decodeErrors.Add(1)
	}
	w.s.limited.logf(slog.LevelError, "events: dropped malformed payload", pod, "seq", seq, "err", err)
}

// restart handles a sequence number that went backwards: a new engine
// process with an empty cache.
func (w *worker) restart(h *holder, seq uint64) {
	w.s.c.restarts.Add(1)
	h.restarts.Add(1)
	w.s.log.Warn("events: engine restarted (sequence went backwards), clearing its entries",
		"pod", h.id.Pod, "rank", h.id.Rank, "last_seq", h.next-1, "seq", seq)
	w.s.cfg.Sink.ClearHolder(h.model, h.id, "")
	if h.content != nil {
		h.content.reset()
	}
	h.next, h.liveMax = seq, seq
	h.keepStale, h.resyncing = false, false
	h.matched = false
	h.gpuBlockSize = h.gpuBlockSize[:0]
	h.setStale()
}

// unrecovered applies the gap policy to a range of batches that are lost.
func (w *worker) unrecovered(h *holder, from, to uint64, why string) {
	w.s.c.unrecovered.Add(1)
	h.unrecovered.Add(1)
	if to >= h.resyncSeq {
		h.resyncing = false
	}
	if w.s.cfg.Gap == GapKeep {
		w.s.limited.logf(slog.LevelWarn, "events: lost batches, holder stale until the engine clears or restarts",
			h.id.Pod, "rank", h.id.Rank, "from", from, "to", to, "why", why)
		h.keepStale = true
	} else {
		w.s.limited.logf(slog.LevelWarn, "events: lost batches, clearing the holder's entries",
			h.id.Pod, "rank", h.id.Rank, "from", from, "to", to, "why", why)
		w.s.cfg.Sink.ClearHolder(h.model, h.id, "")
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
// and an endpoint sending ever more must not hold the worker. A range the
// engine no longer buffers is handed to the gap policy (except before h's
// first batch).
func (w *worker) replay(h *holder, endpoint string, from, until uint64) {
	if time.Now().Before(h.replayAfter) {
		return
	}
	sock, err := zmq.NewSocket(zmq.DEALER)
	if err != nil {
		w.replayFailed(h, endpoint, err)
		return
	}
	defer sock.Close()
	_ = sock.SetLinger(0)
	if err := sock.Connect(endpoint); err != nil {
		w.replayFailed(h, endpoint, err)
		return
	}
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], from)
	if _, err := sock.SendMessage("", start[:]); err != nil {
		w.replayFailed(h, endpoint, err)
		return
	}
	fresh := h.next == 0 && from == 0
	// idle bounds the wait for the next message, end the whole replay: a
	// trickling endpoint never lets idle run out.
	end := time.Now().Add(w.s.cfg.ReplayDeadline)
	idle := time.Now().Add(w.s.cfg.ReplayTimeout)
	poller := zmq.NewPoller()
	poller.Add(sock, zmq.POLLIN)
	for {
		left := min(time.Until(idle), time.Until(end))
		if left <= 0 {
			w.s.c.replayTimeouts.Add(1)
			if time.Now().Before(end) {
				w.replayFailed(h, endpoint, fmt.Errorf("no reply message for %v", w.s.cfg.ReplayTimeout))
			} else {
				w.replayFailed(h, endpoint, fmt.Errorf("not complete after %v", w.s.cfg.ReplayDeadline))
			}
			return
		}
		polled, err := poller.Poll(left)
		if err != nil {
			w.replayFailed(h, endpoint, err)
			return
		}
		if len(polled) == 0 {
			continue
		}
		frames, err := sock.RecvMessageBytes(0)
		if err != nil {
			w.replayFailed(h, endpoint, err)
			return
		}
		idle = time.Now().Add(w.s.cfg.ReplayTimeout)
		// v26: [empty, topic, seq, payload]; v25: [empty, seq, payload].
		if (len(frames) != 3 && len(frames) != 4) || len(frames[0]) != 0 || len(frames[len(frames)-2]) != 8 {
			w.replayFailed(h, endpoint, fmt.Errorf("bad reply framing (%d frames)", len(frames)))
			return
		}
		seqb := frames[len(frames)-2]
		seq := binary.BigEndian.Uint64(seqb)
		if seq == ^uint64(0) {
			w.replayAnswered(h)
			return
		}
		if seq < h.next {
			continue
		}
		if err := w.rdec.Decode(frames[len(frames)-1], &w.rbatch); err != nil {
			w.decodeError(h.id.Pod, seq, err)
			continue
		}
		if w.rbatch.DPRank != h.id.Rank {
			continue
		}
		if seq >= until {
			// Past the target without reaching it: the endpoint no longer
			// has the rest.
			if h.next < until && !fresh {
				w.unrecovered(h, h.next, until-1, "range no longer in the replay buffer")
			}
			w.replayAnswered(h)
			return
		}
		if seq > h.next && !fresh {
			w.unrecovered(h, h.next, seq-1, "range no longer in the replay buffer")
		}
		fresh = false
		w.s.c.replayed.Add(1)
		w.apply(h, &w.rbatch, seq)
		if h.next >= until {
			w.replayAnswered(h)
			return
		}
	}
}

func (w *worker) replayAnswered(h *holder) {
	w.s.c.replays.Add(1)
	h.replays.Add(1)
}

// replayBackoff is how long a holder whose replay failed goes without
// trying again: a dead replay endpoint must not stall its worker on every
// gap.
const replayBackoff = 30 * time.Second

func (w *worker) replayFailed(h *holder, endpoint string, err error) {
	h.replayAfter = time.Now().Add(replayBackoff)
	w.s.c.replayErrors.Add(1)
	w.s.limited.logf(slog.LevelWarn, "events: replay failed", h.id.Pod, "rank", h.id.Rank, "endpoint", endpoint, "err", err)
}

// apply applies one batch of h with sequence number seq to the sink.
func (w *worker) apply(h *holder, b *Batch, seq uint64) {
	sink := w.s.cfg.Sink
	var blocks uint64
	for i := range b.Events {
		e := &b.Events[i]
		switch e.Type {
		case EventBlockStored:
			blocks += uint64(len(e.BlockHashes))
			// A chunked offload event's block size is not the engine's
			// hashing block size; the agreement check would blame the
			// router's settings for it.
			chunked := w.checkOffloadBlockSize(h, e, seq)
			if w.s.cfg.Hasher != nil && !chunked {
				w.checkAgreement(h, e, seq)
			}
			if h.content != nil {
				w.storeContent(h, e)
				continue
			}
			switch {
			case len(e.BlockHashes) == 0:
			case len(e.TokenIDs) > len(e.BlockHashes)*e.BlockSize:
				// A hybrid group skipped blocks: which ones is unknown, so
				// neither the parent nor any two keys are known to be
				// consecutive, and the index must not chain them.
				for j := range e.BlockHashes {
					sink.Store(h.model, h.id, e.Medium, e.GroupIdx, 0, false, e.BlockHashes[j:j+1])
				}
			default:
				sink.Store(h.model, h.id, e.Medium, e.GroupIdx, e.Parent, e.HasParent, e.BlockHashes)
			}
		case EventBlockRemoved:
			blocks += uint64(len(e.BlockHashes))
			keys := e.BlockHashes
			if h.content != nil {
				keys = w.resolve(h, keys)
			}
			if len(keys) > 0 {
				sink.Remove(h.model, h.id, e.Medium, e.GroupIdx, keys)
			}
		case EventAllBlocksCleared:
			// vLLM's prefix-cache reset; every tier is cleared, so that no
			// pull is ever sent for a block the reset dropped.
			sink.ClearHolder(h.model, h.id, "")
			h.keepStale = false
		default:
			w.s.c.unknown.Add(1)
			continue
		}
	}
	w.s.c.events.Add(uint64(len(b.Events)))
	w.s.c.blocks.Add(blocks)
	w.s.c.batches.Add(1)
	h.next = seq + 1
	if seq >= h.resyncSeq {
		h.resyncing = false
	}
	h.lastSeq.Store(seq)
	h.setStale()
}

// request returns the hashing request for tokens, the leading blocks of e,
// that reproduces e's extra keys: the event's own tuples when it carries
// any, else its LoRA name. Only those blocks' tuples are converted, so that
// checking the leading blocks of a long event stays cheap.
func (w *worker) request(e *Event, tokens []uint32) (hashing.Request, error) {
	req := hashing.Request{Tokens: tokens}
	if !e.HasExtraKeys {
		req.LoRAName = e.LoRAName
		return req, nil
	}
	extra := e.ExtraKeys
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

// checkBlocks is how many leading blocks the hash agreement check rehashes.
const checkBlocks = 2

// checkAgreement recomputes the keys of a BlockStored that starts at block 0
// and compares them with the engine's.
func (w *worker) checkAgreement(h *holder, e *Event, seq uint64) {
	n := len(e.BlockHashes)
	// Block size 0 is a token-less offload event (vLLM's newer connector):
	// nothing to rehash, though its lengths agree.
	if e.HasParent || n == 0 || e.GroupIdx != 0 || e.BlockSize <= 0 || len(e.TokenIDs) != n*e.BlockSize {
		return
	}
	w.s.c.hashChecks.Add(1)
	h.hashChecks.Add(1)
	cfg := w.s.cfg.Hasher.Config()
	cause := ""
	if e.BlockSize != cfg.BlockSize {
		cause = fmt.Sprintf("block size: the engine uses %d, the router %d", e.BlockSize, cfg.BlockSize)
	} else {
		// Algorithm, seed and key form all show in block 0 and the chaining
		// in block 1, so two blocks keep the check cheap on every event.
		n = min(n, checkBlocks)
		req, err := w.request(e, e.TokenIDs[:n*e.BlockSize])
		if err == nil {
			if req.Extra != nil {
				req.Extra = req.Extra[:n]
			}
			w.keys, err = w.s.cfg.Hasher.BlockKeys(w.keys[:0], req)
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
	if !e.HasExtraKeys && e.BlockSize == cfg.BlockSize && h.matched {
		return
	}
	w.s.c.hashMismatches.Add(1)
	h.hashMismatches.Add(1)
	now := time.Now()
	if now.Sub(h.lastLog) < w.s.cfg.MismatchLogInterval {
		return
	}
	h.lastLog = now
	w.s.log.Error("events: engine block hashes disagree with the router's hashing; lookups for this holder will miss. "+
		"Likely causes: a different --prefix-caching-hash-algo, PYTHONHASHSEED (xxhash algorithms need an explicit seed), "+
		"block size, or VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES setting than the router's hashing.Config; "+
		"if the engine's hashes cannot be reproduced, use content-key mode",
		"pod", h.id.Pod, "rank", h.id.Rank, "model", h.model, "seq", seq, "detail", cause,
		"router_algo", string(cfg.Algo), "router_block_size", cfg.BlockSize, "engine_block_size", e.BlockSize,
		"mismatches", h.hashMismatches.Load())
}

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
	g := e.GroupIdx
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
	w.s.c.chunkedOffload.Add(1)
	n := h.chunkedOffload.Add(1)
	now := time.Now()
	if now.Sub(h.lastChunkLog) < w.s.cfg.MismatchLogInterval {
		return true
	}
	h.lastChunkLog = now
	args := []any{"pod", h.id.Pod, "rank", h.id.Rank, "model", h.model, "seq", seq, "tier", e.Medium,
		"block_size", e.BlockSize, "expected_block_size", want, "expected_from", from, "chunked_offload", n}
	if e.BlockSize%want == 0 {
		args = append(args, "blocks_per_chunk", e.BlockSize/want)
	}
	w.s.log.Warn("events: offload tier stores chunks of several GPU blocks, keyed by each chunk's last block; "+
		"CPU-tier lookups will undercount: configure the offloading connector's block_size equal to the GPU block size",
		args...)
	return true
}

// routerBlockSize is the block size the router hashes with, 0 when the
// subscriber has no hasher.
func (w *worker) routerBlockSize() int {
	switch {
	case w.s.cfg.Hasher != nil:
		return w.s.cfg.Hasher.Config().BlockSize
	case w.s.cfg.ContentKeys != nil:
		return w.s.cfg.ContentKeys.Config().BlockSize
	}
	return 0
}
