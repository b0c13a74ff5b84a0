package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/picker"
)

// options are everything the flags set.
type options struct {
	seed      uint64
	hashing   hashing.Config
	transport string
	minDelta  int

	// Fork burst.
	forkBranches  int
	forkPrefix    int
	forkSuffixMin int
	forkSuffixMax int
	forkGap       float64
	forkPrefill   int
	forkDecode    int
	forkSpillAt   int
	forkGPU       int
	forkCPU       int
	forkCost      CostModel

	// Load spill and the negative control.
	pods         int
	rates        []float64
	duration     float64
	prefixes     int
	prefixTokens int
	suffixMin    int
	suffixMax    int
	gpuBlocks    int
	cpuBlocks    int
	spillCost    CostModel
	controlRate  float64

	// The study's further scenarios (study.go).
	studyScale         int
	pdConversations    int
	pdTurnsMax         int
	stormConversations int
	stormAt            float64
	stormWindow        float64
	docs               int
	docActive          int
	docPods            int
	docSpillAt         int
	skewS              float64
	skewRate           float64
	skewDuration       float64
	skewSpillAt        int
	scalePrefixes      int
	scaleRate          float64
	scaleDuration      float64
	scaleJoin          float64
	routerRate         float64
	routerDuration     float64
	routerAt           float64
	routerSnapshotAge  float64
	routerReplaySteps  int
	pf                 prefetchOptions
	sb                 specBurstOptions
	hints              hintsOptions
	blockBytes         int
	hashCheck          bool
	scenarios          []string
	outDir             string
	jsonPath           string
	tracePath          string
	samePods           bool
	cpuProfile         string
	logger             *slog.Logger
	// audit, when set, sees every pick decision with the pods' true state
	// (tests).
	audit        func(r *request, dest *pod, d *picker.Decision)
	plots        bool
	showProgress bool
}

func defaultOptions() options {
	return options{
		seed:      1,
		transport: "p2p",
		minDelta:  256,

		forkBranches:  43,
		forkPrefix:    40960,
		forkSuffixMin: 256,
		forkSuffixMax: 1024,
		forkGap:       0.1,
		forkPrefill:   2,
		forkDecode:    2,
		forkSpillAt:   2,
		forkGPU:       12000,
		forkCPU:       12000,
		forkCost:      glm753B,

		pods:         4,
		rates:        []float64{4, 8, 12, 16},
		duration:     30,
		prefixes:     64,
		prefixTokens: 16384,
		suffixMin:    1024,
		suffixMax:    3072,
		gpuBlocks:    12000,
		cpuBlocks:    44000,
		spillCost:    llama8B,
		controlRate:  8,
		pf:           defaultPrefetchOptions(),
		sb:           defaultSpecBurstOptions(),
		hints:        defaultHintsOptions(),

		studyScale:         8,
		pdConversations:    24,
		pdTurnsMax:         40,
		stormConversations: 24,
		stormAt:            60,
		stormWindow:        30,
		docs:               192,
		docActive:          128,
		docPods:            16,
		docSpillAt:         2,
		skewS:              1.2,
		skewRate:           16,
		skewDuration:       30,
		skewSpillAt:        2,
		scalePrefixes:      32,
		scaleRate:          10,
		scaleDuration:      60,
		scaleJoin:          20,
		routerRate:         8,
		routerDuration:     30,
		routerAt:           15,
		routerSnapshotAge:  0.5,
		routerReplaySteps:  16,

		blockBytes: 512,
		hashCheck:  true,
		scenarios:  scenarioNames(),
		outDir:     "out",
		plots:      true,
	}
}

// scenario is one experiment: how to build each arm's spec.
type scenario struct {
	name, title, setup string
	points             []point // one arm pair (without, with P2P) per point
	spec               func(pt point, p2p bool) *runSpec
	// published are the study's figures, printed as published; ours
	// computes the replay's figures to set beside them.
	published []string
	ours      func(s *scenarioResult) []string
	// versus names what the second arm of each pair adds, in the
	// comparison line ("" : P2P).
	versus string
	// table, when set, prints the scenario's table instead of the
	// standard one.
	table func(w io.Writer, s *scenarioResult)
	// run, when set, replaces the fleet replay (a scenario without a
	// router, such as pricing).
	run func(ctx context.Context, o *options) (*scenarioResult, error)
}

// point is one condition of a scenario: an offered rate (0 for a burst or a
// closed loop of sessions), or a named variant.
type point struct {
	rate    float64
	variant string
}

// rates makes one point per offered rate.
func rates(rs ...float64) []point {
	out := make([]point, len(rs))
	for i, r := range rs {
		out[i] = point{rate: r}
	}
	return out
}

// registry is every scenario, by its --scenarios name, in the order the
// default run plays them. A new scenario is one entry here.
var registry = []struct {
	name  string
	build func(o *options) *scenario
}{
	{"pricing", (*options).pricingScenario},
	{"fork", (*options).forkScenario},
	{"spill", (*options).spillScenario},
	{"control", (*options).controlScenario},
	{"pd-session", (*options).pdSessionScenario},
	{"restart-storm", (*options).restartStormScenario},
	{"doc-qa", (*options).docQAScenario},
	{"hot-skew", (*options).hotSkewScenario},
	{"scale-out", (*options).scaleOutScenario},
	{"router-restart", (*options).routerRestartScenario},
	{"cpu-restore", (*options).cpuRestoreScenario},
	{"prefetch", (*options).prefetchScenario},
	{"spec-burst", (*options).specBurstScenario},
	{"kv-hints", (*options).kvHintsScenario},
}

func scenarioNames() []string {
	var out []string
	for _, e := range registry {
		out = append(out, e.name)
	}
	return out
}

func (o *options) scenarioList() ([]*scenario, error) {
	var out []*scenario
	for _, name := range o.scenarios {
		name = strings.TrimSpace(name)
		i := slices.IndexFunc(registry, func(e struct {
			name  string
			build func(o *options) *scenario
		}) bool {
			return e.name == name
		})
		if i < 0 {
			return nil, fmt.Errorf("unknown scenario %q (want %s)", name, strings.Join(scenarioNames(), ", "))
		}
		out = append(out, registry[i].build(o))
	}
	return out, nil
}

func (o *options) forkScenario() *scenario {
	prompts, reqs := forkBurst(o.seed, o.forkBranches, o.forkPrefix, o.forkSuffixMin, o.forkSuffixMax, o.forkGap)
	session := prompts[0]
	return &scenario{
		name:  "fork-burst",
		title: fmt.Sprintf("Fork burst: %d subagents fork over a shared %d-token prefix", o.forkBranches, o.forkPrefix),
		setup: fmt.Sprintf("%d prefill + %d decode pods, %s placement (spill at %d in flight), cost model: %d-token prefill %.1f s alone, pull %.1f s; TTFT = branch start",
			o.forkPrefill, o.forkDecode, placeSpill, o.forkSpillAt, o.forkPrefix, o.forkCost.Prefill(0, o.forkPrefix), o.forkCost.Pull(o.forkPrefix)),
		points:    rates(0),
		published: []string{"fork burst p90 branch-start TTFT 11.2 s -> 1.6 s; median about 1.2 s in both"},
		ours: func(s *scenarioResult) []string {
			off, on := s.Arms[0], s.Arms[1]
			return []string{fmt.Sprintf("fork burst p90 %.1f s -> %.1f s; median %.1f s / %.1f s", off.P90, on.P90, off.P50, on.P50)}
		},
		spec: func(_ point, p2p bool) *runSpec {
			return &runSpec{
				scenario: "fork-burst", p2p: p2p, place: placeSpill, spillAt: o.forkSpillAt,
				prefill: o.forkPrefill, decode: o.forkDecode,
				gpuBlocks: o.forkGPU, cpuBlocks: o.forkCPU, cost: o.forkCost, hashing: o.hashing, minDelta: o.minDelta,
				reqs: cloneRequests(reqs),
				// The parent session ran on the first prefill pod and
				// the first decode pod: both hold its context.
				warm: func(f *fleet) error {
					var ps []*pod
					if len(f.pods) > 0 {
						ps = append(ps, f.pods[0])
					}
					if o.forkDecode > 0 {
						ps = append(ps, f.pods[o.forkPrefill])
					}
					return f.warmPrompt(session, ps...)
				},
			}
		},
	}
}

func (o *options) loadSpec(name string, prefixes []*prompt, rate float64, p2p bool, place placement) *runSpec {
	return &runSpec{
		scenario: name, rate: rate, p2p: p2p, place: place, aggregated: o.pods,
		gpuBlocks: o.gpuBlocks, cpuBlocks: o.cpuBlocks, cost: o.spillCost, hashing: o.hashing, minDelta: o.minDelta,
		reqs: poissonLoad(o.seed, prefixes, rate, o.duration, o.suffixMin, o.suffixMax),
		// Earlier traffic left prefix i on pod i mod pods.
		warm: func(f *fleet) error {
			for i, pr := range prefixes {
				if err := f.warmPrompt(pr, f.pods[i%len(f.pods)]); err != nil {
					return err
				}
			}
			return nil
		},
	}
}

func (o *options) spillScenario() *scenario {
	prefixes := sharedPrefixes(o.seed, o.prefixes, o.prefixTokens)
	return &scenario{
		name:  "load-spill",
		title: fmt.Sprintf("Load spill: %d shared %d-token prefixes, %d aggregated pods, %s placement", o.prefixes, o.prefixTokens, o.pods, placeLoad),
		setup: fmt.Sprintf("Poisson arrivals for %g s, %d-%d-token suffixes; cache per pod %d GPU + %d CPU blocks; cost model: %d-token prefill %.2f s alone, pull %.2f s",
			o.duration, o.suffixMin, o.suffixMax, o.gpuBlocks, o.cpuBlocks, o.prefixTokens, o.spillCost.Prefill(0, o.prefixTokens), o.spillCost.Pull(o.prefixTokens)),
		points:    rates(o.rates...),
		published: []string{"8B load spill: p50 -43% at 8 req/s; +22% achieved throughput at 16 req/s"},
		ours: func(s *scenarioResult) []string {
			var out []string
			for i := 0; i+1 < len(s.Arms); i += 2 {
				off, on := s.Arms[i], s.Arms[i+1]
				out = append(out, fmt.Sprintf("at %g req/s: p50 %+.0f%%, achieved throughput %+.0f%%", off.Rate, 100*(on.P50/off.P50-1), 100*(on.Throughput/off.Throughput-1)))
			}
			return out
		},
		spec: func(pt point, p2p bool) *runSpec {
			return o.loadSpec("load-spill", prefixes, pt.rate, p2p, placeLoad)
		},
	}
}

func (o *options) controlScenario() *scenario {
	prefixes := sharedPrefixes(o.seed, o.prefixes, o.prefixTokens)
	return &scenario{
		name:      "negative-control",
		title:     fmt.Sprintf("Negative control: the load-spill workload under %s placement", placeAffinity),
		setup:     "every request goes to the pod holding its prefix: local hits, so the picker must pull nothing",
		points:    rates(o.controlRate),
		published: []string{"local hit under prefix affinity: no pulls"},
		ours: func(s *scenarioResult) []string {
			on := s.Arms[1]
			return []string{fmt.Sprintf("%d pull decisions, %d pulls, %s moved", on.PullDecisions, on.PullsIssued, humanBytes(on.BytesMoved))}
		},
		spec: func(pt point, p2p bool) *runSpec {
			return o.loadSpec("negative-control", prefixes, pt.rate, p2p, placeAffinity)
		},
	}
}

func (o *options) validate() error {
	if o.hashing.BlockSize < 1 {
		return fmt.Errorf("--block-size must be at least 1")
	}
	for _, c := range []struct {
		name string
		m    CostModel
	}{{"--fork-cost", o.forkCost}, {"--spill-cost", o.spillCost}} {
		if err := c.m.validate(); err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
	}
	checks := []struct {
		ok  bool
		msg string
	}{
		{o.forkBranches > 0, "--fork-branches must be positive"},
		{o.forkPrefix > 0 && o.prefixTokens > 0, "prefix lengths must be positive"},
		{o.forkSuffixMin > 0 && o.forkSuffixMax >= o.forkSuffixMin, "--fork-suffix-min must be positive and at most --fork-suffix-max"},
		{o.suffixMin > 0 && o.suffixMax >= o.suffixMin, "--suffix-min must be positive and at most --suffix-max"},
		{o.forkGap > 0 && o.duration > 0 && o.controlRate > 0, "--fork-gap, --duration and --control-rate must be positive"},
		{o.forkPrefill > 0 && o.forkDecode >= 0, "the fork burst needs a prefill pod"},
		{o.forkSpillAt > 0, "--fork-spill-at must be positive"},
		{o.pods > 0 && o.prefixes > 0, "--pods and --prefixes must be positive"},
		{o.blockBytes >= 8, "--block-bytes must be at least 8"},
		{len(o.rates) > 0, "--rates needs a rate"},
		{o.studyScale >= 1, "--study-scale must be at least 1"},
		{o.pdConversations > 0 && o.stormConversations > 0 && o.pdTurnsMax >= 4, "conversations must be positive and --pd-turns-max at least 4"},
		{o.docs > 0 && o.docActive > 0 && o.docPods > 0, "--docs, --doc-active and --doc-pods must be positive"},
		{o.skewS > 0 && o.skewRate > 0, "--skew-s and --skew-rate must be positive"},
		{o.stormAt > 0 && o.scaleJoin > 0 && o.scaleJoin < o.scaleDuration && o.routerAt > o.routerSnapshotAge && o.routerAt < o.routerDuration, "restart and join times must fall inside their runs"},
	}
	for _, c := range checks {
		if !c.ok {
			return errors.New(c.msg)
		}
	}
	if err := o.pf.validate(o.hashing.BlockSize); err != nil {
		return err
	}
	if err := o.sb.validate(o.hashing.BlockSize); err != nil {
		return err
	}
	if err := o.hints.validate(); err != nil {
		return err
	}
	// A tier must hold a few whole prompts, or requests evict their own
	// blocks while they run.
	bs := o.hashing.BlockSize
	if need := 2 * (o.forkPrefix + o.forkSuffixMax) / bs; o.forkGPU < need || o.forkCPU < need {
		return fmt.Errorf("fork burst caches must hold at least %d blocks (two prompts)", need)
	}
	if need := 2 * (o.prefixTokens + o.suffixMax) / bs; o.gpuBlocks < need || o.cpuBlocks < need {
		return fmt.Errorf("--gpu-blocks and --cpu-blocks must be at least %d (two prompts)", need)
	}
	return nil
}

func cloneRequests(reqs []*request) []*request {
	out := make([]*request, len(reqs))
	at := make(map[*request]*request, len(reqs))
	for i, r := range reqs {
		out[i] = &request{
			id: r.id, name: r.name, arrival: r.arrival, prefix: r.prefix, suffix: r.suffix,
			answer: r.answer, decodeTime: r.decodeTime, gap: r.gap, chained: r.chained, turn: r.turn,
		}
		at[r] = out[i]
	}
	for i, r := range reqs {
		if r.next != nil {
			out[i].next = at[r.next]
		}
	}
	return out
}

// replay runs every scenario, both arms at each rate, under the same
// placement policy: the arm without P2P first, then the arm with P2P (with
// samePods, on the very pods the first arm's router chose).
func replay(ctx context.Context, o *options, stderr io.Writer) ([]*scenarioResult, error) {
	scs, err := o.scenarioList()
	if err != nil {
		return nil, err
	}
	type pair struct {
		sc  *scenario
		pt  point
		off *runSpec
	}
	var pairs []pair
	total := 0
	for _, sc := range scs {
		if sc.run != nil {
			pairs = append(pairs, pair{sc: sc})
			continue
		}
		for _, pt := range sc.points {
			off := sc.spec(pt, false)
			pairs = append(pairs, pair{sc, pt, off})
			total += 2 * len(off.reqs)
		}
	}
	bar := newProgress(stderr, total, o.showProgress)
	defer bar.finish()
	opt := sdkOptions{transport: o.transport, blockBytes: o.blockBytes, hashCheck: o.hashCheck, logger: o.logger}
	var out []*scenarioResult
	var cur *scenarioResult
	for _, pr := range pairs {
		if pr.sc.run != nil {
			res, err := pr.sc.run(ctx, o)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", pr.sc.name, err)
			}
			res.Name, res.Title, res.Setup, res.Published = pr.sc.name, pr.sc.title, pr.sc.setup, pr.sc.published
			out = append(out, res)
			cur = res
			continue
		}
		if cur == nil || cur.Name != pr.sc.name {
			cur = &scenarioResult{Name: pr.sc.name, Title: pr.sc.title, Setup: pr.sc.setup, Published: pr.sc.published, ours: pr.sc.ours, versus: pr.sc.versus, table: pr.sc.table}
			out = append(out, cur)
		}
		offRes, placed, err := runOne(ctx, pr.off, opt, bar, o.audit)
		if err != nil {
			return nil, err
		}
		on := pr.sc.spec(pr.pt, true)
		if o.samePods {
			on.replay = placed
		}
		onRes, _, err := runOne(ctx, on, opt, bar, o.audit)
		if err != nil {
			return nil, err
		}
		cur.Arms = append(cur.Arms, offRes, onRes)
	}
	for _, s := range out {
		if s.ours != nil {
			s.Ours = s.ours(s)
		}
	}
	return out, nil
}

func runOne(ctx context.Context, spec *runSpec, opt sdkOptions, bar *progress, audit func(*request, *pod, *picker.Decision)) (*armResult, []int, error) {
	f, err := newFleet(ctx, spec, opt)
	if err != nil {
		return nil, nil, fmt.Errorf("%s %s: %w", spec.scenario, spec.arm(), err)
	}
	f.onDone = func() { bar.add(1) }
	f.audit = audit
	res, placed, err := f.run(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("%s %s: %w", spec.scenario, spec.arm(), err)
	}
	return res, placed, nil
}
