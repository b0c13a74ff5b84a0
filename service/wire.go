package service

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/picker/kvhints"
)

type MMItem struct {
	ID     string `json:"id"`
	Offset int    `json:"offset"`
	Length int    `json:"length"`
}

// Prompt is what determines a prompt's block keys.
type Prompt struct {
	Model     string   `json:"model"`
	Tokens    []uint32 `json:"tokens"`
	LoRAName  string   `json:"lora_name"`
	CacheSalt string   `json:"cache_salt"`
	MMItems   []MMItem `json:"mm_items"`
	// Request is an OpenAI completions or chat body, rendered into the
	// tokens when there are none (see RenderConfig).
	Request json.RawMessage `json:"request"`
}

func (p *Prompt) request() (hashing.Request, error) {
	if p.Model == "" {
		return hashing.Request{}, errors.New(`"model" is required`)
	}
	if p.Tokens == nil {
		return hashing.Request{}, errors.New(`"tokens" or "tokens_b64" is required`)
	}
	r := hashing.Request{Tokens: p.Tokens, LoRAName: p.LoRAName, CacheSalt: p.CacheSalt}
	for _, m := range p.MMItems {
		r.MM = append(r.MM, hashing.MMItem{ID: m.ID, Offset: m.Offset, Length: m.Length})
	}
	return r, nil
}

type ScoreRequest struct {
	Prompt
	Pods []string `json:"pods"`
}

type PodScore struct {
	Pod           string         `json:"pod"`
	DPRank        int            `json:"dp_rank"`
	MatchedBlocks int            `json:"matched_blocks"`
	Tiers         map[string]int `json:"tiers"`
	Score         float64        `json:"score"`
}

type ScoreResponse struct {
	Model  string     `json:"model"`
	Blocks int        `json:"blocks"`
	Pods   []PodScore `json:"pods"`
}

type Candidate struct {
	Pod     string  `json:"pod"`
	DPRank  *int    `json:"dp_rank"`
	Waiting int     `json:"waiting"`
	Load    float64 `json:"load"`
}

type PickRequest struct {
	Prompt
	RequestID           string      `json:"request_id"`
	Destination         string      `json:"destination"`
	DestinationDPRank   int         `json:"destination_dp_rank"`
	Candidates          []Candidate `json:"candidates"`
	MinCachedTokenDelta *int        `json:"min_cached_token_delta"`
}

type PickResponse struct {
	Destination             string        `json:"destination"`
	DestinationDPRank       int           `json:"destination_dp_rank"`
	Source                  *string       `json:"source"`
	SourceDPRank            *int          `json:"source_dp_rank,omitempty"`
	Reason                  picker.Reason `json:"reason"`
	Blocks                  int           `json:"blocks"`
	BlockSize               int           `json:"block_size"`
	DestinationCachedBlocks int           `json:"destination_cached_blocks"`
	SourceBlocks            int           `json:"source_blocks"`
	BestSourceBlocks        int           `json:"best_source_blocks"`
	// SkippedSources counts holders that could have extended the prefix
	// but were no live source; SkippedState is the best one's state.
	SkippedSources        int               `json:"skipped_sources"`
	SkippedState          string            `json:"skipped_state,omitempty"`
	RecomputeBlocks       int               `json:"recompute_blocks"`
	PredictedSavingMillis *float64          `json:"predicted_saving_ms,omitempty"`
	MissingBlocks         []string          `json:"missing_blocks"`
	Header                map[string]string `json:"header"`
	KVTransferParams      KVTransferParams  `json:"kv_transfer_params"`
	// KVHints is the KV hint with --hint-placement kv_hints, to send as
	// the engine request's top-level kv_hints.
	KVHints *kvhints.Envelope `json:"kv_hints,omitempty"`
	// HintReason is, with KVCR endpoints configured, "hinted" or why
	// the pick has no KV hint.
	HintReason kvhints.Reason `json:"hint_reason,omitempty"`
}

// KVTransferParams are the members of a pick's kv_transfer_params: llm-d's
// remote_kv_source for vLLM's P2P tier and, with KVCR endpoints, the KV
// hint for its KVCR tier (kv_hint, or router_hint with --hint-placement
// router_hint). A router sets them in the engine request's
// kv_transfer_params beside that object's own members.
type KVTransferParams struct {
	RemoteKVSource *picker.RemoteKVSource `json:"remote_kv_source,omitempty"`
	KVHint         *kvhints.Envelope      `json:"kv_hint,omitempty"`
	RouterHint     *kvhints.RouterHint    `json:"router_hint,omitempty"`
}

type ErrorResponse struct {
	Error string `json:"error"`
}

// badRequest is an error the client caused.
type badRequest struct{ err error }

func (b badRequest) Error() string { return b.err.Error() }
func (b badRequest) Unwrap() error { return b.err }

// notFound is an error naming something the service does not know,
// such as a model no engine has published events for.
type notFound struct{ err error }

func (n notFound) Error() string { return n.err.Error() }
func (n notFound) Unwrap() error { return n.err }

// decodeJSON decodes a POST body, which admit bounds and instrument reads.
func decodeJSON(body []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return badRequest{fmt.Errorf("decoding request: %w", typeError(err, v))}
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			return badRequest{fmt.Errorf("decoding request: %w", err)}
		}
		return badRequest{errors.New("decoding request: trailing data after the JSON object")}
	}
	return nil
}

// typeError words encoding/json's error for a member of the wrong type
// in the request's terms: `"model": want a string, got a number` rather
// than the Go struct and field it was decoded into.
// v is what the body was decoded into.
func typeError(err error, v any) error {
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) {
		return err
	}
	if te.Field == "" {
		return fmt.Errorf("request body: want %s, got %s", jsonKind(te.Type), article(te.Value))
	}
	// The path holds the Go names of embedded structs between the JSON
	// names.
	embedded := map[string]bool{}
	embeddedNames(reflect.TypeOf(v), embedded, map[reflect.Type]bool{})
	var path []string
	for name := range strings.SplitSeq(te.Field, ".") {
		if !embedded[name] {
			path = append(path, name)
		}
	}
	return fmt.Errorf("%q: want %s, got %s", strings.Join(path, "."), jsonKind(te.Type), article(te.Value))
}

// embeddedNames adds the Go names of the embedded structs in t, at any
// depth, to names.
func embeddedNames(t reflect.Type, names map[string]bool, seen map[reflect.Type]bool) {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice || t.Kind() == reflect.Array || t.Kind() == reflect.Map {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct || seen[t] {
		return
	}
	seen[t] = true
	for i := range t.NumField() {
		f := t.Field(i)
		if f.Anonymous {
			names[f.Name] = true
		}
		embeddedNames(f.Type, names, seen)
	}
}

func jsonKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Pointer:
		return jsonKind(t.Elem())
	}
	return "an object"
}

// article is encoding/json's name of a JSON value's kind ("number",
// "string", "object", "array", "bool", or a number's text) with an article.
func article(v string) string {
	switch v {
	case "object", "array":
		return "an " + v
	case "string", "number", "bool":
		return "a " + v
	}
	if n, ok := strings.CutPrefix(v, "number "); ok {
		return "a number (" + n + ")"
	}
	return v
}

// writeJSON answers v as JSON. The length is set, so that flushing
// the answer to learn whether it was delivered keeps it a plain
// Content-Length response.
func writeJSON(w http.ResponseWriter, code int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		code, body = http.StatusInternalServerError, fmt.Appendf(nil, `{"error":%q}`, "encoding the answer: "+err.Error())
	}
	body = append(body, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(code)
	_, _ = w.Write(body)
}

func tiersJSON(tp []index.TierPrefix) map[string]int {
	m := map[string]int{index.TierGPU: 0, index.TierCPU: 0}
	for _, t := range tp {
		m[t.Tier] = t.Blocks
	}
	return m
}

func keysJSON(keys []uint64) []string {
	s := make([]string, len(keys))
	for i, k := range keys {
		s[i] = strconv.FormatUint(k, 10)
	}
	return s
}
