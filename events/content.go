package events

import (
	"log/slog"

	"github.com/kvsource/kvsource/index"
)

// contentMap maps a holder's engine block keys to content keys. It holds at
// most limit entries in two generations: when the current one is half full
// it becomes the old one and the previous old one is dropped, so entries
// used within the last limit/2 insertions survive.
type contentMap struct {
	cur, old map[uint64]uint64
	limit    int
}

func newContentMap(limit int) *contentMap {
	return &contentMap{cur: map[uint64]uint64{}, limit: max(limit, 2)}
}

func (m *contentMap) get(k uint64) (uint64, bool) {
	if v, ok := m.cur[k]; ok {
		return v, true
	}
	if v, ok := m.old[k]; ok {
		m.put(k, v)
		return v, true
	}
	return 0, false
}

func (m *contentMap) put(k, v uint64) {
	if _, ok := m.cur[k]; !ok && len(m.cur) >= m.limit/2 {
		m.old, m.cur = m.cur, make(map[uint64]uint64, len(m.cur))
	}
	m.cur[k] = v
}

func (m *contentMap) len() int { return len(m.cur) + len(m.old) }

func (m *contentMap) reset() {
	m.cur, m.old = map[uint64]uint64{}, nil
}

// storeContent applies a BlockStored in content-key mode: keys are computed
// from the event's tokens, chained on the parent's content key, and
// remembered for later events that name the blocks by engine key only.
func (w *worker) storeContent(h *holder, e *Event, seq uint64) {
	n := len(e.BlockHashes)
	if n == 0 {
		return
	}
	ck := w.p.cfg.ContentKeys
	var parent index.Parent
	if ep, has := e.Parent.Get(); has {
		p, ok := h.content.get(ep)
		if !ok && len(e.TokenIDs) > 0 {
			// The chain cannot continue from an unknown block; storing the
			// blocks as a new chain would claim a prefix they are not.
			w.unresolvedBlocks(n)
			return
		}
		if ok {
			parent = index.ParentKey(p)
		}
	}
	if len(e.TokenIDs) == 0 {
		keys := w.resolvePrefix(h, e.BlockHashes)
		if len(keys) < n {
			w.p.c[cTokenless].Add(1)
			h.c[cTokenless].Add(1)
			w.p.limited.logf(slog.LevelWarn, "events: content-key mode cannot resolve a BlockStored without token ids; "+
				"its blocks are left out (vLLM sends tokens with self-describing events, e.g. the offloading connector's self_describing_kv_events)",
				h.id.Pod, "rank", h.id.Rank, "seq", seq, "blocks", n, "resolved", len(keys))
		}
		if len(keys) > 0 {
			w.p.cfg.Sink.Store(index.Blocks{Model: h.model, Holder: h.id, Tier: e.Medium, Group: e.GroupIdx.Or(0), Parent: parent, Keys: keys})
		}
		return
	}
	if len(e.TokenIDs) != n*e.BlockSize || e.BlockSize != ck.Config().BlockSize {
		// Hybrid events that skip blocks, or another block size: the
		// content chain cannot be rebuilt.
		w.unresolvedBlocks(n)
		return
	}
	req, err := w.request(e, e.TokenIDs)
	if err == nil {
		if p, ok := parent.Key(); ok {
			w.keys2, err = ck.BlockKeysFrom(w.keys2[:0], p, req)
		} else {
			w.keys2, err = ck.BlockKeys(w.keys2[:0], req)
		}
	}
	if err != nil || len(w.keys2) != n {
		w.p.limited.logf(slog.LevelWarn, "events: content keys not computable", h.id.Pod, "rank", h.id.Rank, "err", err)
		w.unresolvedBlocks(n)
		return
	}
	for i, k := range e.BlockHashes {
		h.content.put(k, w.keys2[i])
	}
	w.p.cfg.Sink.Store(index.Blocks{Model: h.model, Holder: h.id, Tier: e.Medium, Group: e.GroupIdx.Or(0), Parent: parent, Keys: w.keys2})
}

// resolvePrefix maps engine keys to content keys up to the first unknown
// one; the rest are counted as unresolved.
func (w *worker) resolvePrefix(h *holder, keys []uint64) []uint64 {
	w.keys2 = w.keys2[:0]
	for i, k := range keys {
		c, ok := h.content.get(k)
		if !ok {
			w.unresolvedBlocks(len(keys) - i)
			break
		}
		w.keys2 = append(w.keys2, c)
	}
	return w.keys2
}

// resolve maps engine keys to content keys, skipping (and counting) unknown
// ones.
func (w *worker) resolve(h *holder, keys []uint64) []uint64 {
	w.keys2 = w.keys2[:0]
	for _, k := range keys {
		if c, ok := h.content.get(k); ok {
			w.keys2 = append(w.keys2, c)
		} else {
			w.unresolvedBlocks(1)
		}
	}
	return w.keys2
}

func (w *worker) unresolvedBlocks(n int) { w.p.c[cUnresolved].Add(uint64(n)) }
