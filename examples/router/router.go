package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// Response headers by which the router explains its decision.
const (
	HeaderDestination = "x-kvsource-destination"
	HeaderReason      = "x-kvsource-reason"
	HeaderSource      = "x-kvsource-source"
)

// Backend is one vLLM pod the router proxies to.
type Backend struct {
	// Addr is the pod's HTTP address, "host:port": the holder name its KV
	// events carry in their topic (kv@<Addr>@<model>).
	Addr string
	// P2PPort is the port of the pod's P2P side channel. 0 means the
	// picker's default (vLLM's VLLM_P2P_SIDE_CHANNEL_PORT). Pods sharing a
	// host need their own.
	P2PPort int

	inflight atomic.Int64
}

// Router is an OpenAI-style completions router for prompts given as token
// ids. It places each request on the least-loaded pod (the pod with the
// longest cached prefix among equally loaded ones), asks the picker whether
// that pod should pull the prefix from a peer, applies a pull as llm-d's
// source header and vLLM's kv_transfer_params, and proxies the request.
type Router struct {
	model    string
	hasher   *hashing.Hasher
	idx      *index.Index
	sub      *zmq.Subscriber
	pick     *picker.Picker
	backends []*Backend
	client   *http.Client
	log      *slog.Logger
	seq      atomic.Uint64

	mu     sync.Mutex // guards scores
	scores []picker.Score
}

// Config configures a Router.
type Config struct {
	// Model is the model the pods serve, as their events name it.
	Model    string
	Backends []*Backend
	// Hashing is the engines' block hashing configuration; the zero value
	// is vLLM's default.
	Hashing hashing.Config
	// EventsBind is the endpoint the router's subscriber binds and the
	// engines' publishers connect to, e.g. "tcp://127.0.0.1:5557"; with
	// port 0 the subscriber picks a free port (Subscriber().Addrs()).
	EventsBind string
	// MinCachedTokenDelta is the picker's pull threshold in tokens; 0 means
	// the picker's default.
	MinCachedTokenDelta int
	Client              *http.Client
	Logger              *slog.Logger
}

// NewRouter builds the router's SDK path: a hasher, an index fed by a KV
// event subscriber, and a picker. Run the subscriber with Subscriber().Run.
func NewRouter(cfg Config) (*Router, error) {
	if len(cfg.Backends) == 0 {
		return nil, errors.New("router: no backends")
	}
	h, err := hashing.New(cfg.Hashing)
	if err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	idx := index.New(index.Config{})
	sub, err := zmq.NewSubscriber(zmq.SubscriberConfig{
		Events: events.Config{Sink: idx, Hasher: h, Logger: log},
		Bind:   []string{cfg.EventsBind},
	})
	if err != nil {
		return nil, err
	}
	// Only holders the subscriber hears, connected, serve pulls.
	pk, err := picker.New(picker.Config{Index: idx, Hasher: h, MinCachedTokenDelta: cfg.MinCachedTokenDelta, Sources: sub.Source})
	if err != nil {
		return nil, err
	}
	c := cfg.Client
	if c == nil {
		c = http.DefaultClient
	}
	return &Router{model: cfg.Model, hasher: h, idx: idx, sub: sub, pick: pk, backends: cfg.Backends, client: c, log: log}, nil
}

// Subscriber returns the router's KV event subscriber.
func (rt *Router) Subscriber() *zmq.Subscriber { return rt.sub }

// Index returns the router's index.
func (rt *Router) Index() *index.Index { return rt.idx }

// Handler returns the router's HTTP API: POST /v1/completions and
// GET /v1/pods.
func (rt *Router) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", rt.completions)
	mux.HandleFunc("GET /v1/pods", rt.pods)
	return mux
}

func (rt *Router) pods(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"pods": rt.sub.Status()})
}

func httpError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "code": code}})
}

// maxBody bounds a request body.
const maxBody = 64 << 20

// completion is the part of an OpenAI completions request the router reads;
// every other field is passed through untouched.
type completion struct {
	Model     string          `json:"model"`
	Prompt    json.RawMessage `json:"prompt"`
	CacheSalt string          `json:"cache_salt"`
	RequestID string          `json:"request_id"`
	// KVTransferParams is read only to find a source the client named.
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

// tokens parses a prompt given as token ids.
func tokens(raw json.RawMessage) ([]uint32, error) {
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err != nil {
		return nil, errors.New("prompt must be an array of token ids (this router hashes tokens exactly as vLLM does; tokenize first)")
	}
	out := make([]uint32, len(ids))
	for i, v := range ids {
		if v < 0 || v > 1<<32-1 {
			return nil, fmt.Errorf("prompt token %d (%d) is not a uint32 token id", i, v)
		}
		out[i] = uint32(v)
	}
	return out, nil
}

func (rt *Router) completions(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		httpError(w, http.StatusRequestEntityTooLarge, err.Error())
		return
	}
	var c completion
	if err := json.Unmarshal(body, &c); err != nil {
		httpError(w, http.StatusBadRequest, "body is not a JSON completions request: "+err.Error())
		return
	}
	if len(c.Prompt) == 0 {
		httpError(w, http.StatusBadRequest, "prompt is required")
		return
	}
	toks, err := tokens(c.Prompt)
	if err != nil {
		httpError(w, http.StatusBadRequest, err.Error())
		return
	}
	id := c.RequestID
	if id == "" {
		id = "kvsource-" + strconv.FormatUint(rt.seq.Add(1), 10)
	}
	keys, err := rt.hasher.BlockKeys(nil, hashing.Request{Tokens: toks, CacheSalt: c.CacheSalt})
	if err != nil {
		httpError(w, http.StatusBadRequest, err.Error())
		return
	}

	dest, err := rt.place(keys)
	if err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	d, err := rt.pick.Pick(picker.Request{ID: id, Model: rt.model, Keys: keys, Destination: index.Holder{Pod: dest.Addr}, Candidates: rt.candidates()})
	if err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	defer d.Done()

	// Only the picker names a source: a client's own source header or
	// remote_kv_source would have the pod pull from wherever it says.
	out := r.Header.Clone()
	out.Del(picker.HeaderKVCacheSource)
	var params *picker.KVTransferParams
	if d.Reason == picker.ReasonPull {
		name, value := d.Header()
		out.Set(name, value)
		p := rt.transferParams(&d, id)
		params = &p
	} else if namesSource(c.KVTransferParams) {
		params = &picker.KVTransferParams{}
	}
	if params != nil {
		if body, err = withTransferParams(body, *params); err != nil {
			httpError(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	rt.log.Info("route", "request", id, "destination", dest.Addr, "reason", d.Reason, "source", d.Source.Pod,
		"cached_blocks", d.Cached, "pull_blocks", d.Gain, "recompute_blocks", d.Recompute)
	w.Header().Set(HeaderDestination, dest.Addr)
	w.Header().Set(HeaderReason, string(d.Reason))
	if d.Reason == picker.ReasonPull {
		w.Header().Set(HeaderSource, d.Source.Pod)
	}
	rt.proxy(w, r, dest, out, body)
}

// place returns the backend with the fewest requests in flight; among equally
// loaded ones, the one holding the longest prefix of the prompt.
func (rt *Router) place(keys []uint64) (*Backend, error) {
	least := rt.backends[0].inflight.Load()
	for _, b := range rt.backends[1:] {
		least = min(least, b.inflight.Load())
	}
	var tied []picker.Candidate
	var first *Backend
	for _, b := range rt.backends {
		if b.inflight.Load() == least {
			tied = append(tied, picker.Candidate{Holder: index.Holder{Pod: b.Addr}})
			if first == nil {
				first = b
			}
		}
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	var err error
	rt.scores, err = rt.pick.Score(picker.Request{Model: rt.model, Keys: keys, Candidates: tied}, rt.scores)
	if err != nil {
		return nil, err
	}
	if len(rt.scores) > 0 && rt.scores[0].Blocks > 0 {
		return rt.backend(rt.scores[0].Holder.Pod), nil
	}
	return first, nil
}

func (rt *Router) backend(addr string) *Backend {
	for _, b := range rt.backends {
		if b.Addr == addr {
			return b
		}
	}
	return nil
}

// candidates lists every backend as a pull source with its load.
func (rt *Router) candidates() []picker.Candidate {
	cs := make([]picker.Candidate, len(rt.backends))
	for i, b := range rt.backends {
		cs[i] = picker.Candidate{Holder: index.Holder{Pod: b.Addr}, Waiting: int(b.inflight.Load())}
	}
	return cs
}

// transferParams renders the decision as vLLM's kv_transfer_params, with the
// source's own P2P port when the router knows it.
func (rt *Router) transferParams(d *picker.Decision, id string) picker.KVTransferParams {
	p := d.KVTransferParams(id)
	if src := rt.backend(d.Source.Pod); src != nil && src.P2PPort > 0 && p.RemoteKVSource != nil {
		p.RemoteKVSource.RemotePort = src.P2PPort + d.Source.Rank
	}
	return p
}

// namesSource reports whether a request's kv_transfer_params carry a
// remote_kv_source.
func namesSource(raw json.RawMessage) bool {
	var params map[string]json.RawMessage
	if json.Unmarshal(raw, &params) != nil {
		return false
	}
	_, ok := params["remote_kv_source"]
	return ok
}

// withTransferParams sets body's kv_transfer_params.remote_kv_source to p's
// (removes it when p names none), keeping every other field and any other
// kv_transfer_params entry as it was.
func withTransferParams(body []byte, p picker.KVTransferParams) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, err
	}
	params := map[string]json.RawMessage{}
	if raw, ok := m["kv_transfer_params"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &params); err != nil {
			return nil, fmt.Errorf("kv_transfer_params is not an object: %w", err)
		}
	}
	if p.RemoteKVSource == nil {
		delete(params, "remote_kv_source")
	} else {
		src, err := json.Marshal(p.RemoteKVSource)
		if err != nil {
			return nil, err
		}
		params["remote_kv_source"] = src
	}
	var err error
	if m["kv_transfer_params"], err = json.Marshal(params); err != nil {
		return nil, err
	}
	return json.Marshal(m)
}

// hopHeaders are connection-level headers a proxy must not forward.
var hopHeaders = []string{"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

func (rt *Router) proxy(w http.ResponseWriter, r *http.Request, b *Backend, h http.Header, body []byte) {
	b.inflight.Add(1)
	defer b.inflight.Add(-1)
	req, err := http.NewRequestWithContext(r.Context(), http.MethodPost, "http://"+b.Addr+r.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
	h.Del("Content-Length")
	req.Header = h
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		req.Header.Add("X-Forwarded-For", host)
	}
	resp, err := rt.client.Do(req)
	if err != nil {
		httpError(w, http.StatusBadGateway, fmt.Sprintf("pod %s: %v", b.Addr, err))
		return
	}
	defer resp.Body.Close()
	for k, vs := range resp.Header {
		for _, v := range vs {
			w.Header().Add(k, v)
		}
	}
	w.WriteHeader(resp.StatusCode)
	if _, err := io.Copy(w, resp.Body); err != nil {
		rt.log.Warn("proxy copy", "pod", b.Addr, "err", err)
	}
}
