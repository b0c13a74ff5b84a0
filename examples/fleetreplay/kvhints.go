package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/picker/kvhints"
	"github.com/kvsource/kvsource/transfer"
)

// The KV hints path (issue 31): instead of llm-d's remote_kv_source, the
// router attaches a kv.fetch@1.0 hint (picker/kvhints) to the request body
// it sends; the destination's engine reads that body as vLLM's KVCR tier
// does and pulls the hinted blocks from the source's control endpoint.
// KVCR's control protocol (start_write, then the source's write_done over
// NIXL) is modelled by the fleet's transfer session: the source pins the
// keys it still holds (the lookup), writes them (the fetch), and those are
// write_done's completed_indices; a key it lost is left out, a partial
// pull, and the destination recomputes from the first block it lacks.

// hintsSpec makes an arm route its pulls as KV hints.
type hintsSpec struct {
	// placement is where the router puts the hint and the engines read
	// it (one engine generation across the fleet).
	placement kvhints.Placement
	// disabled gives the router no pod's KVCR endpoint, so that no
	// decision gets a hint: the negative control.
	disabled bool
}

// kvcrControlPort is the simulated pods' KVCR control port.
const kvcrControlPort = 17771

// kvTransferConfig is a simulated pod's vLLM --kv-transfer-config: the
// KVCR quick-start's, advertising the pod's address.
func kvTransferConfig(p *pod) []byte {
	return []byte(`{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{` +
		`"spec_name":"TieringOffloadingSpec","enable_external_pinning":true,"self_describing_kv_events":true,` +
		`"secondary_tiers":[{"type":"kvcr","router_capabilities":["router_hint"],"control_host":"0.0.0.0",` +
		`"control_ports":[` + strconv.Itoa(kvcrControlPort) + `],"control_advertise_host":"` + p.host + `"}]}}`)
}

func workerType(r role) kvhints.WorkerType {
	switch r {
	case rolePrefill:
		return kvhints.Prefill
	case roleDecode:
		return kvhints.Decode
	}
	return kvhints.Aggregated
}

// hintPath is the router's hinter and the pods' control endpoints.
type hintPath struct {
	spec      hintsSpec
	hinter    *kvhints.Hinter
	byControl map[string]*pod
	body      []byte
	stats     hintStats
}

// hintStats count what became of the hints.
type hintStats struct {
	hinted   int // bodies sent with a hint
	refused  int // hints the destination's parser refused
	partial  int // pulls whose source wrote fewer blocks than asked
	stranded int // blocks written past the first one the source lacked
}

func newHintPath(f *fleet, spec hintsSpec) (*hintPath, error) {
	h := &hintPath{spec: spec, byControl: make(map[string]*pod)}
	var eps kvhints.Endpoints
	for _, p := range f.pods {
		got, err := kvhints.FromKVTransferConfig(p.name, 0, workerType(p.role), kvTransferConfig(p))
		if err != nil {
			return nil, err
		}
		for _, ep := range got {
			h.byControl[ep.Address] = p
			if spec.disabled {
				continue
			}
			if err := eps.Add(ep); err != nil {
				return nil, err
			}
		}
	}
	h.hinter = kvhints.New(kvhints.Config{Endpoints: &eps})
	return h, nil
}

// route is the router's side of a pull decision: the hint, merged into the
// body sent to dest, and dest's side: the order its KVCR reads from the
// body (nil: no pull). A decision that yields no order is released here.
func (s *sdkPath) route(r *request, dest *pod, d picker.Decision) (*pullOrder, error) {
	h, f := s.hints, s.f
	hint, reason, err := h.hinter.Hint(&d, r.keys, r.name)
	if err != nil {
		d.Done()
		return nil, fmt.Errorf("%s: %w", r.name, err)
	}
	f.res.Decisions["hint_"+string(reason)]++
	var hp *kvhints.Hint
	if reason == kvhints.ReasonHinted {
		hp = &hint
		h.stats.hinted++
	}
	h.body, err = kvhints.MergeIntoBody(h.body[:0], []byte(`{"model":"`+f.model+`","max_tokens":16}`), hp, h.spec.placement)
	if err != nil {
		d.Done()
		return nil, fmt.Errorf("%s: %w", r.name, err)
	}
	o, err := h.read(dest, h.body)
	if err != nil {
		// KVCR refuses the hint and the engine serves the request
		// without it.
		h.stats.refused++
		f.res.Decisions["hint_refused"]++
	}
	if o == nil {
		d.Done()
		return nil, nil
	}
	o.addr = s.mv.addr(o.source)
	// The router's bookkeeping of its decision, not the destination's
	// input: the picker counts the pull against its source until it ends.
	o.d = d
	return o, nil
}

// errHint reports a hint KVCR's parser refuses.
var errHint = errors.New("kv hint refused")

// read is dest's engine reading a request body: the hint where its engine
// generation reads it (placement), parsed by KVCR's rules; nil without
// one.
func (h *hintPath) read(dest *pod, body []byte) (*pullOrder, error) {
	v, err := decodeJSON(body)
	if err != nil {
		return nil, fmt.Errorf("%w: body: %w", errHint, err)
	}
	req, _ := v.(map[string]any)
	var raw any
	var ok bool
	switch h.spec.placement {
	case kvhints.PlacementKVHints:
		raw, ok = req["kv_hints"]
	default:
		params, _ := req["kv_transfer_params"].(map[string]any)
		raw, ok = params[string(h.spec.placement)]
	}
	if !ok {
		return nil, nil
	}
	var hint kvcrHint
	if h.spec.placement == kvhints.PlacementRouterHint {
		hint, err = kvcrParsePayload(raw)
	} else {
		hint, err = kvcrParseEnvelope(raw)
	}
	if err != nil {
		return nil, err
	}
	src := h.byControl[hint.endpoint]
	if src == nil || src == dest {
		return nil, fmt.Errorf("%w: no peer at control endpoint %q", errHint, hint.endpoint)
	}
	return &pullOrder{source: src, hinted: hint.hashes}, nil
}

// fetchHinted is KVCR's pull of keys (the prompt's blocks from the
// destination's local prefix on, while they are in the hint): the source
// writes every key it still holds; the blocks up to the first one it
// lacks land, the rest is recomputed. It verifies what arrived and returns
// the number of leading blocks pulled.
func (s *sdkPath) fetchHinted(dest *pod, r *request, o *pullOrder, keys []uint64) (int, error) {
	ctx := s.f.ctx
	sess, hits, err := s.lookup(ctx, dest, r, o, keys, "start_write at")
	if err != nil {
		return 0, err
	}
	// completed_indices: the keys the source could get, written into the
	// destination blocks named for them.
	s.idx = s.idx[:0]
	var done []transfer.Key
	for i, hit := range hits {
		if hit {
			s.idx = append(s.idx, i)
			done = append(done, s.tkeys[i])
		}
	}
	n := transfer.Prefix(hits)
	if len(done) < len(keys) {
		s.hints.stats.partial++
		s.hints.stats.stranded += len(done) - n
	}
	if err := s.fetchAt(ctx, dest, r, o, sess, done, "write from"); err != nil {
		return 0, err
	}
	return n, nil
}

// kvcrHint is what KVCR's hint parser takes from a hint.
type kvcrHint struct {
	endpoint string
	hashes   map[uint64]bool
}

// kvcrParseEnvelope reads a KV hints envelope as ai-dynamo/kvcr's
// src/kvcr/hint_parser.py does, by the nine rules of the kvhints spec's
// §2.3 (the strict version; the one that first read kv_hint is more
// lenient), from v, a JSON value decoded with UseNumber as Python's json
// hands it over. A protocol or action version other than 0.1 / 1.0 is
// KVCR's warning, and read with the 1.0 schema.
func kvcrParseEnvelope(v any) (kvcrHint, error) {
	// Rule 1: a mapping.
	env, ok := v.(map[string]any)
	if !ok {
		return kvcrHint{}, fmt.Errorf("%w: invalid router hint", errHint)
	}
	// Rule 3: actions a list; the first kv.fetch mapping is the one.
	actions, ok := env["actions"].([]any)
	if !ok {
		return kvcrHint{}, fmt.Errorf("%w: actions is not a list", errHint)
	}
	for _, a := range actions {
		if m, ok := a.(map[string]any); ok && m["action_type"] == kvhints.ActionFetch {
			return kvcrParsePayload(m["payload"])
		}
	}
	// Rule 4: no kv.fetch.
	return kvcrHint{}, fmt.Errorf("%w: no kv.fetch action", errHint)
}

// kvcrParsePayload is rules 4 to 9 on a kv.fetch payload, which is also
// the whole of a legacy router_hint.
func kvcrParsePayload(v any) (kvcrHint, error) {
	p, ok := v.(map[string]any)
	if !ok {
		return kvcrHint{}, fmt.Errorf("%w: payload is not a mapping", errHint)
	}
	if _, ok := p["no_retain"]; ok {
		return kvcrHint{}, fmt.Errorf("%w: no_retain is not currently supported", errHint)
	}
	if m, ok := p["mode"]; ok && m != "copy" {
		return kvcrHint{}, fmt.Errorf("%w: mode %v", errHint, m)
	}
	ep, ok := p["source_control_endpoint"].(string)
	if !ok || ep == "" {
		return kvcrHint{}, fmt.Errorf("%w: source-less hints are not currently supported", errHint)
	}
	list, ok := p["block_hashes"].([]any)
	if !ok || len(list) == 0 {
		return kvcrHint{}, fmt.Errorf("%w: block_hashes is not a non-empty list", errHint)
	}
	h := kvcrHint{endpoint: ep, hashes: make(map[uint64]bool, len(list))}
	for _, e := range list {
		n, ok := e.(json.Number)
		if !ok || strings.ContainsAny(n.String(), ".eE") {
			return kvcrHint{}, fmt.Errorf("%w: block hash %v is not an int", errHint, e)
		}
		x, err := strconv.ParseUint(n.String(), 10, 64)
		if err != nil {
			return kvcrHint{}, fmt.Errorf("%w: block hash %s outside 0..2^64-1", errHint, n)
		}
		h.hashes[x] = true
	}
	return h, nil
}

// decodeJSON decodes one JSON value with UseNumber (integers exact, as
// Python's json reads them), refusing trailing data.
func decodeJSON(b []byte) (any, error) {
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
