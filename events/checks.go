package events

import (
	"fmt"
	"time"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/internal/ratelog"
)

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
	w.p.log.Error(hashMismatchLog+diag, ratelog.WithLeftOut(args, leftOut)...)
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
	w.p.log.Warn(chunkedOffloadLog, ratelog.WithLeftOut(args, leftOut)...)
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
