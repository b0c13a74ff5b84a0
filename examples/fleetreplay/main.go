// Command fleetreplay replays the published P2P experiments on a simulated
// vLLM fleet, with every routing decision made by the kvsource SDK: the pods
// publish real vLLM KV events over ZMQ on loopback, a subscriber feeds a live
// index, the picker decides, and pulls go through a transfer client and are
// verified. Time is virtual (a discrete-event simulation, deterministic by
// seed); prefills running at once on a pod share its compute.
//
// Usage:
//
//	go run ./examples/fleetreplay [flags]
//
// It prints one table per scenario, writes per-request TTFT plots (PNG and
// SVG) to --out, and with --json every table as JSON.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/kvsource/kvsource/hashing"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// floats is a comma-separated list of numbers.
type floats []float64

func (f *floats) String() string {
	s := make([]string, len(*f))
	for i, v := range *f {
		s[i] = strconv.FormatFloat(v, 'g', -1, 64)
	}
	return strings.Join(s, ",")
}

func (f *floats) Set(v string) error {
	var out []float64
	for _, part := range strings.Split(v, ",") {
		x, err := strconv.ParseFloat(strings.TrimSpace(part), 64)
		if err != nil || x <= 0 {
			return fmt.Errorf("%q is not a positive number", part)
		}
		out = append(out, x)
	}
	*f = out
	return nil
}

// costFlag sets a CostModel from key=value pairs.
type costFlag struct{ m *CostModel }

var costKeys = []string{"linear", "quadratic", "pull-floor", "pull-per-token", "cpu-load", "first-token"}

func (c costFlag) fields() []*float64 {
	m := c.m
	return []*float64{&m.Linear, &m.Quadratic, &m.PullFloor, &m.PullPerToken, &m.CPULoad, &m.FirstToken}
}

func (c costFlag) String() string {
	if c.m == nil {
		return ""
	}
	var s []string
	for i, p := range c.fields() {
		s = append(s, costKeys[i]+"="+strconv.FormatFloat(*p, 'g', 4, 64))
	}
	return strings.Join(s, ",")
}

func (c costFlag) Set(v string) error {
	for _, kv := range strings.Split(v, ",") {
		k, val, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return fmt.Errorf("%q is not key=value", kv)
		}
		x, err := strconv.ParseFloat(val, 64)
		if err != nil {
			return fmt.Errorf("%s: %w", k, err)
		}
		found := false
		for i, name := range costKeys {
			if name == k {
				*c.fields()[i] = x
				found = true
			}
		}
		if !found {
			return fmt.Errorf("unknown cost key %q (want %s)", k, strings.Join(costKeys, ", "))
		}
	}
	return nil
}

var errUsage = errors.New("usage")

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := defaultOptions()
	fs := flag.NewFlagSet("fleetreplay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	seed := fs.Uint64("seed", o.seed, "workload seed (arrivals, prompts, suffixes)")
	algo := fs.String("algo", string(hashing.SHA256), "engines' and router's --prefix-caching-hash-algo")
	hseed := fs.String("hash-seed", "", "engines' PYTHONHASHSEED (default vLLM's \"vllm-none-hash\")")
	fs.IntVar(&o.hashing.BlockSize, "block-size", hashing.DefaultBlockSize, "tokens per KV block")
	fs.StringVar(&o.transport, "transport", o.transport, "pull transport: p2p (vLLM's P2P protocol over ZMQ on loopback, in-process data plane) or fake (transfer/fake, in memory)")
	fs.IntVar(&o.minDelta, "min-cached-token-delta", o.minDelta, "picker threshold: smallest pull worth it, in tokens")
	fs.IntVar(&o.blockBytes, "block-bytes", o.blockBytes, "bytes of stand-in content per block that pulls move and verify")
	fs.BoolVar(&o.hashCheck, "hash-check", o.hashCheck, "subscriber rehashes events that start at block 0 and checks agreement")
	scen := fs.String("scenarios", strings.Join(o.scenarios, ","), "scenarios to run: "+strings.Join(scenarioNames(), ", "))

	fs.IntVar(&o.forkBranches, "fork-branches", o.forkBranches, "fork burst: subagents")
	fs.IntVar(&o.forkPrefix, "fork-prefix", o.forkPrefix, "fork burst: shared prefix tokens")
	fs.IntVar(&o.forkSuffixMin, "fork-suffix-min", o.forkSuffixMin, "fork burst: shortest subagent task prompt, tokens")
	fs.IntVar(&o.forkSuffixMax, "fork-suffix-max", o.forkSuffixMax, "fork burst: longest subagent task prompt, tokens")
	fs.Float64Var(&o.forkGap, "fork-gap", o.forkGap, "fork burst: mean seconds between subagent arrivals (each gap uniform in 0.5-1.5 times it)")
	fs.IntVar(&o.forkPrefill, "fork-prefill", o.forkPrefill, "fork burst: prefill pods")
	fs.IntVar(&o.forkDecode, "fork-decode", o.forkDecode, "fork burst: decode pods")
	fs.IntVar(&o.forkSpillAt, "fork-spill-at", o.forkSpillAt, "fork burst: requests in flight on the prefix holder before the router spills")
	fs.IntVar(&o.forkGPU, "fork-gpu-blocks", o.forkGPU, "fork burst: GPU cache per pod, blocks")
	fs.IntVar(&o.forkCPU, "fork-cpu-blocks", o.forkCPU, "fork burst: CPU offload tier per pod, blocks")
	fs.Var(costFlag{&o.forkCost}, "fork-cost", "fork burst cost model, seconds: "+strings.Join(costKeys, "=,")+"=")

	fs.IntVar(&o.pods, "pods", o.pods, "load spill and control: aggregated pods")
	fs.Var((*floats)(&o.rates), "rates", "load spill: offered rates, req/s")
	fs.Float64Var(&o.duration, "duration", o.duration, "load spill and control: seconds of arrivals")
	fs.IntVar(&o.prefixes, "prefixes", o.prefixes, "load spill and control: shared prefixes")
	fs.IntVar(&o.prefixTokens, "prefix-tokens", o.prefixTokens, "load spill and control: tokens per shared prefix")
	fs.IntVar(&o.suffixMin, "suffix-min", o.suffixMin, "load spill and control: shortest request suffix, tokens")
	fs.IntVar(&o.suffixMax, "suffix-max", o.suffixMax, "load spill and control: longest request suffix, tokens")
	fs.IntVar(&o.gpuBlocks, "gpu-blocks", o.gpuBlocks, "load spill and control: GPU cache per pod, blocks")
	fs.IntVar(&o.cpuBlocks, "cpu-blocks", o.cpuBlocks, "load spill and control: CPU offload tier per pod, blocks")
	fs.Var(costFlag{&o.spillCost}, "spill-cost", "load spill and control cost model, seconds: "+strings.Join(costKeys, "=,")+"=")
	fs.Float64Var(&o.controlRate, "control-rate", o.controlRate, "negative control: offered req/s")
	o.pf.register(fs)
	o.sb.register(fs)
	o.hints.register(fs)

	fs.IntVar(&o.studyScale, "study-scale", o.studyScale, "pd-session, restart-storm, doc-qa, hot-skew, scale-out, router-restart, cpu-restore: divide prompts and caches by this, the cost models scaled to charge the same seconds (1: published sizes)")
	fs.IntVar(&o.pdConversations, "pd-conversations", o.pdConversations, "pd-session and cpu-restore: conversations")
	fs.IntVar(&o.pdTurnsMax, "pd-turns-max", o.pdTurnsMax, "pd-session, restart-storm, cpu-restore: most turns per conversation (at least 4)")
	fs.IntVar(&o.stormConversations, "storm-conversations", o.stormConversations, "restart-storm: conversations")
	fs.Float64Var(&o.stormAt, "storm-at", o.stormAt, "restart-storm: seconds until the prefill pods restart")
	fs.IntVar(&o.docs, "docs", o.docs, "doc-qa: documents (one six-turn conversation each)")
	fs.IntVar(&o.docActive, "doc-active", o.docActive, "doc-qa: conversations at once")
	fs.IntVar(&o.docPods, "doc-pods", o.docPods, "doc-qa: aggregated pods")
	fs.Float64Var(&o.skewS, "skew-s", o.skewS, "hot-skew: Zipf exponent of the prefix popularity")
	fs.Float64Var(&o.skewRate, "skew-rate", o.skewRate, "hot-skew: offered req/s")
	fs.Float64Var(&o.scaleJoin, "scale-join", o.scaleJoin, "scale-out: seconds until the cold pod joins")
	fs.Float64Var(&o.routerAt, "router-at", o.routerAt, "router-restart: seconds until the router restarts")
	fs.BoolVar(&o.samePods, "same-pods", false, "place each request of the P2P arm on the pod the baseline arm's router chose (default: both arms run the placement policy live)")
	fs.StringVar(&o.outDir, "out", o.outDir, "directory for the plots")
	fs.StringVar(&o.jsonPath, "json", "", "also write every table as JSON to this file")
	fs.StringVar(&o.tracePath, "trace", "", "also write every request's route and TTFT as CSV to this file")
	fs.BoolVar(&o.plots, "plot", o.plots, "draw the per-request TTFT plots")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the replay to this file")
	verbose := fs.Bool("v", false, "log the SDK's warnings (subscriber, index) to stderr")
	prog := fs.String("progress", "auto", "progress bar on stderr: auto (on a terminal), always, never")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, flag.ErrHelp
		}
		return nil, errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "fleetreplay: unexpected argument %q\n", fs.Arg(0))
		return nil, errUsage
	}
	o.seed = *seed
	if *verbose {
		o.logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	o.hashing.Algo = hashing.Algo(*algo)
	o.hashing.Seed = *hseed
	o.scenarios = strings.Split(*scen, ",")
	switch *prog {
	case "auto":
		o.showProgress = isTerminal(os.Stderr)
	case "always":
		o.showProgress = true
	case "never":
		o.showProgress = false
	default:
		return nil, fmt.Errorf("--progress: want auto, always or never, not %q", *prog)
	}
	if err := o.validate(); err != nil {
		return nil, err
	}
	return &o, nil
}

func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		if !errors.Is(err, errUsage) {
			fmt.Fprintf(stderr, "fleetreplay: %v\n", err)
		}
		return 2
	}
	start := time.Now()
	if o.cpuProfile != "" {
		pf, err := os.Create(o.cpuProfile)
		if err != nil {
			fmt.Fprintf(stderr, "fleetreplay: %v\n", err)
			return 1
		}
		defer pf.Close()
		if err := pprof.StartCPUProfile(pf); err != nil {
			fmt.Fprintf(stderr, "fleetreplay: %v\n", err)
			return 1
		}
		defer pprof.StopCPUProfile()
	}
	res, err := replay(ctx, o, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "fleetreplay: %v\n", err)
		return 1
	}
	if o.plots {
		if err := os.MkdirAll(o.outDir, 0o755); err != nil {
			fmt.Fprintf(stderr, "fleetreplay: %v\n", err)
			return 1
		}
		for _, s := range res {
			if err := plotScenario(o.outDir, s); err != nil {
				fmt.Fprintf(stderr, "fleetreplay: %v\n", err)
				return 1
			}
		}
	}
	for _, s := range res {
		writeTable(stdout, s)
	}
	if o.tracePath != "" {
		if err := writeTrace(o.tracePath, res); err != nil {
			fmt.Fprintf(stderr, "fleetreplay: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "\nper-request trace: %s\n", o.tracePath)
	}
	if o.jsonPath != "" {
		if err := writeJSON(o.jsonPath, res); err != nil {
			fmt.Fprintf(stderr, "fleetreplay: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "\ntables as JSON: %s\n", o.jsonPath)
	}
	fmt.Fprintf(stdout, "\nreplayed in %.1f s (virtual time; decisions through events over ZMQ, index, picker, transfer)\n", time.Since(start).Seconds())
	return 0
}

// plotScenario draws one plot per rate of a scenario.
func plotScenario(dir string, s *scenarioResult) error {
	if s.plot != nil {
		paths, err := s.plot(dir, s)
		s.Plots = append(s.Plots, paths...)
		return err
	}
	for i := 0; i+1 < len(s.Arms); i += 2 {
		arms := s.Arms[i : i+2]
		base, title := s.Name, s.Title
		if v := arms[0].Variant; v != "" {
			base = s.Name + "-" + strings.ReplaceAll(v, " ", "-")
			title = fmt.Sprintf("%s, %s", strings.SplitN(s.Title, ":", 2)[0], v)
		} else if arms[0].Rate > 0 {
			base = fmt.Sprintf("%s-%grps", s.Name, arms[0].Rate)
			title = fmt.Sprintf("%s, %g req/s", title, arms[0].Rate)
		}
		paths, err := plotArms(dir, base, title, arms)
		if err != nil {
			return err
		}
		s.Plots = append(s.Plots, paths...)
	}
	return nil
}
