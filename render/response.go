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

// wireFeatures is the part of vLLM's GenerateRequest.features (the render
// answer, vllm/entrypoints/scale_out/token_in_token_out/protocol.py) the
// client reads; the multimodal tensors (kwargs_data, mm_metadata) are
// skipped.
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
// the chat endpoint. The body scanner validates it and skips what the
// client does not read (sampling_params, token_offsets, the tensors);
// token_ids, nearly all of an answer's bytes, is read by scanTokens, and
// only features goes to encoding/json. It checks what vLLM's own
// validators promise, so that a broken or hostile backend cannot hand the
// hasher impossible items: at least one uint32 token, the same modalities
// and item counts in mm_hashes and mm_placeholders, placeholders inside
// the prompt, of positive length and not overlapping.
func parseAnswer(data []byte, array bool) ([]Rendered, error) {
	i := skipWS(data, 0)
	if i >= len(data) {
		return nil, answerErr("empty body")
	}
	var out []Rendered
	if !array {
		if data[i] != '{' {
			return nil, answerErr("want a JSON object, got %s", describe(data[i]))
		}
		r, end, err := parseRendered(data, i)
		if err != nil {
			return nil, err
		}
		out = []Rendered{r}
		i = end
	} else {
		if data[i] != '[' {
			return nil, answerErr("want a JSON array of rendered prompts, got %s", describe(data[i]))
		}
		i = skipWS(data, i+1)
		if i < len(data) && data[i] == ']' {
			return nil, answerErr("no rendered prompt")
		}
		for {
			if i >= len(data) || data[i] != '{' {
				if i >= len(data) {
					return nil, answerErr("offset %d: unterminated array", i)
				}
				return nil, answerErr("prompt %d: want a JSON object, got %s", len(out), describe(data[i]))
			}
			r, end, err := parseRendered(data, i)
			if err != nil {
				return nil, fmt.Errorf("prompt %d: %w", len(out), err)
			}
			out = append(out, r)
			i = skipWS(data, end)
			if i >= len(data) {
				return nil, answerErr("offset %d: unterminated array", i)
			}
			if data[i] == ']' {
				i++
				break
			}
			if data[i] != ',' {
				return nil, answerErr("offset %d: want ',' or ']' after a prompt, got %s", i, describe(data[i]))
			}
			i = skipWS(data, i+1)
		}
	}
	if err := trailing(data, i); err != nil {
		return nil, answerErr("%v", err)
	}
	return out, nil
}

// parseRendered reads the GenerateRequest object at data[i] == '{' and
// returns the offset past it.
func parseRendered(data []byte, i int) (Rendered, int, error) {
	var r Rendered
	var tokens []uint32
	var feats []byte
	seenTokens := false
	i = skipWS(data, i+1)
	if i < len(data) && data[i] == '}' {
		return r, i, answerErr("no token_ids")
	}
	for {
		name, vs, err := member(data, i)
		if err != nil {
			return r, i, answerErr("%v", err)
		}
		var ve int
		switch name {
		case "token_ids":
			seenTokens = true
			tokens, ve, err = scanTokens(data, vs)
		case "model":
			r.Model, ve, err = optString(data, vs, "model")
		case "cache_salt":
			r.saltEchoed = vs < len(data) && data[vs] == '"'
			r.Request.CacheSalt, ve, err = optString(data, vs, "cache_salt")
		case "features":
			ve, err = skipValue(data, vs, 2)
			feats = data[vs:ve]
		default:
			ve, err = skipValue(data, vs, 2)
		}
		if err != nil {
			if errors.Is(err, errAnswer) {
				return r, i, err
			}
			return r, i, answerErr("%v", err)
		}
		i = skipWS(data, ve)
		if i >= len(data) {
			return r, i, answerErr("offset %d: unterminated object", i)
		}
		if data[i] == '}' {
			break
		}
		if data[i] != ',' {
			return r, i, answerErr("offset %d: want ',' or '}' after a member, got %s", i, describe(data[i]))
		}
		i = skipWS(data, i+1)
	}
	end := i + 1
	switch {
	case !seenTokens:
		return r, end, answerErr("no token_ids")
	case tokens == nil:
		return r, end, answerErr("token_ids is null")
	case len(tokens) == 0:
		return r, end, answerErr("token_ids is empty")
	}
	r.Request.Tokens = tokens
	if len(feats) > 0 && feats[0] != 'n' {
		var f wireFeatures
		if err := json.Unmarshal(feats, &f); err != nil {
			return r, end, answerErr("features: %v", err)
		}
		var err error
		if r.Request.MM, err = f.items(len(tokens)); err != nil {
			return r, end, err
		}
	}
	return r, end, nil
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

// scanTokens reads the token_ids value at data[i]: null (nil), or an
// array of integers from 0 to math.MaxUint32 in JSON's grammar (no leading
// zeros, fractions or exponents), without encoding/json's reflection over
// every element. It returns the offset past the value.
func scanTokens(data []byte, i int) ([]uint32, int, error) {
	if i < len(data) && data[i] == 'n' {
		end, err := literal(data, i, "null")
		return nil, end, err
	}
	if i >= len(data) || data[i] != '[' {
		what := "nothing"
		if i < len(data) {
			what = describe(data[i])
		}
		return nil, i, answerErr("token_ids: want an array of integers, got %s", what)
	}
	// Allocate once, for as many tokens as the array has commas and one:
	// the first ']' ends it, since no valid token has one.
	n := 1
	if j := bytes.IndexByte(data[i:], ']'); j > 0 {
		n += bytes.Count(data[i:i+j], []byte{','})
	}
	out := make([]uint32, 0, n)
	i = skipWS(data, i+1)
	if i < len(data) && data[i] == ']' {
		return out, i + 1, nil
	}
	for {
		start := i
		var v uint64
		for i < len(data) && data[i] >= '0' && data[i] <= '9' {
			v = v*10 + uint64(data[i]-'0')
			if v > math.MaxUint32 {
				return nil, i, answerErr("token_ids[%d] does not fit a uint32", len(out))
			}
			i++
		}
		switch {
		case i == start && i < len(data) && data[i] == '-':
			return nil, i, answerErr("token_ids[%d] is negative", len(out))
		case i == start, i < len(data) && (data[i] == '.' || data[i] == 'e' || data[i] == 'E'),
			i-start > 1 && data[start] == '0':
			return nil, i, answerErr("token_ids[%d] is no non-negative integer", len(out))
		}
		out = append(out, uint32(v))
		i = skipWS(data, i)
		if i >= len(data) {
			return nil, i, answerErr("token_ids: unterminated array")
		}
		switch data[i] {
		case ',':
			i = skipWS(data, i+1)
		case ']':
			return out, i + 1, nil
		default:
			return nil, i, answerErr("token_ids: want ',' or ']' after token %d, got %s", len(out)-1, describe(data[i]))
		}
	}
}
