package events

import (
	"log/slog"

	"github.com/kvsource/kvsource/index"
)

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

func (w *worker) decodeError(pod string, seq uint64, err error) {
	w.p.c[cDecodeErrors].Add(1)
	if n := w.p.errCount(pod); n != nil {
		n.Add(1)
	}
	w.p.limited.logf(slog.LevelError, "events: dropped malformed payload", pod, "seq", seq, "err", err)
}
