// Command eppplugin shows kvsource's index and picker inside an llm-d
// endpoint-picker (EPP) plugin. The plugin interfaces are mirrored in
// epp.go; a small director in this file runs the EPP's request flow against
// them: data producers, scorers, a max-score picker, then PreRequest
// plugins, and the response hook. Simulated engines publish real vLLM KV
// events to the plugin's subscriber over ZMQ on loopback.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"slices"
	"time"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintf(os.Stderr, "eppplugin: %v\n", err)
		os.Exit(1)
	}
}

// queueScorer is a Distribution scorer standing in for the EPP's queue
// scorer: the shorter an endpoint's waiting queue, the higher its score.
type queueScorer struct{}

func (queueScorer) TypedName() TypedName     { return TypedName{Type: "queue-scorer"} }
func (queueScorer) Category() ScorerCategory { return Distribution }
func (queueScorer) Score(_ context.Context, _ *CycleState, _ *InferenceRequest, eps []Endpoint) map[Endpoint]float64 {
	most := 0
	for _, e := range eps {
		most = max(most, e.GetMetrics().WaitingQueueSize)
	}
	out := make(map[Endpoint]float64, len(eps))
	for _, e := range eps {
		out[e] = 1
		if most > 0 {
			out[e] = 1 - float64(e.GetMetrics().WaitingQueueSize)/float64(most)
		}
	}
	return out
}

// weighted is a scorer with its weight in the scheduler profile.
type weighted struct {
	Scorer
	weight float64
}

// Director runs the EPP's request flow over the mirrored interfaces: one
// scheduler profile ("default") with weighted scorers and a max-score pick.
type Director struct {
	Producers []PrepareDataPlugin
	Scorers   []weighted
	Pre       []PreRequest
	Response  []ResponseBody
	Log       *slog.Logger
}

// Schedule runs data producers, scores and picks, and PreRequest plugins.
func (d *Director) Schedule(ctx context.Context, req *InferenceRequest, eps []Endpoint) (*SchedulingResult, error) {
	for _, p := range d.Producers {
		// As in the EPP, a failed producer is logged and scheduling goes
		// on without its data.
		if err := p.PrepareRequestData(ctx, req, eps); err != nil {
			d.Log.Warn("data producer failed", "plugin", p.TypedName().Type, "err", err)
		}
	}
	if len(eps) == 0 {
		return nil, errors.New("no endpoints")
	}
	total := make(map[Endpoint]float64, len(eps))
	cycle := &CycleState{}
	for _, s := range d.Scorers {
		for e, v := range s.Score(ctx, cycle, req, eps) {
			total[e] += s.weight * min(max(v, 0), 1)
		}
	}
	best := eps[0]
	for _, e := range eps[1:] {
		if total[e] > total[best] {
			best = e
		}
	}
	res := &SchedulingResult{PrimaryProfileName: "default", ProfileResults: map[string]*ProfileRunResult{"default": {TargetEndpoints: []Endpoint{best}}}}
	for _, p := range d.Pre {
		p.PreRequest(ctx, req, res)
	}
	return res, nil
}

// Done runs the response hooks for the end of a response.
func (d *Director) Done(ctx context.Context, req *InferenceRequest, target Endpoint) {
	for _, p := range d.Response {
		p.ResponseBody(ctx, req, &Response{RequestID: req.RequestID, EndOfStream: true}, target.GetMetadata())
	}
}

// engine is a simulated vLLM engine's event publisher.
type engine struct {
	pub    *zmq.Publisher
	hasher *hashing.Hasher
}

// cache publishes that the engine holds tokens' blocks on GPU and, offloaded,
// on CPU, as vLLM does after a prefill, and returns the batch's sequence
// number.
func (e *engine) cache(tokens []uint32) (uint64, error) {
	keys, err := e.hasher.BlockKeys(nil, hashing.Request{Tokens: tokens})
	if err != nil {
		return 0, err
	}
	bs := e.hasher.Config().BlockSize
	var b events.Batch
	for _, tier := range []string{index.TierGPU, index.TierCPU} {
		b.Events = append(b.Events, events.Event{
			Type: events.EventBlockStored, Medium: tier, BlockHashes: keys, BlockSize: bs, TokenIDs: tokens[:len(keys)*bs],
		})
	}
	return e.pub.Publish(&b)
}

// Setup is the walkthrough's world: the plugin with its subscriber running,
// three endpoints and their engines.
type Setup struct {
	Plugin    *KVSource
	Director  *Director
	Endpoints []Endpoint
	engines   []*engine
	cancel    context.CancelFunc
	done      chan error
}

const model = "example/model"

// Start builds the plugin, its subscriber and n endpoints with engines, and
// returns once the plugin has applied a batch of every engine.
func Start(ctx context.Context, n int, log *slog.Logger) (*Setup, error) {
	p, err := New(Config{Name: "kv", Events: &zmq.SubscriberConfig{Bind: []string{"tcp://127.0.0.1:0"}, TopicPrefix: "kv@"},
		MinCachedTokenDelta: 256, Logger: log})
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	s := &Setup{Plugin: p, cancel: cancel, done: make(chan error, 1)}
	go func() { s.done <- p.Run(rctx) }()
	select {
	case <-p.Subscriber().Ready():
	case err := <-s.done:
		s.done <- err
		s.Close()
		return nil, fmt.Errorf("subscriber: %w", err)
	}
	s.Director = &Director{
		Producers: []PrepareDataPlugin{p},
		Scorers:   []weighted{{p, 1}, {queueScorer{}, 2}},
		Pre:       []PreRequest{p},
		Response:  []ResponseBody{p},
		Log:       log,
	}
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	for i := range n {
		meta := EndpointMetadata{Name: fmt.Sprintf("vllm-%d", i), Address: fmt.Sprintf("10.0.0.%d", i+1), Port: "8000"}
		ep := NewEndpoint(meta, Metrics{})
		s.Endpoints = append(s.Endpoints, ep)
		pub, err := zmq.NewPublisher(zmq.PublisherConfig{Connect: p.Subscriber().Addrs()[0], Topic: fmt.Sprintf("kv@%s@%s", meta.HostPort(), model)})
		if err != nil {
			s.Close()
			return nil, err
		}
		h, err := hashing.New(hashing.Config{})
		if err != nil {
			pub.Close()
			s.Close()
			return nil, err
		}
		s.engines = append(s.engines, &engine{pub: pub, hasher: h})
		// ZMQ drops what a publisher sends before the subscription reaches
		// it: wait for it, then for the plugin to apply a first batch.
		err = pub.WaitSubscribed(wctx)
		var seq uint64
		if err == nil {
			seq, err = pub.Publish(&events.Batch{})
		}
		if err == nil {
			err = p.Subscriber().WaitApplied(wctx, holderOf(ep), seq)
		}
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("engine %s's KV events never reached the plugin: %w", meta.HostPort(), err)
		}
	}
	return s, nil
}

// Cache makes endpoint i's engine cache tokens and waits until the plugin's
// index has the blocks.
func (s *Setup) Cache(ctx context.Context, i int, tokens []uint32) error {
	seq, err := s.engines[i].cache(tokens)
	if err != nil {
		return err
	}
	keys, err := s.engines[i].hasher.BlockKeys(nil, hashing.Request{Tokens: tokens})
	if err != nil {
		return err
	}
	h := holderOf(s.Endpoints[i])
	if err := s.Plugin.Subscriber().WaitApplied(ctx, h, seq); err != nil {
		return err
	}
	if got := s.Plugin.Index().Run(model, h, keys, 0, nil); got < len(keys) {
		return fmt.Errorf("engine %d: the index holds %d of %d blocks after applying its batch", i, got, len(keys))
	}
	return nil
}

// Close stops the subscriber and the engines.
func (s *Setup) Close() {
	for _, e := range s.engines {
		e.pub.Close()
	}
	s.cancel()
	<-s.done
}

func randomTokens(rng *rand.Rand, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(rng.IntN(152064))
	}
	return t
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("eppplugin", flag.ContinueOnError)
	fs.SetOutput(stderr)
	verbose := fs.Bool("v", false, "log the plugin's decisions")
	if err := fs.Parse(args); err != nil {
		return err
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	s, err := Start(ctx, 3, log)
	if err != nil {
		return err
	}
	defer s.Close()

	rng := rand.New(rand.NewPCG(3, 3)) //nolint:gosec // example data
	system := randomTokens(rng, 8192)
	if err := s.Cache(ctx, 0, system); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s (%s) caches an 8192-token system prompt; its KV events reach the plugin's index over ZMQ.\n\n",
		s.Endpoints[0].GetMetadata().Name, s.Endpoints[0].GetMetadata().HostPort())
	for i, waiting := range [][]int{{0, 0, 0}, {12, 1, 0}} {
		for j, e := range s.Endpoints {
			e.GetMetrics().WaitingQueueSize = waiting[j]
		}
		req := &InferenceRequest{
			RequestID: fmt.Sprintf("req-%d", i+1), TargetModel: model,
			Headers:  map[string]string{},
			Body:     map[string]any{"model": model},
			TokenIDs: append(slices.Clone(system), randomTokens(rng, 200)...),
		}
		res, err := s.Director.Schedule(ctx, req, s.Endpoints)
		if err != nil {
			return err
		}
		target := res.ProfileResults[res.PrimaryProfileName].TargetEndpoints[0]
		fmt.Fprintf(stdout, "%s, waiting queues %v:\n", req.RequestID, waiting)
		for _, e := range s.Endpoints {
			v, _ := e.Get(PrefixMatchKey)
			m := v.(*PrefixMatch)
			fmt.Fprintf(stdout, "  %s  prefix %4d/%d blocks (GPU %d, CPU %d)\n", e.GetMetadata().Name, m.Blocks, m.PromptBlocks, m.GPU, m.CPU)
		}
		fmt.Fprintf(stdout, "  scheduled on %s\n", target.GetMetadata().Name)
		if src, ok := req.Headers[picker.HeaderKVCacheSource]; ok {
			params := req.Body["kv_transfer_params"].(map[string]any)["remote_kv_source"].(*picker.RemoteKVSource)
			fmt.Fprintf(stdout, "  PreRequest: %s: %s\n  kv_transfer_params.remote_kv_source: {kv_request_id: %s, remote_host: %s, remote_port: %d}\n",
				picker.HeaderKVCacheSource, src, params.KVRequestID, params.RemoteHost, params.RemotePort)
		} else {
			fmt.Fprintf(stdout, "  PreRequest: no source header (the prefix is local)\n")
		}
		s.Director.Done(ctx, req, target)
		fmt.Fprintln(stdout)
	}
	fmt.Fprintf(stdout, "in flight after the responses ended: %d\n", s.Plugin.Picker().Inflight(holderOf(s.Endpoints[0])))
	return nil
}
