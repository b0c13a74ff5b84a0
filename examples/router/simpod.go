package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/transfer"
	"github.com/kvsource/kvsource/transfer/fake"
)

// SimPod is a simulated vLLM pod: an OpenAI completions endpoint on loopback
// that hashes each prompt as vLLM does, keeps the blocks in a GPU cache and a
// CPU offload tier, publishes the changes as vLLM KV events, and, when the
// request's kv_transfer_params name a remote source, pulls the missing
// prefix from that peer through a transfer client before "computing" the
// rest. It stands in for vLLM in the example and its test.
type SimPod struct {
	srv    *httptest.Server
	model  string
	hasher *hashing.Hasher
	pub    *zmq.Publisher
	net    *fake.Network
	peer   *fake.Peer    // this pod's CPU tier as P2P peers see it
	p2p    string        // this pod's P2P address on the network
	gate   chan struct{} // guarded by mu

	mu  sync.Mutex
	gpu map[uint64]bool
	cpu map[uint64]bool
	log []Served
}

// Served records one request as the pod saw it.
type Served struct {
	RequestID     string
	SourceHeader  string        // llm-d's x-kv-cache-source-host-port
	RemoteSource  *remoteSource // vLLM's kv_transfer_params.remote_kv_source
	PromptBlocks  int
	CachedBlocks  int // held locally before the request
	PulledBlocks  int // pulled from the remote source and verified
	PullBytes     int64
	PullVerified  bool
	PullError     string
	ComputeBlocks int
}

// remoteSource is kv_transfer_params.remote_kv_source as vLLM parses it.
type remoteSource struct {
	KVRequestID string `json:"kv_request_id"`
	RemoteHost  string `json:"remote_host"`
	RemotePort  int    `json:"remote_port"`
}

// SimPodConfig configures a SimPod.
type SimPodConfig struct {
	Model   string
	Hashing hashing.Config
	// Network is the P2P network pods pull through, and P2PAddr this pod's
	// address on it ("127.0.0.1:port").
	Network *fake.Network
	P2PAddr string
}

// NewSimPod starts a pod.
func NewSimPod(cfg SimPodConfig) (*SimPod, error) {
	h, err := hashing.New(cfg.Hashing)
	if err != nil {
		return nil, err
	}
	p := &SimPod{
		model: cfg.Model, hasher: h, net: cfg.Network, p2p: cfg.P2PAddr,
		gpu: map[uint64]bool{}, cpu: map[uint64]bool{},
	}
	p.peer = cfg.Network.AddPeer(cfg.P2PAddr)
	p.srv = httptest.NewServer(http.HandlerFunc(p.serve))
	return p, nil
}

// ConnectEvents connects the pod's KV event publisher to the router's
// subscriber endpoint, as vLLM does with a tcp:// endpoint without '*', and
// returns once the subscription has reached it, so that no batch published
// afterwards is lost to ZMQ's slow joiner. Call it once, before the pod
// serves requests.
func (p *SimPod) ConnectEvents(ctx context.Context, endpoint string) error {
	pub, err := zmq.NewPublisher(zmq.PublisherConfig{
		Connect: endpoint,
		Topic:   fmt.Sprintf("kv@%s@%s", p.Addr(), p.model),
	})
	if err != nil {
		return err
	}
	if err := pub.WaitSubscribed(ctx); err != nil {
		pub.Close()
		return fmt.Errorf("pod %s: %w", p.Addr(), err)
	}
	p.pub = pub
	return nil
}

// Addr returns the pod's HTTP address, "127.0.0.1:port".
func (p *SimPod) Addr() string { return strings.TrimPrefix(p.srv.URL, "http://") }

// P2PPort returns the port of the pod's P2P address.
func (p *SimPod) P2PPort() int {
	i := strings.LastIndexByte(p.p2p, ':')
	port, _ := strconv.Atoi(p.p2p[i+1:])
	return port
}

// Hold makes the pod hold every request it receives until gate is closed
// (nil: serve at once), to keep it busy in a walkthrough or a test.
func (p *SimPod) Hold(gate chan struct{}) {
	p.mu.Lock()
	p.gate = gate
	p.mu.Unlock()
}

// Served returns what the pod has served so far.
func (p *SimPod) Served() []Served {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Served(nil), p.log...)
}

// Ping publishes an empty batch, so a subscriber learns of the pod, and
// returns its sequence number.
func (p *SimPod) Ping() (uint64, error) {
	return p.pub.Publish(&events.Batch{})
}

// Close stops the pod.
func (p *SimPod) Close() {
	p.srv.Close()
	if p.pub != nil {
		p.pub.Close()
	}
	p.net.RemovePeer(p.p2p)
}

type simRequest struct {
	Prompt           []uint32 `json:"prompt"`
	CacheSalt        string   `json:"cache_salt"`
	MaxTokens        int      `json:"max_tokens"`
	KVTransferParams struct {
		RemoteKVSource *remoteSource `json:"remote_kv_source"`
	} `json:"kv_transfer_params"`
}

func (p *SimPod) serve(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	gate := p.gate
	p.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-r.Context().Done():
			return
		}
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req simRequest
	if err := json.Unmarshal(body, &req); err != nil {
		http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
		return
	}
	blocks, err := p.hasher.Blocks(nil, hashing.Request{Tokens: req.Prompt, CacheSalt: req.CacheSalt})
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s := Served{
		SourceHeader: r.Header.Get("x-kv-cache-source-host-port"),
		RemoteSource: req.KVTransferParams.RemoteKVSource,
		PromptBlocks: len(blocks),
	}
	if s.RemoteSource != nil {
		s.RequestID = s.RemoteSource.KVRequestID
	}

	p.mu.Lock()
	for _, b := range blocks {
		if !p.gpu[b.Key] && !p.cpu[b.Key] {
			break
		}
		s.CachedBlocks++
	}
	p.mu.Unlock()

	if src := s.RemoteSource; src != nil && s.CachedBlocks < len(blocks) {
		p.pull(r.Context(), &s, blocks[s.CachedBlocks:], fmt.Sprintf("%s:%d", src.RemoteHost, src.RemotePort))
	}
	s.ComputeBlocks = len(blocks) - s.CachedBlocks - s.PulledBlocks
	p.store(req.Prompt, blocks)

	p.mu.Lock()
	p.log = append(p.log, s)
	p.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{
		"id": "cmpl-" + strconv.FormatInt(time.Now().UnixNano(), 36), "object": "text_completion", "model": p.model,
		"choices": []map[string]any{{"index": 0, "text": "", "finish_reason": "length"}},
		"usage": map[string]any{
			"prompt_tokens": len(req.Prompt), "completion_tokens": 0, "total_tokens": len(req.Prompt),
			"prompt_tokens_details": map[string]any{"cached_tokens": (s.CachedBlocks + s.PulledBlocks) * p.hasher.Config().BlockSize},
		},
		"kv_pull": map[string]any{"blocks": s.PulledBlocks, "bytes": s.PullBytes, "verified": s.PullVerified, "error": s.PullError},
	})
}

// pull fetches the blocks the source still holds, in order, and verifies
// every block's content.
func (p *SimPod) pull(ctx context.Context, s *Served, want []hashing.Block, addr string) {
	keys := make([]transfer.Key, len(want))
	for i, b := range want {
		keys[i] = transfer.NewKey(b.Digest.Bytes(), 0)
	}
	bl := p.net.BlockLen()
	dst := make([]byte, len(keys)*bl)
	sess, err := p.net.Client(dst).Connect(ctx, addr)
	if err != nil {
		s.PullError = err.Error()
		return
	}
	defer sess.Close()
	hits, err := sess.Lookup(ctx, keys)
	if err != nil {
		s.PullError = err.Error()
		return
	}
	n := transfer.Prefix(hits)
	if n == 0 {
		_, _ = sess.Fetch(ctx, nil, nil)
		return
	}
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	st, err := sess.Fetch(ctx, keys[:n], idx)
	if err != nil {
		s.PullError = err.Error()
		return
	}
	s.PulledBlocks, s.PullBytes = n, st.Bytes
	s.PullVerified = st.Blocks == n
	for i := range n {
		if !bytes.Equal(dst[i*bl:(i+1)*bl], fake.Content(keys[i], bl)) {
			s.PullVerified = false
		}
	}
}

// store caches every block in both tiers (the CPU tier by write-through
// offload) and publishes what is new.
func (p *SimPod) store(tokens []uint32, blocks []hashing.Block) {
	bs := p.hasher.Config().BlockSize
	p.mu.Lock()
	defer p.mu.Unlock()
	var batch events.Batch
	for _, tier := range []string{"GPU", "CPU"} {
		cache := p.gpu
		if tier == "CPU" {
			cache = p.cpu
		}
		for i := 0; i < len(blocks); {
			if cache[blocks[i].Key] {
				i++
				continue
			}
			j := i
			e := events.Event{Type: events.EventBlockStored, Medium: tier, BlockSize: bs}
			for ; j < len(blocks) && !cache[blocks[j].Key]; j++ {
				cache[blocks[j].Key] = true
				e.BlockHashes = append(e.BlockHashes, blocks[j].Key)
				if tier == "CPU" {
					p.peer.Hold(transfer.NewKey(blocks[j].Digest.Bytes(), 0))
				}
			}
			if i > 0 {
				e.Parent = events.Some(blocks[i-1].Key)
			}
			e.TokenIDs = tokens[i*bs : j*bs]
			batch.Events = append(batch.Events, e)
			i = j
		}
	}
	if len(batch.Events) > 0 {
		batch.TS = float64(time.Now().UnixNano()) / 1e9
		_, _ = p.pub.Publish(&batch)
	}
}

func hashingRequest(tokens []uint32) hashing.Request { return hashing.Request{Tokens: tokens} }
