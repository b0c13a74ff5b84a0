package kvhints_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// kvcrHint is what the model of KVCR's hint parser takes from a hint.
type kvcrHint struct {
	endpoint string
	hashes   map[uint64]bool
	// warnings are the ones KVCR logs and carries on after.
	warnings []string
}

// kvcrParseEnvelope models ai-dynamo/kvcr's src/kvcr/hint_parser.py as
// the spec's §2.3 gives its nine rules, written from the spec and not from
// the encoder: v is a JSON value decoded with UseNumber, as Python's json
// would hand it over (a mapping, a list, a str, an int or float, a bool or
// None).
func kvcrParseEnvelope(v any) (kvcrHint, error) {
	// Rule 1: a mapping.
	env, ok := v.(map[string]any)
	if !ok {
		return kvcrHint{}, errors.New("invalid router hint")
	}
	var h kvcrHint
	// Rule 2: another protocol version is a warning.
	if pv, _ := env["protocol_version"].(string); pv != "0.1" {
		h.warnings = append(h.warnings, "protocol_version")
	}
	// Rule 3: actions a list; the first kv.fetch mapping is used.
	actions, ok := env["actions"].([]any)
	if !ok {
		return kvcrHint{}, errors.New("actions is not a list")
	}
	var fetch map[string]any
	for _, a := range actions {
		m, ok := a.(map[string]any)
		if !ok {
			continue
		}
		if t, _ := m["action_type"].(string); t != "kv.fetch" {
			continue
		}
		fetch = m
		break
	}
	// Rule 4: no kv.fetch is an error.
	if fetch == nil {
		return kvcrHint{}, errors.New("no kv.fetch action")
	}
	if av, _ := fetch["action_version"].(string); av != "1.0" {
		h.warnings = append(h.warnings, "action_version")
	}
	p, err := kvcrParsePayload(fetch["payload"])
	if err != nil {
		return kvcrHint{}, err
	}
	p.warnings = append(h.warnings, p.warnings...)
	return p, nil
}

// kvcrParsePayload is rules 4 to 9 on a kv.fetch payload, which is also
// the whole of a legacy router_hint.
func kvcrParsePayload(v any) (kvcrHint, error) {
	// Rule 4: the payload a mapping.
	p, ok := v.(map[string]any)
	if !ok {
		return kvcrHint{}, errors.New("payload is not a mapping")
	}
	// Rule 5: no_retain present at all is an error.
	if _, ok := p["no_retain"]; ok {
		return kvcrHint{}, errors.New("no_retain is not currently supported")
	}
	// Rule 6: mode defaults to copy; any other value is an error.
	if m, ok := p["mode"]; ok && m != "copy" {
		return kvcrHint{}, fmt.Errorf("mode %v", m)
	}
	// Rule 7: a non-empty string endpoint.
	ep, ok := p["source_control_endpoint"].(string)
	if !ok {
		return kvcrHint{}, errors.New("source-less hints are not currently supported")
	}
	if ep == "" {
		return kvcrHint{}, errors.New("empty source_control_endpoint")
	}
	// Rule 8: a non-empty list of ints in [0, 2^64); no bools, no
	// floats; duplicates collapse.
	list, ok := p["block_hashes"].([]any)
	if !ok || len(list) == 0 {
		return kvcrHint{}, errors.New("block_hashes is not a non-empty list")
	}
	h := kvcrHint{endpoint: ep, hashes: map[uint64]bool{}}
	for _, e := range list {
		n, ok := e.(json.Number)
		if !ok {
			return kvcrHint{}, fmt.Errorf("block hash %v (%T) is not an int", e, e)
		}
		if strings.ContainsAny(n.String(), ".eE") {
			return kvcrHint{}, fmt.Errorf("block hash %s is a float", n)
		}
		x, err := strconv.ParseUint(n.String(), 10, 64)
		if err != nil {
			return kvcrHint{}, fmt.Errorf("block hash %s outside 0..2^64-1", n)
		}
		h.hashes[x] = true
	}
	// Rule 9: other keys are ignored.
	return h, nil
}

// decodeNumbers decodes one JSON value with UseNumber, refusing trailing
// data.
func decodeNumbers(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("trailing data")
	}
	return v, nil
}
