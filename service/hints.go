package service

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/jsonw"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/picker/kvhints"
)

// KVHintsConfig configures the KV hints /v1/pick answers for vLLM's KVCR
// tier (package kvhints): with KVCR endpoints, a pull whose source and
// destination both have one gets a kv.fetch hint, placed as Placement says,
// beside llm-d's remote_kv_source.
type KVHintsConfig struct {
	// Endpoints are the pods' KVCR control endpoints, by pod and
	// data-parallel rank (--kvcr-endpoint, --kvcr-config); none: no hints.
	Endpoints []kvhints.Endpoint
	// Placement is where the hint goes (--hint-placement); zero:
	// kvhints.DefaultPlacement.
	Placement kvhints.Placement
}

type kvcrList []kvhints.Endpoint

func (l *kvcrList) String() string { return fmt.Sprint(len(*l), " endpoints") }

// kvcrFlag is --kvcr-endpoint or --kvcr-config, appending to the same list.
type kvcrFlag struct {
	list  *kvcrList
	parse func(string) ([]kvhints.Endpoint, error)
}

func (f kvcrFlag) String() string {
	if f.list == nil {
		return ""
	}
	return f.list.String()
}

func (f kvcrFlag) Set(v string) error {
	eps, err := f.parse(v)
	if err != nil {
		return err
	}
	*f.list = append(*f.list, eps...)
	return nil
}

type placementFlag struct{ p *kvhints.Placement }

func (f placementFlag) String() string {
	if f.p == nil || *f.p == "" {
		return string(kvhints.DefaultPlacement)
	}
	return string(*f.p)
}

func (f placementFlag) Set(v string) error {
	p, err := kvhints.ParsePlacement(v)
	if err != nil {
		return err
	}
	*f.p = p
	return nil
}

func (c *KVHintsConfig) flags(fs *flag.FlagSet) {
	list := (*kvcrList)(&c.Endpoints)
	fs.Var(kvcrFlag{list, ParseKVCREndpoint}, "kvcr-endpoint", "a pod's KVCR control endpoints, for KV hints to vLLM's KVCR tier: "+
		"POD=tcp://HOST:PORT[,tcp://HOST:PORT...][,worker-type=aggregated|prefill|decode][,dp-start-rank=N], "+
		"the k-th endpoint being data-parallel rank N+k's (repeatable)")
	fs.Var(kvcrFlag{list, ParseKVCRConfig}, "kvcr-config", "a pod's vLLM --kv-transfer-config JSON, whose kvcr secondary tier's control_ports and control_advertise_host give its KVCR endpoints: "+
		"POD=JSON[,worker-type=aggregated|prefill|decode][,dp-start-rank=N] (repeatable)")
	fs.Var(placementFlag{&c.Placement}, "hint-placement", "where a pick's KV hint goes: kv_hint (kv_transfer_params.kv_hint, what released vLLM's KVCR tier reads), "+
		"kv_hints (the top-level field of vLLM's native KV hints) or router_hint (Dynamo's legacy kv_transfer_params.router_hint)")
}

func (c *KVHintsConfig) check() error {
	if _, err := kvhints.ParsePlacement(string(c.Placement)); err != nil {
		return fmt.Errorf("--hint-placement: %w", err)
	}
	var eps kvhints.Endpoints
	for _, ep := range c.Endpoints {
		if err := eps.Add(ep); err != nil {
			return fmt.Errorf("--kvcr-endpoint/--kvcr-config: %w", err)
		}
	}
	return nil
}

// ParseKVCREndpoint parses a --kvcr-endpoint value:
// POD=tcp://HOST:PORT[,tcp://HOST:PORT...][,worker-type=T][,dp-start-rank=N].
func ParseKVCREndpoint(v string) ([]kvhints.Endpoint, error) {
	const want = "POD=tcp://HOST:PORT[,tcp://HOST:PORT...][,worker-type=aggregated|prefill|decode][,dp-start-rank=N]"
	pod, rest, ok := strings.Cut(v, "=")
	if !ok || pod == "" || rest == "" {
		return nil, fmt.Errorf("--kvcr-endpoint: want %s, got %q", want, v)
	}
	var addrs, opts []string
	for part := range strings.SplitSeq(rest, ",") {
		if strings.HasPrefix(part, "tcp://") && len(opts) == 0 {
			addrs = append(addrs, part)
			continue
		}
		opts = append(opts, part)
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("--kvcr-endpoint %q: no tcp:// endpoint (want %s)", v, want)
	}
	wt, start, err := kvcrOptions(opts)
	if err != nil {
		return nil, fmt.Errorf("--kvcr-endpoint %q: %w (want %s)", v, err, want)
	}
	eps := make([]kvhints.Endpoint, len(addrs))
	for k, a := range addrs {
		if err := kvhints.ParseControlEndpoint(a); err != nil {
			return nil, fmt.Errorf("--kvcr-endpoint %q: %w", v, err)
		}
		eps[k] = kvhints.Endpoint{Holder: index.Holder{Pod: pod, Rank: start + k}, Address: a, WorkerType: wt}
	}
	return eps, nil
}

// ParseKVCRConfig parses a --kvcr-config value:
// POD=KV_TRANSFER_CONFIG_JSON[,worker-type=T][,dp-start-rank=N].
func ParseKVCRConfig(v string) ([]kvhints.Endpoint, error) {
	const want = "POD=JSON[,worker-type=aggregated|prefill|decode][,dp-start-rank=N]"
	pod, rest, ok := strings.Cut(v, "=")
	if !ok || pod == "" || !strings.HasPrefix(rest, "{") {
		return nil, fmt.Errorf("--kvcr-config: want %s, got %q", want, v)
	}
	// The options follow the JSON object, whose end the decoder finds.
	dec := json.NewDecoder(strings.NewReader(rest))
	var raw json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("--kvcr-config %s: %w", pod, err)
	}
	tail := rest[dec.InputOffset():]
	var opts []string
	if tail != "" {
		o, ok := strings.CutPrefix(tail, ",")
		if !ok {
			return nil, fmt.Errorf("--kvcr-config %s: %q after the JSON object (want %s)", pod, tail, want)
		}
		opts = strings.Split(o, ",")
	}
	wt, start, err := kvcrOptions(opts)
	if err != nil {
		return nil, fmt.Errorf("--kvcr-config %s: %w (want %s)", pod, err, want)
	}
	eps, err := kvhints.FromKVTransferConfig(pod, start, wt, bytes.TrimSpace(raw))
	if err != nil {
		return nil, fmt.Errorf("--kvcr-config: %w", err)
	}
	return eps, nil
}

func kvcrOptions(opts []string) (kvhints.WorkerType, int, error) {
	wt, start := kvhints.Aggregated, 0
	seen := map[string]bool{}
	for _, o := range opts {
		k, val, ok := strings.Cut(o, "=")
		if !ok || (k != "worker-type" && k != "dp-start-rank") || val == "" {
			return "", 0, fmt.Errorf("unknown option %q", o)
		}
		if seen[k] {
			return "", 0, fmt.Errorf("option %s given twice", k)
		}
		seen[k] = true
		var err error
		if k == "worker-type" {
			if wt, err = kvhints.ParseWorkerType(val); err != nil {
				return "", 0, err
			}
			continue
		}
		if start, err = strconv.Atoi(val); err != nil || start < 0 || start > 1<<16 {
			return "", 0, fmt.Errorf("dp-start-rank %q: want 0..65536", val)
		}
	}
	return wt, start, nil
}

// hintState is the service's KV hints: nil without KVCR endpoints.
type hintState struct {
	hinter    *kvhints.Hinter
	placement kvhints.Placement
	// outcomes counts picks by hint outcome (kvhints.Reason).
	outcomes *prometheus.CounterVec
}

// newHints returns the hint state of cfg, nil without endpoints.
func (s *Service) newHints(cfg Config) *hintState {
	if len(cfg.KVHints.Endpoints) == 0 {
		return nil
	}
	var eps kvhints.Endpoints
	for _, ep := range cfg.KVHints.Endpoints {
		// Validate has checked them.
		_ = eps.Add(ep)
	}
	p, _ := kvhints.ParsePlacement(string(cfg.KVHints.Placement))
	content := cfg.Keys == KeysContent
	if content {
		s.log.Warn("kvsource serve: --keys content indexes kvsource's content keys, not the engines' block hashes KVCR knows: picks get no KV hint",
			"kvcr_endpoints", eps.Len())
	}
	h := &hintState{hinter: kvhints.New(kvhints.Config{Endpoints: &eps, ContentKeys: content}), placement: p,
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsource_pick_kv_hints_total", Help: "Picks by KV hint outcome: hinted, or why a pick got none (no_pull, no_source_endpoint, ...).",
		}, []string{"outcome"})}
	for _, r := range []kvhints.Reason{kvhints.ReasonHinted, kvhints.ReasonNoPull, kvhints.ReasonNoSourceEndpoint} {
		h.outcomes.WithLabelValues(string(r))
	}
	s.reg.MustRegister(h.outcomes)
	return h
}

// promptKeys hashes prompt as the picker would, for a pick whose hint
// needs the keys from block 0: the picker then takes them instead of
// hashing again. Errors are the picker's.
func (s *Service) promptKeys(ctx context.Context, prompt hashing.Request, b *bodyBuf) ([]uint64, error) {
	keys, err := s.hashCache.BlockKeysContext(ctx, s.hasher, b.keys[:0], prompt)
	switch {
	case errors.Is(err, hashing.ErrStopped):
		return nil, fmt.Errorf("picker: %w", err)
	case err != nil:
		return nil, fmt.Errorf("%w: %w", picker.ErrHash, err)
	}
	b.keys = keys
	if keys == nil {
		// Non-nil, so that the picker does not hash an empty prompt again.
		keys = b.keys[:0:0]
	}
	return keys, nil
}

// hintAnswer is a pick's KV hint, for its answer.
type hintAnswer struct {
	reason    kvhints.Reason
	hint      kvhints.Hint
	placement kvhints.Placement
}

// answer returns d's hint under messageID (the pick's kv_request_id).
func (h *hintState) answer(d *picker.Decision, keys []uint64, messageID string) (*hintAnswer, error) {
	hint, reason, err := h.hinter.Hint(d, keys, messageID)
	if err != nil {
		return nil, err
	}
	h.outcomes.WithLabelValues(string(reason)).Inc()
	return &hintAnswer{reason: reason, hint: hint, placement: h.placement}, nil
}

// inParams reports whether the answer's kv_transfer_params carry the hint.
func (a *hintAnswer) inParams() bool {
	return a != nil && a.reason == kvhints.ReasonHinted && a.placement != kvhints.PlacementKVHints
}

// topLevel reports whether the answer carries the hint as kv_hints.
func (a *hintAnswer) topLevel() bool {
	return a != nil && a.reason == kvhints.ReasonHinted && a.placement == kvhints.PlacementKVHints
}

// appendParams appends the hint's member of kv_transfer_params, after
// others when more.
func (a *hintAnswer) appendParams(b []byte, more bool) ([]byte, error) {
	if more {
		b = append(b, ',')
	}
	b = jsonw.AppendString(b, string(a.placement))
	b = append(b, ':')
	if a.placement == kvhints.PlacementRouterHint {
		return a.hint.AppendRouterHint(b)
	}
	return a.hint.AppendEnvelope(b)
}

// set fills resp's hint fields, the schema appendJSON encodes.
func (a *hintAnswer) set(resp *PickResponse) error {
	if a == nil {
		return nil
	}
	resp.HintReason = a.reason
	if a.reason != kvhints.ReasonHinted {
		return nil
	}
	if a.placement == kvhints.PlacementRouterHint {
		resp.KVTransferParams.RouterHint = &kvhints.RouterHint{SourceControlEndpoint: a.hint.SourceControlEndpoint, BlockHashes: a.hint.BlockHashes}
		return nil
	}
	env, err := a.hint.Envelope()
	if err != nil {
		return err
	}
	if a.placement == kvhints.PlacementKVHints {
		resp.KVHints = &env
	} else {
		resp.KVTransferParams.KVHint = &env
	}
	return nil
}
