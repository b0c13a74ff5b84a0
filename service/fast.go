package service

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"net/http"
	"slices"
	"strconv"
	"sync"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/jsonw"
	"github.com/kvsource/kvsource/internal/tokjson"
	"github.com/kvsource/kvsource/picker"
)

// The request path of /v1/score and /v1/pick: the body is read into a
// pooled buffer, its tokens decoded by tokjson into a pooled []uint32 (the
// only copy of the prompt besides the body), and the answer appended into a
// pooled buffer by hand. encoding/json, reflection and a string per block
// key (a pick's missing_blocks) cost 18 times the SDK's Pick on a
// 20,000-token prompt; see BenchmarkServe in BENCHMARKS.md.

// bodyBuf is one request's working memory.
type bodyBuf struct {
	body []byte
	// held is how much of body counts against --max-body-memory.
	held   int64
	tokens []uint32
	out    []byte
	// keys are the prompt's block keys, for a pick's KV hint.
	keys   []uint64
	scores []picker.Score
	pods   []podScoreAnswer
}

var bodyBufPool = sync.Pool{New: func() any { return new(bodyBuf) }}

// keepBytes bounds the buffers a bodyBuf keeps in the pool, so that
// one huge prompt does not pin its memory for good.
const keepBytes = 1 << 20

func getBuf() *bodyBuf { return bodyBufPool.Get().(*bodyBuf) }

func putBuf(b *bodyBuf) {
	if cap(b.body) > keepBytes {
		b.body = nil
	}
	if cap(b.tokens) > keepBytes/4 {
		b.tokens = nil
	}
	if cap(b.out) > keepBytes {
		b.out = nil
	}
	if cap(b.keys) > keepBytes/8 {
		b.keys = nil
	}
	// The scores keep their Tiers slices for the next Score to reuse.
	b.scores = b.scores[:0]
	clear(b.pods)
	b.pods = b.pods[:0]
	bodyBufPool.Put(b)
}

// readBody reads r's body, which admit bounds, into b.body[:0], counting
// it against --max-body-memory as the bytes arrive; the caller releases
// what it counted (b.held) when it is done with the body.
func (s *Service) readBody(r *http.Request, b *bodyBuf) error {
	buf := b.body[:0]
	if r.ContentLength > 0 && r.ContentLength < int64(cap(buf)) {
		// A buffer of the pool large enough: reading EOF does not grow it.
		buf = buf[: 0 : r.ContentLength+1]
	}
	defer func() { b.body = buf }()
	for {
		if len(buf) == cap(buf) {
			// Grown as the body arrives, not to its declared length: a
			// client that declares a large body and sends it slowly holds
			// only what it sent.
			grow := max(512, cap(buf))
			if rest := r.ContentLength - int64(len(buf)) + 1; rest > 0 && rest < int64(grow) {
				grow = int(rest)
			}
			buf = slices.Grow(buf, grow)
		}
		n, err := r.Body.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		// Counted as a buffer grown for the bytes received would be, by
		// doubling: the memory a body holds, not just its bytes, and no
		// more for a buffer the pool lent with room to spare.
		if got := int64(len(buf)); got > b.held {
			want := max(512, 2*b.held, got)
			if !s.reserveBody(want - b.held) {
				return errBodyMemory
			}
			b.held = want
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return badRequest{fmt.Errorf("reading request: %w", err)}
		}
	}
}

// decodePrompt decodes a /v1/score or /v1/pick body, read into b.body,
// into v, whose prompt is p, with the tokens (from "tokens" or
// "tokens_b64") in b.tokens.
func decodePrompt(b *bodyBuf, v any, p *Prompt) error {
	toks, err := tokjson.Unmarshal(b.body, v, b.tokens)
	if err != nil {
		return badRequest{fmt.Errorf("decoding request: %w", typeError(err, v))}
	}
	if cap(toks) > cap(b.tokens) {
		b.tokens = toks[:0]
	}
	p.Tokens = toks
	return nil
}

// writeBody writes a JSON answer whose bytes are body.
func writeBody(w http.ResponseWriter, code int, body []byte) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(code)
	_, _ = w.Write(body)
}

// errServeNonFinite reports a score or saving that JSON cannot carry.
var errServeNonFinite = errors.New("non-finite number in the answer")

// pickAnswer is a pick's answer: PickResponse's JSON, encoded
// without a string per missing key or the header's map.
type pickAnswer struct {
	d *picker.Decision
	// kv is the decision's kv_transfer_params; saving whether the answer
	// carries predicted_saving_ms (with --calibration, for a pull).
	kv     picker.KVTransferParams
	saving bool
	// hint is the pick's KV hint, nil without KVCR endpoints.
	hint *hintAnswer
}

// response is the answer as PickResponse, the schema appendJSON
// encodes.
func (a *pickAnswer) response() (PickResponse, error) {
	d := a.d
	resp := PickResponse{
		Destination: d.Destination.Pod, DestinationDPRank: d.Destination.Rank, Reason: d.Reason,
		Blocks: d.Blocks, BlockSize: d.BlockSize, DestinationCachedBlocks: d.Cached,
		SourceBlocks: d.Gain, BestSourceBlocks: d.Best, RecomputeBlocks: d.Recompute,
		SkippedSources: d.Skipped, SkippedState: d.SkippedState,
		MissingBlocks: keysJSON(d.Missing), Header: map[string]string{}, KVTransferParams: KVTransferParams{RemoteKVSource: a.kv.RemoteKVSource},
	}
	if d.Reason == picker.ReasonPull {
		resp.Source, resp.SourceDPRank = &d.Source.Pod, &d.Source.Rank
		if a.saving {
			resp.PredictedSavingMillis = &d.SavingMillis
		}
		name, value := d.Header()
		resp.Header[name] = value
	}
	return resp, a.hint.set(&resp)
}

// appendJSON appends the answer as encoding/json's Encoder encodes
// response(), newline included.
func (a *pickAnswer) appendJSON(b []byte) ([]byte, error) {
	d := a.d
	pull := d.Reason == picker.ReasonPull
	b = append(b, `{"destination":`...)
	b = jsonw.AppendString(b, d.Destination.Pod)
	b = append(b, `,"destination_dp_rank":`...)
	b = strconv.AppendInt(b, int64(d.Destination.Rank), 10)
	b = append(b, `,"source":`...)
	if pull {
		b = jsonw.AppendString(b, d.Source.Pod)
		b = append(b, `,"source_dp_rank":`...)
		b = strconv.AppendInt(b, int64(d.Source.Rank), 10)
	} else {
		b = append(b, "null"...)
	}
	b = append(b, `,"reason":`...)
	b = jsonw.AppendString(b, string(d.Reason))
	for _, f := range [...]struct {
		name string
		v    int
	}{{`,"blocks":`, d.Blocks}, {`,"block_size":`, d.BlockSize}, {`,"destination_cached_blocks":`, d.Cached},
		{`,"source_blocks":`, d.Gain}, {`,"best_source_blocks":`, d.Best}, {`,"skipped_sources":`, d.Skipped}} {
		b = append(b, f.name...)
		b = strconv.AppendInt(b, int64(f.v), 10)
	}
	if d.SkippedState != "" {
		b = append(b, `,"skipped_state":`...)
		b = jsonw.AppendString(b, d.SkippedState)
	}
	b = append(b, `,"recompute_blocks":`...)
	b = strconv.AppendInt(b, int64(d.Recompute), 10)
	if pull && a.saving {
		b = append(b, `,"predicted_saving_ms":`...)
		var ok bool
		if b, ok = appendFloat(b, d.SavingMillis); !ok {
			return b, errServeNonFinite
		}
	}
	b = append(b, `,"missing_blocks":[`...)
	b = appendKeys(b, d.Missing)
	b = append(b, `],"header":{`...)
	if pull {
		name, value := d.Header()
		b = jsonw.AppendString(b, name)
		b = append(b, ':')
		b = jsonw.AppendString(b, value)
	}
	b = append(b, `},"kv_transfer_params":{`...)
	if src := a.kv.RemoteKVSource; src != nil {
		b = append(b, `"remote_kv_source":{"kv_request_id":`...)
		b = jsonw.AppendString(b, src.KVRequestID)
		b = append(b, `,"remote_host":`...)
		b = jsonw.AppendString(b, src.RemoteHost)
		b = append(b, `,"remote_port":`...)
		b = strconv.AppendInt(b, int64(src.RemotePort), 10)
		b = append(b, '}')
	}
	var err error
	if a.hint.inParams() {
		if b, err = a.hint.appendParams(b, a.kv.RemoteKVSource != nil); err != nil {
			return b, err
		}
	}
	b = append(b, '}')
	if a.hint.topLevel() {
		b = append(b, `,"kv_hints":`...)
		if b, err = a.hint.hint.AppendEnvelope(b); err != nil {
			return b, err
		}
	}
	if a.hint != nil {
		b = append(b, `,"hint_reason":`...)
		b = jsonw.AppendString(b, string(a.hint.reason))
	}
	return append(b, "}\n"...), nil
}

// scoreAnswer is a score's answer: ScoreResponse's JSON, encoded
// without a map per pod.
type scoreAnswer struct {
	model  string
	blocks int
	pods   []podScoreAnswer
}

type podScoreAnswer struct {
	holder  index.Holder
	matched int
	tiers   []index.TierPrefix
	score   float64
}

// response is the answer as ScoreResponse, the schema appendJSON
// encodes.
func (a *scoreAnswer) response() ScoreResponse {
	resp := ScoreResponse{Model: a.model, Blocks: a.blocks, Pods: []PodScore{}}
	for _, p := range a.pods {
		resp.Pods = append(resp.Pods, PodScore{Pod: p.holder.Pod, DPRank: p.holder.Rank,
			MatchedBlocks: p.matched, Tiers: tiersJSON(p.tiers), Score: p.score})
	}
	return resp
}

// appendJSON appends the answer as encoding/json's Encoder encodes
// response(), newline included.
func (a *scoreAnswer) appendJSON(b []byte) ([]byte, error) {
	b = append(b, `{"model":`...)
	b = jsonw.AppendString(b, a.model)
	b = append(b, `,"blocks":`...)
	b = strconv.AppendInt(b, int64(a.blocks), 10)
	b = append(b, `,"pods":[`...)
	for i, p := range a.pods {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"pod":`...)
		b = jsonw.AppendString(b, p.holder.Pod)
		b = append(b, `,"dp_rank":`...)
		b = strconv.AppendInt(b, int64(p.holder.Rank), 10)
		b = append(b, `,"matched_blocks":`...)
		b = strconv.AppendInt(b, int64(p.matched), 10)
		b = append(b, `,"tiers":`...)
		b = appendTiers(b, p.tiers)
		b = append(b, `,"score":`...)
		var ok bool
		if b, ok = appendFloat(b, p.score); !ok {
			return b, errServeNonFinite
		}
		b = append(b, '}')
	}
	return append(b, "]}\n"...), nil
}

// appendTiers appends tiersJSON(tp) as encoding/json encodes the
// map: GPU and CPU always, keys sorted, a later prefix of a tier replacing
// an earlier one.
func appendTiers(b []byte, tp []index.TierPrefix) []byte {
	var fixed [8]index.TierPrefix
	ts := append(fixed[:0], index.TierPrefix{Tier: index.TierGPU}, index.TierPrefix{Tier: index.TierCPU})
	for _, t := range tp {
		if i := slices.IndexFunc(ts, func(x index.TierPrefix) bool { return x.Tier == t.Tier }); i >= 0 {
			ts[i].Blocks = t.Blocks
		} else {
			ts = append(ts, t)
		}
	}
	// A few entries: an insertion sort, without the generic sort's closure.
	for i := 1; i < len(ts); i++ {
		for j := i; j > 0 && ts[j].Tier < ts[j-1].Tier; j-- {
			ts[j], ts[j-1] = ts[j-1], ts[j]
		}
	}
	b = append(b, '{')
	for i, t := range ts {
		if i > 0 {
			b = append(b, ',')
		}
		b = jsonw.AppendString(b, t.Tier)
		b = append(b, ':')
		b = strconv.AppendInt(b, int64(t.Blocks), 10)
	}
	return append(b, '}')
}

// appendFloat appends f as encoding/json encodes a float64; ok is
// false for NaN and infinities, which it refuses.
func appendFloat(b []byte, f float64) ([]byte, bool) {
	if math.IsInf(f, 0) || math.IsNaN(f) {
		return b, false
	}
	format := byte('f')
	if abs := math.Abs(f); abs != 0 && (abs < 1e-6 || abs >= 1e21) {
		format = 'e'
	}
	b = strconv.AppendFloat(b, f, format, -1, 64)
	if format == 'e' {
		// Clean up e-09 to e-9, as encoding/json does.
		if n := len(b); n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
			b[n-2] = b[n-1]
			b = b[:n-1]
		}
	}
	return b, true
}

// appendKeys appends keys as JSON strings of their decimal digits,
// comma-separated. Block keys are mostly 19 or 20 digits: split in three
// parts of at most 8 by two divisions by constants, each part turned into
// its 8 ASCII digits at once in a 64-bit word (digits8) and stored
// whole into room reserved per key, it takes about half of strconv's time
// (938 keys were a fifth of a 20,000-token pull answer's encoding).
func appendKeys(b []byte, keys []uint64) []byte {
	const room = 24 // ',' '"' 20 digits '"', and the 8-byte stores' slack
	b = slices.Grow(b, room*len(keys)+8)
	for i, k := range keys {
		n := len(b)
		w := b[n : n+room+8]
		o := 0
		if i > 0 {
			w[0] = ','
			o = 1
		}
		w[o] = '"'
		o++
		if k >= 1e16 {
			hi, rest := k/1e16, k%1e16 // hi < 1845
			h := digits8(uint32(hi))
			nd := 8 - bits.TrailingZeros64(h^0x3030303030303030)/8 // hi's digits, leading zeros left out
			binary.LittleEndian.PutUint64(w[o:], h>>(64-8*nd))
			o += nd
			binary.LittleEndian.PutUint64(w[o:], digits8(uint32(rest/1e8)))
			binary.LittleEndian.PutUint64(w[o+8:], digits8(uint32(rest%1e8)))
			o += 16
		} else {
			o += len(strconv.AppendUint(w[o:o], k, 10))
		}
		w[o] = '"'
		b = b[:n+o+1]
	}
	return b
}

// digits8 returns v < 1e8 as 8 ASCII digits, the first in the low
// byte: split into lanes of 4 digits (32 bits each), 2 (16 bits), 1 (8
// bits), each split a multiply-shift that divides every lane at once.
func digits8(v uint32) uint64 {
	hi := v / 10000
	y := uint64(v-hi*10000)<<32 | uint64(hi)
	// Per 32-bit lane x < 10000: x/100 = x*10486>>20, below 2^27.
	z := (y * 10486 >> 20) & 0x0000007F0000007F
	y = (y-z*100)<<16 | z
	// Per 16-bit lane x < 100: x/10 = x*103>>10, below 2^14.
	t := (y * 103 >> 10) & 0x000F000F000F000F
	y = (y-t*10)<<8 | t
	return y | 0x3030303030303030
}
