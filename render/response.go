package render

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/kvsource/kvsource/hashing"
)

// wireRendered is the part of vLLM's GenerateRequest (the render answer,
// vllm/entrypoints/scale_out/token_in_token_out/protocol.py) the client
// reads. Everything else (sampling_params, token_offsets, the multimodal
// tensors in features.kwargs_data, ...) is skipped.
type wireRendered struct {
	// TokenIDs is scanned by scanTokens rather than by encoding/json: it is
	// nearly all of an answer's bytes.
	TokenIDs  json.RawMessage `json:"token_ids"`
	Features  *wireFeatures   `json:"features"`
	CacheSalt *string         `json:"cache_salt"`
	Model     *string         `json:"model"`
}

type wireFeatures struct {
	MMHashes       map[string][]string          `json:"mm_hashes"`
	MMPlaceholders map[string][]wirePlaceholder `json:"mm_placeholders"`
}

type wirePlaceholder struct {
	Offset *int64 `json:"offset"`
	Length *int64 `json:"length"`
}

// errAnswer is wrapped by the parser's errors; the client reports them as
// ErrBadResponse.
var errAnswer = errors.New("answer")

func answerErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errAnswer, fmt.Sprintf(format, args...))
}

// parseAnswer decodes a render answer: a JSON array of GenerateRequests for
// the completions endpoint (one per prompt), one GenerateRequest object for
// the chat endpoint. It checks what vLLM's own validators promise, so that
// a broken or hostile backend cannot hand the hasher impossible items: at
// least one non-negative uint32 token, the same modalities and item counts
// in mm_hashes and mm_placeholders, placeholders inside the prompt, of
// positive length and not overlapping.
func parseAnswer(data []byte, array bool) ([]Rendered, error) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return nil, answerErr("empty body")
	}
	var wires []wireRendered
	if array {
		if data[0] != '[' {
			return nil, answerErr("want a JSON array of rendered prompts, got %s", describe(data[0]))
		}
		if err := json.Unmarshal(data, &wires); err != nil {
			return nil, answerErr("%v", err)
		}
		if len(wires) == 0 {
			return nil, answerErr("no rendered prompt")
		}
	} else {
		if data[0] != '{' {
			return nil, answerErr("want a JSON object, got %s", describe(data[0]))
		}
		wires = make([]wireRendered, 1)
		if err := json.Unmarshal(data, &wires[0]); err != nil {
			return nil, answerErr("%v", err)
		}
	}
	out := make([]Rendered, len(wires))
	for i := range wires {
		r, err := wires[i].rendered()
		if err != nil {
			if array {
				return nil, fmt.Errorf("prompt %d: %w", i, err)
			}
			return nil, err
		}
		out[i] = r
	}
	return out, nil
}

func (w *wireRendered) rendered() (Rendered, error) {
	if w.TokenIDs == nil {
		return Rendered{}, answerErr("no token_ids")
	}
	tokens, err := scanTokens(w.TokenIDs)
	if err != nil {
		return Rendered{}, err
	}
	if len(tokens) == 0 {
		return Rendered{}, answerErr("token_ids is empty")
	}
	r := Rendered{Request: hashing.Request{Tokens: tokens}}
	if w.Model != nil {
		r.Model = *w.Model
	}
	if w.CacheSalt != nil {
		r.Request.CacheSalt = *w.CacheSalt
		r.saltEchoed = true
	}
	if w.Features != nil {
		if r.Request.MM, err = w.Features.items(len(tokens)); err != nil {
			return Rendered{}, err
		}
	}
	return r, nil
}

// items flattens the per-modality hashes and placeholders into the
// prompt's multimodal items sorted by offset, as vLLM's engine sorts a
// request's mm_features before it keys blocks with them.
func (f *wireFeatures) items(tokens int) ([]hashing.MMItem, error) {
	if len(f.MMHashes) != len(f.MMPlaceholders) {
		return nil, answerErr("mm_hashes has %d modalities, mm_placeholders %d", len(f.MMHashes), len(f.MMPlaceholders))
	}
	n := 0
	for modality, hashes := range f.MMHashes {
		ph, ok := f.MMPlaceholders[modality]
		if !ok {
			return nil, answerErr("modality %q has hashes but no placeholders", modality)
		}
		if len(ph) != len(hashes) {
			return nil, answerErr("modality %q: %d hashes for %d placeholders", modality, len(hashes), len(ph))
		}
		n += len(hashes)
	}
	if n == 0 {
		return nil, nil
	}
	if n > tokens {
		return nil, answerErr("%d multimodal items in %d tokens", n, tokens)
	}
	items := make([]hashing.MMItem, 0, n)
	for modality, hashes := range f.MMHashes {
		for i, h := range hashes {
			p := f.MMPlaceholders[modality][i]
			if p.Offset == nil || p.Length == nil {
				return nil, answerErr("modality %q item %d: placeholder without offset or length", modality, i)
			}
			off, length := *p.Offset, *p.Length
			if off < 0 || length <= 0 || off > int64(tokens) || length > int64(tokens)-off {
				return nil, answerErr("modality %q item %d: placeholder [%d, +%d) outside the %d tokens", modality, i, off, length, tokens)
			}
			if h == "" {
				return nil, answerErr("modality %q item %d: empty hash", modality, i)
			}
			items = append(items, hashing.MMItem{ID: h, Offset: int(off), Length: int(length)})
		}
	}
	// Map order is random: sort by offset, and by hash only to make the
	// error below deterministic (offsets never tie in a valid answer).
	slices.SortFunc(items, func(a, b hashing.MMItem) int {
		if a.Offset != b.Offset {
			return a.Offset - b.Offset
		}
		return strings.Compare(a.ID, b.ID)
	})
	for i := 1; i < len(items); i++ {
		if prev := items[i-1]; items[i].Offset < prev.Offset+prev.Length {
			return nil, answerErr("placeholders [%d, +%d) and [%d, +%d) overlap", prev.Offset, prev.Length, items[i].Offset, items[i].Length)
		}
	}
	return items, nil
}

// scanTokens reads token_ids, a JSON array of integers from 0 to
// math.MaxUint32 (encoding/json has already checked the value's syntax),
// without encoding/json's reflection over every element.
func scanTokens(raw []byte) ([]uint32, error) {
	i := skipWS(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		if i < len(raw) && raw[i] == 'n' {
			return nil, answerErr("token_ids is null")
		}
		what := "nothing"
		if i < len(raw) {
			what = describe(raw[i])
		}
		return nil, answerErr("token_ids: want an array of integers, got %s", what)
	}
	// About 6 bytes a token ("12345,"): allocate once.
	out := make([]uint32, 0, len(raw)/6+1)
	i = skipWS(raw, i+1)
	if i < len(raw) && raw[i] == ']' {
		return out, nil
	}
	for {
		start := i
		var v uint64
		for i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
			v = v*10 + uint64(raw[i]-'0')
			if v > math.MaxUint32 {
				return nil, answerErr("token_ids[%d] does not fit a uint32", len(out))
			}
			i++
		}
		if i == start || (i < len(raw) && (raw[i] == '.' || raw[i] == 'e' || raw[i] == 'E')) {
			if start < len(raw) && raw[start] == '-' {
				return nil, answerErr("token_ids[%d] is negative", len(out))
			}
			return nil, answerErr("token_ids[%d] is no non-negative integer", len(out))
		}
		out = append(out, uint32(v))
		i = skipWS(raw, i)
		if i >= len(raw) {
			return nil, answerErr("token_ids: unterminated array")
		}
		switch raw[i] {
		case ',':
			i = skipWS(raw, i+1)
		case ']':
			return out, nil
		default:
			return nil, answerErr("token_ids: want ',' or ']' after token %d", len(out)-1)
		}
	}
}
