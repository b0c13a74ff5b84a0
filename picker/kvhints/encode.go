package kvhints

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"

	"github.com/kvsource/kvsource/internal/jsonw"
)

// The envelope's constants, as vLLM's KvHintsEnvelope and Dynamo's
// kv.fetch action carry them.
const (
	ProtocolVersion = "0.1"
	ActionID        = "a1"
	ActionFetch     = "kv.fetch"
	ActionVersion   = "1.0"
)

// Placement is where a request carries the hint; engine generations read
// different ones.
type Placement string

// Placements.
const (
	// PlacementKVHint puts the envelope in kv_transfer_params.kv_hint,
	// where released vLLM's KVCR tier reads it (KVCR after its PR #18): the
	// default.
	PlacementKVHint Placement = "kv_hint"
	// PlacementKVHints puts the envelope in the request's top-level
	// kv_hints field, vLLM's native one (vLLM #53423); whether the KVCR
	// adapter reads it there is not settled.
	PlacementKVHints Placement = "kv_hints"
	// PlacementRouterHint puts the bare payload in
	// kv_transfer_params.router_hint, Dynamo's legacy form that KVCR read
	// before its PR #18.
	PlacementRouterHint Placement = "router_hint"
	// DefaultPlacement is PlacementKVHint.
	DefaultPlacement = PlacementKVHint
)

// ParsePlacement parses a placement; "" is DefaultPlacement.
func ParsePlacement(s string) (Placement, error) {
	switch p := Placement(s); p {
	case "":
		return DefaultPlacement, nil
	case PlacementKVHint, PlacementKVHints, PlacementRouterHint:
		return p, nil
	}
	return "", fmt.Errorf("%w: placement %q: want kv_hint, kv_hints or router_hint", ErrConfig, s)
}

// Hint is one kv.fetch hint: the destination pulls blocks whose engine
// block hashes are BlockHashes from the KVCR at SourceControlEndpoint.
type Hint struct {
	// MessageID is the envelope's message_id: the request id.
	MessageID string
	// SourceControlEndpoint is the source's KVCR control endpoint.
	SourceControlEndpoint string
	// BlockHashes are the engine block hashes, root-aligned from the
	// prompt's block 0, as the source's KV events publish them.
	BlockHashes []uint64
}

// ErrInvalid reports a hint KVCR's parser would refuse, which the
// encoders never emit.
var ErrInvalid = errors.New("kvhints: invalid hint")

// Check reports what KVCR's parser would refuse in the hint: no block
// hashes, a bad control endpoint; and an empty MessageID, which TRT-LLM
// refuses (min_length 1). Errors wrap ErrInvalid.
func (h *Hint) Check() error {
	if err := h.checkPayload(); err != nil {
		return err
	}
	if h.MessageID == "" {
		return fmt.Errorf("%w: empty message_id", ErrInvalid)
	}
	return nil
}

func (h *Hint) checkPayload() error {
	if len(h.BlockHashes) == 0 {
		return fmt.Errorf("%w: no block hashes", ErrInvalid)
	}
	if err := ParseControlEndpoint(h.SourceControlEndpoint); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// AppendEnvelope appends the hint's KV hints envelope, with the key order
// of Dynamo's: {"protocol_version":"0.1","message_id":...,"actions":
// [{"action_id":"a1","action_type":"kv.fetch","action_version":"1.0",
// "payload":{"block_hashes":[...],"source_control_endpoint":...}}]}. Block
// hashes are JSON unsigned integers. An invalid hint is an error wrapping
// ErrInvalid, and b is returned as it was.
func (h *Hint) AppendEnvelope(b []byte) ([]byte, error) {
	if err := h.Check(); err != nil {
		return b, err
	}
	b = append(b, `{"protocol_version":"`+ProtocolVersion+`","message_id":`...)
	b = jsonw.AppendString(b, h.MessageID)
	b = append(b, `,"actions":[{"action_id":"`+ActionID+`","action_type":"`+ActionFetch+`","action_version":"`+ActionVersion+`","payload":`...)
	b = h.appendFetchPayload(b)
	return append(b, "}]}"...), nil
}

// appendFetchPayload appends the kv.fetch payload, its keys sorted as
// Dynamo's map sorts them.
func (h *Hint) appendFetchPayload(b []byte) []byte {
	b = append(b, `{"block_hashes":`...)
	b = appendHashes(b, h.BlockHashes)
	b = append(b, `,"source_control_endpoint":`...)
	b = jsonw.AppendString(b, h.SourceControlEndpoint)
	return append(b, '}')
}

// AppendRouterHint appends the legacy router_hint payload, with the key
// order of Dynamo's: {"source_control_endpoint":...,"block_hashes":[...]}.
// It carries no message id. An invalid payload is an error wrapping
// ErrInvalid, and b is returned as it was.
func (h *Hint) AppendRouterHint(b []byte) ([]byte, error) {
	if err := h.checkPayload(); err != nil {
		return b, err
	}
	b = append(b, `{"source_control_endpoint":`...)
	b = jsonw.AppendString(b, h.SourceControlEndpoint)
	b = append(b, `,"block_hashes":`...)
	b = appendHashes(b, h.BlockHashes)
	return append(b, '}'), nil
}

func appendHashes(b []byte, hs []uint64) []byte {
	b = append(b, '[')
	for i, x := range hs {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, x, 10)
	}
	return append(b, ']')
}

// Envelope is vLLM's KvHintsEnvelope, for callers that decode or build
// hints with encoding/json.
type Envelope struct {
	ProtocolVersion string   `json:"protocol_version"`
	MessageID       string   `json:"message_id"`
	Actions         []Action `json:"actions"`
}

// Action is vLLM's KvHintAction; Payload is a JSON object.
type Action struct {
	ActionID      string          `json:"action_id"`
	ActionType    string          `json:"action_type"`
	ActionVersion string          `json:"action_version"`
	Payload       json.RawMessage `json:"payload"`
}

// FetchPayload is a kv.fetch action's payload, its fields in the order
// of the envelope's payload (Dynamo's sorted map).
type FetchPayload struct {
	BlockHashes           []uint64 `json:"block_hashes"`
	SourceControlEndpoint string   `json:"source_control_endpoint"`
}

// RouterHint is the legacy router_hint payload, its fields in Dynamo's
// order.
type RouterHint struct {
	SourceControlEndpoint string   `json:"source_control_endpoint"`
	BlockHashes           []uint64 `json:"block_hashes"`
}

// Envelope returns the hint's envelope, which encoding/json encodes as
// AppendEnvelope does. An invalid hint is an error wrapping ErrInvalid.
func (h *Hint) Envelope() (Envelope, error) {
	if err := h.Check(); err != nil {
		return Envelope{}, err
	}
	return Envelope{ProtocolVersion: ProtocolVersion, MessageID: h.MessageID, Actions: []Action{{
		ActionID: ActionID, ActionType: ActionFetch, ActionVersion: ActionVersion, Payload: h.appendFetchPayload(nil),
	}}}, nil
}

// AppendKVTransferParams appends the kv_transfer_params object to send:
// existing's members (a JSON object; empty or null for none) in their
// order, then, when h is not nil and p puts the hint there, the hint under
// p's key, replacing any member of that name. Members of existing are
// kept as they are, compacted. An existing that is not an object, or holds
// p's key twice, is an error, as is an invalid hint (wrapping ErrInvalid);
// b is then returned as it was.
func AppendKVTransferParams(b []byte, existing []byte, h *Hint, p Placement) ([]byte, error) {
	key := ""
	if h != nil && p != PlacementKVHints {
		key = string(p)
	}
	return appendMerged(b, existing, key, func(b []byte) ([]byte, error) {
		if p == PlacementRouterHint {
			return h.AppendRouterHint(b)
		}
		return h.AppendEnvelope(b)
	})
}

// MergeIntoBody appends body, an OpenAI completions or chat request
// object, with the hint placed as p says: in its kv_transfer_params
// (AppendKVTransferParams, which keeps that object's other members; one is
// added when the body has none) or as its top-level kv_hints. The body's
// other members keep their order; the one replaced keeps its place and a
// new one goes last. Errors are AppendKVTransferParams's, and a body that
// is not an object. A nil h leaves the body as it is, compacted.
func MergeIntoBody(b []byte, body []byte, h *Hint, p Placement) ([]byte, error) {
	switch {
	case h == nil:
		return appendMerged(b, body, "", nil)
	case p == PlacementKVHints:
		return appendMerged(b, body, string(PlacementKVHints), h.AppendEnvelope)
	}
	var params []byte
	if err := walkObject(body, func(k string, v []byte) error {
		if k == "kv_transfer_params" {
			params = v
		}
		return nil
	}); err != nil {
		return b, err
	}
	return appendMerged(b, body, "kv_transfer_params", func(b []byte) ([]byte, error) {
		return AppendKVTransferParams(b, params, h, p)
	})
}

// appendMerged appends obj's members with the one named key, when key is
// not empty, replaced by (or, when obj has none, followed by) what value
// appends.
func appendMerged(b, obj []byte, key string, value func([]byte) ([]byte, error)) ([]byte, error) {
	orig := len(b)
	b = append(b, '{')
	n, placed := 0, false
	put := func() error {
		var err error
		b, err = value(b)
		placed = true
		return err
	}
	err := walkObject(obj, func(k string, v []byte) error {
		if n > 0 {
			b = append(b, ',')
		}
		n++
		b = jsonw.AppendString(b, k)
		b = append(b, ':')
		if key != "" && k == key {
			if placed {
				return fmt.Errorf("kvhints: member %q given twice", key)
			}
			return put()
		}
		var err error
		b, err = appendCompact(b, v)
		return err
	})
	if err == nil && key != "" && !placed {
		if n > 0 {
			b = append(b, ',')
		}
		b = jsonw.AppendString(b, key)
		b = append(b, ':')
		err = put()
	}
	if err != nil {
		return b[:orig], err
	}
	return append(b, '}'), nil
}

func appendCompact(b, v []byte) ([]byte, error) {
	buf := bytes.NewBuffer(b)
	if err := json.Compact(buf, v); err != nil {
		return b, fmt.Errorf("kvhints: %w", err)
	}
	return buf.Bytes(), nil
}

// walkObject calls f with each member of the JSON object obj, its value's
// bytes as they are; an empty obj or null has none.
func walkObject(obj []byte, f func(k string, v []byte) error) error {
	obj = bytes.TrimSpace(obj)
	if len(obj) == 0 || string(obj) == "null" {
		return nil
	}
	if obj[0] != '{' {
		return errors.New("kvhints: not a JSON object")
	}
	dec := json.NewDecoder(bytes.NewReader(obj))
	if _, err := dec.Token(); err != nil {
		return fmt.Errorf("kvhints: %w", err)
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return fmt.Errorf("kvhints: %w", err)
		}
		k, _ := t.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return fmt.Errorf("kvhints: member %q: %w", k, err)
		}
		if err := f(k, v); err != nil {
			return err
		}
	}
	if _, err := dec.Token(); err != nil {
		return fmt.Errorf("kvhints: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("kvhints: trailing data after the JSON object")
	}
	return nil
}
