// Command router is a small HTTP router built on kvsource: OpenAI-style
// completions with token ids, least-loaded placement, and the picker's pull
// decision applied as llm-d's x-kv-cache-source-host-port header and vLLM's
// kv_transfer_params. It starts simulated vLLM pods on loopback (HTTP
// servers that publish real KV events and serve pulls), walks through a
// pull, a local hit and a cold start, and prints what happened. With
// --serve it keeps serving for curl.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"text/tabwriter"
	"time"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/transfer/fake"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintf(os.Stderr, "router: %v\n", err)
		os.Exit(1)
	}
}

// Fleet is a router with its simulated pods, all on loopback.
type Fleet struct {
	Router *Router
	Pods   []*SimPod
	URL    string // the router's base URL
	srv    *http.Server
	cancel context.CancelFunc
	done   chan error
}

const model = "example/model"

func freeEndpoint() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// StartFleet starts n simulated pods and a router for them, and returns
// once the router has applied a batch of every pod.
func StartFleet(ctx context.Context, n int, log *slog.Logger) (*Fleet, error) {
	network := fake.New(fake.Config{BlockLen: 256})
	f := &Fleet{done: make(chan error, 1)}
	var backends []*Backend
	for range n {
		p2p, err := freeEndpoint()
		if err != nil {
			f.Close()
			return nil, err
		}
		pod, err := NewSimPod(SimPodConfig{Model: model, Network: network, P2PAddr: p2p})
		if err != nil {
			f.Close()
			return nil, err
		}
		f.Pods = append(f.Pods, pod)
		backends = append(backends, &Backend{Addr: pod.Addr(), P2PPort: pod.P2PPort()})
	}
	var err error
	if f.Router, err = NewRouter(Config{Model: model, Backends: backends, EventsBind: "tcp://127.0.0.1:0",
		MinCachedTokenDelta: 256, Logger: log}); err != nil {
		f.Close()
		return nil, err
	}
	sctx, cancel := context.WithCancel(ctx)
	f.cancel = cancel
	sub := f.Router.Subscriber()
	go func() { f.done <- sub.Run(sctx) }()
	select {
	case <-sub.Ready():
	case err := <-f.done:
		f.done <- err
		f.Close()
		return nil, fmt.Errorf("subscriber: %w", err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	for _, p := range f.Pods {
		if err := p.ConnectEvents(wctx, sub.Addrs()[0]); err != nil {
			f.Close()
			return nil, err
		}
		seq, err := p.Ping()
		if err == nil {
			err = sub.WaitApplied(wctx, index.Holder{Pod: p.Addr()}, seq)
		}
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("pod %s's KV events never reached the router: %w", p.Addr(), err)
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Close()
		return nil, err
	}
	f.URL = "http://" + l.Addr().String()
	f.srv = &http.Server{Handler: f.Router.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = f.srv.Serve(l) }()
	return f, nil
}

// WaitIndexed waits until the router's index shows pod holding every full
// block of tokens, checking after each batch of the pod the router applies.
func (f *Fleet) WaitIndexed(ctx context.Context, pod *SimPod, tokens []uint32) error {
	keys, err := f.Router.hasher.BlockKeys(nil, hashingRequest(tokens))
	if err != nil {
		return err
	}
	h := index.Holder{Pod: pod.Addr()}
	for f.Router.Index().Run(model, h, keys, 0, nil) < len(keys) {
		next := uint64(0)
		if seq, ok := f.Router.Subscriber().LastSeq(h); ok {
			next = seq + 1
		}
		if err := f.Router.Subscriber().WaitApplied(ctx, h, next); err != nil {
			return fmt.Errorf("pod %s's blocks never reached the index: %w", pod.Addr(), err)
		}
	}
	return nil
}

// Close stops everything.
func (f *Fleet) Close() {
	if f.srv != nil {
		f.srv.Close()
	}
	if f.cancel != nil {
		f.cancel()
		<-f.done
	}
	for _, p := range f.Pods {
		p.Close()
	}
}

// Reply is what the walkthrough reads from a completion.
type Reply struct {
	Destination, Reason, Source string
	CachedTokens                int
	Pull                        struct {
		Blocks   int   `json:"blocks"`
		Bytes    int64 `json:"bytes"`
		Verified bool  `json:"verified"`
	}
}

// Complete sends a completions request with a token-id prompt.
func (f *Fleet) Complete(ctx context.Context, prompt []uint32) (*Reply, error) {
	body, err := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": 16})
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, f.URL+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("router: %s: %s", resp.Status, bytes.TrimSpace(b))
	}
	var out struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
		Pull json.RawMessage `json:"kv_pull"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, err
	}
	r := &Reply{Destination: resp.Header.Get(HeaderDestination), Reason: resp.Header.Get(HeaderReason), Source: resp.Header.Get(HeaderSource), CachedTokens: out.Usage.Details.Cached}
	if err := json.Unmarshal(out.Pull, &r.Pull); err != nil {
		return nil, err
	}
	return r, nil
}

func randomTokens(rng *rand.Rand, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(rng.IntN(152064))
	}
	return t
}

func join(a, b []uint32) []uint32 { return append(append([]uint32(nil), a...), b...) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	fs.SetOutput(stderr)
	pods := fs.Int("pods", 3, "simulated pods")
	serve := fs.Bool("serve", false, "keep serving after the walkthrough (Ctrl-C to stop)")
	verbose := fs.Bool("v", false, "log every routing decision")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *pods < 2 {
		return errors.New("--pods must be at least 2: a pull needs a peer")
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	f, err := StartFleet(ctx, *pods, log)
	if err != nil {
		return err
	}
	defer f.Close()
	fmt.Fprintf(stdout, "router on %s, %d simulated vLLM pods:", f.URL, len(f.Pods))
	for _, p := range f.Pods {
		fmt.Fprintf(stdout, " %s", p.Addr())
	}
	fmt.Fprintln(stdout)

	rng := rand.New(rand.NewPCG(7, 7)) //nolint:gosec // example data
	system := randomTokens(rng, 8192)  // a long shared system prompt
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "step\tdestination\treason\tsource\tcached tokens\tpulled blocks\tverified")
	step := func(name string, prompt []uint32) error {
		r, err := f.Complete(ctx, prompt)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		src := r.Source
		if src == "" {
			src = "-"
		}
		verified := "-"
		if r.Pull.Blocks > 0 {
			verified = fmt.Sprint(r.Pull.Verified)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%s\n", name, r.Destination, r.Reason, src, r.CachedTokens, r.Pull.Blocks, verified)
		return nil
	}
	// 1. A cold start: nobody holds the system prompt.
	first := join(system, randomTokens(rng, 300))
	if err := step("1 cold start", first); err != nil {
		return err
	}
	if err := f.WaitIndexed(ctx, f.Pods[0], first); err != nil {
		return err
	}
	// 2. The holder is busy, so load-aware placement picks another pod,
	// and the picker has it pull the system prompt instead of recomputing.
	busy := make(chan struct{})
	f.Pods[0].Hold(busy)
	parked := make(chan error, 1)
	go func() {
		_, err := f.Complete(ctx, randomTokens(rng, 512))
		parked <- err
	}()
	for f.Router.backends[0].inflight.Load() == 0 {
		select {
		case err := <-parked:
			return fmt.Errorf("the request keeping the holder busy ended before it reached the holder: %v", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	second := join(system, randomTokens(rng, 300))
	if err := step("2 holder busy", second); err != nil {
		return err
	}
	close(busy)
	if err := <-parked; err != nil {
		return err
	}
	f.Pods[0].Hold(nil)
	// 3. Everyone idle: the prefix holder wins the tie and hits locally.
	if err := step("3 idle fleet", join(system, randomTokens(rng, 300))); err != nil {
		return err
	}
	tw.Flush()
	if !*serve {
		return nil
	}
	fmt.Fprintf(stdout, "\nserving; try:\n  curl -s %s/v1/completions -d '{\"model\":\"%s\",\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}' -D -\n  curl -s %s/v1/pods\n", f.URL, model, f.URL)
	<-ctx.Done()
	return nil
}
