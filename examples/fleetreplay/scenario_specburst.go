package main

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"

	"github.com/kvsource/kvsource/index"
)

// Scenario 13, a burst on a new prefix: requests sharing a prefix no pod
// holds arrive faster than one prefill of it. Until the first prefill's KV
// events arrive, seconds later, the index names no holder, so a router
// placing by prefix scores spreads the burst and every pod it reaches
// computes the prefix. With speculative indexing (index.Speculative, as
// llm-d's precise producer runs it with speculativeIndexing on) the router
// records each routed request's blocks on its destination right after the
// pick: the next request of the burst scores that pod as holding the prefix
// and follows it until the queue says spill. The control spaces the same
// requests further apart than a prefill: every request finds the engine's
// own events, beside guesses that weigh the same, so speculative indexing
// must change nothing.

// specBurstOptions configure the burst scenario.
type specBurstOptions struct {
	requests     int
	pods         int
	spillAt      int
	prefixTokens int
	suffixMin    int
	suffixMax    int
	// window is the share of the prefix's prefill time the burst arrives
	// in; gap is the control's spacing as a multiple of the longest
	// prompt's prefill time.
	window float64
	gap    float64
	// busyRate is the req/s of the busy variant's other traffic: requests
	// on prefixes of busyPrefix tokens, one held by each pod, with
	// suffixes of suffixMin-suffixMax tokens; the burst starts busyAt s in.
	busyRate   float64
	busyPrefix int
	busyAt     float64
	gpuBlocks  int
	cpuBlocks  int
	cost       CostModel
}

func defaultSpecBurstOptions() specBurstOptions {
	return specBurstOptions{
		requests: 8, pods: 4, spillAt: 4,
		prefixTokens: 32768, suffixMin: 512, suffixMax: 2048,
		window: 0.8, gap: 1.1,
		busyRate: 8, busyPrefix: 16384, busyAt: 2,
		gpuBlocks: 12000, cpuBlocks: 24000,
		cost: llama8B,
	}
}

func (so *specBurstOptions) register(fs *flag.FlagSet) {
	fs.IntVar(&so.requests, "burst-requests", so.requests, "spec-burst: requests in the burst on the new prefix")
	fs.IntVar(&so.pods, "burst-pods", so.pods, "spec-burst: aggregated pods")
	fs.IntVar(&so.spillAt, "burst-spill-at", so.spillAt, "spec-burst: requests in flight on the prefix holder before the router spills")
	fs.IntVar(&so.prefixTokens, "burst-prefix", so.prefixTokens, "spec-burst: tokens of the new shared prefix")
	fs.Float64Var(&so.busyRate, "burst-busy-rate", so.busyRate, "spec-burst: req/s of the busy variant's other traffic")
	fs.Float64Var(&so.window, "burst-window", so.window, "spec-burst: the burst arrives within this share of the prefix's prefill time (0-1]")
	fs.Var(costFlag{&so.cost}, "burst-cost", "spec-burst cost model, seconds: "+strings.Join(costKeys, "=,")+"=")
}

func (so *specBurstOptions) validate(blockSize int) error {
	checks := []struct {
		ok  bool
		msg string
	}{
		{so.requests > 1 && so.pods > 1 && so.spillAt > 0, "--burst-requests and --burst-pods must be at least 2, --burst-spill-at positive"},
		{so.prefixTokens >= blockSize, "--burst-prefix must be at least a block"},
		{so.suffixMin > 0 && so.suffixMax >= so.suffixMin, "spec-burst suffixes need positive lengths"},
		{so.window > 0 && so.window <= 1, "--burst-window must be in (0, 1]: the burst arrives within one prefill time"},
		{so.gap > 1, "the spec-burst control must space requests further apart than a prefill"},
		{so.busyRate > 0 && so.busyPrefix >= blockSize && so.busyAt >= 0, "--burst-busy-rate must be positive"},
	}
	for _, c := range checks {
		if !c.ok {
			return errors.New(c.msg)
		}
	}
	if err := so.cost.validate(); err != nil {
		return fmt.Errorf("--burst-cost: %w", err)
	}
	if need := 2 * (max(so.prefixTokens, so.busyPrefix) + so.suffixMax) / blockSize; so.gpuBlocks < need || so.cpuBlocks < need {
		return fmt.Errorf("spec-burst caches must hold at least %d blocks (two prompts)", need)
	}
	return nil
}

// burstRequests draws the requests on one new prefix, each with a suffix
// of its own, the first at 0, the others gap apart: on average when jitter
// is set (each gap uniform in 0.5-1.5 times it), exactly otherwise.
func burstRequests(seed uint64, so *specBurstOptions, name string, gap float64, jitter bool) []*request {
	rng := rand.New(rand.NewPCG(seed, 0x5bec)) //nolint:gosec // a reproducible workload
	pre := &prompt{id: 0, tokens: randomTokens(rng, so.prefixTokens)}
	reqs := make([]*request, so.requests)
	t := 0.0
	for i := range reqs {
		switch {
		case i > 0 && jitter:
			t += gap * (0.5 + rng.Float64())
		case i > 0:
			t += gap
		}
		reqs[i] = &request{
			id: i, name: fmt.Sprintf("%s-%d-%d", name, seed, i), arrival: t, prefix: pre,
			suffix: randomTokens(rng, uniformInt(rng, so.suffixMin, so.suffixMax)),
		}
	}
	return reqs
}

// busyBurst is the burst starting at so.busyAt among other traffic: Poisson
// arrivals at so.busyRate for as long as the burst lasts and as long again
// after it, each on one of prefixes (one per pod), in arrival order.
func busyBurst(seed uint64, so *specBurstOptions, burst []*request, prefixes []*prompt, longest float64) []*request {
	end := so.busyAt + 2*(burst[len(burst)-1].arrival+longest) + 1
	other := poissonLoad(seed, prefixes, so.busyRate, end, so.suffixMin, so.suffixMax)
	var out []*request
	for _, r := range burst {
		b := *r
		b.arrival += so.busyAt
		out = append(out, &b)
	}
	out = append(out, other...)
	slices.SortStableFunc(out, func(a, b *request) int { return cmp.Compare(a.arrival, b.arrival) })
	for i, r := range out {
		r.id = i
	}
	return out
}

func (o *options) specBurstScenario() *scenario {
	so := &o.sb
	prefill := so.cost.Prefill(0, so.prefixTokens)
	longest := so.cost.Prefill(0, so.prefixTokens+so.suffixMax)
	// The burst's last arrival falls within window of the prefill time:
	// n-1 gaps of at most 1.5 times the mean.
	burstGap := so.window * prefill / (1.5 * float64(so.requests-1))
	// The control's requests each arrive after the one before has its
	// first token and its events are in: with the defaults sooner than the
	// TTL, so that the engine's events, not the expiry, retire the guesses.
	spacedGap := so.gap * (longest + so.cost.FirstToken)
	burst := burstRequests(o.seed, so, "burst", burstGap, true)
	busyPrefixes := sharedPrefixes(o.seed+3, so.pods, so.busyPrefix)
	variants := map[string][]*request{
		"burst":   burst,
		"busy":    busyBurst(o.seed, so, burst, busyPrefixes, longest),
		"control": burstRequests(o.seed, so, "spaced", spacedGap, false),
	}
	return &scenario{
		name: "spec-burst",
		title: fmt.Sprintf("Burst on a new prefix: %d requests share a %d-token prefix no pod holds, within one prefill of it",
			so.requests, so.prefixTokens),
		setup: fmt.Sprintf("%d aggregated pods, %s placement (spill at %d in flight), P2P on; burst within %.2f s, prefill of the prefix %.2f s alone; "+
			"busy: the burst at %g s among %g req/s of other traffic on %d-token prefixes, one held by each pod (the p50/p90 columns are over all; burst_ and other_ figures apart); "+
			"control: the same requests %.2f s apart (longer than any of their prefills; TTL %g s); speculative indexing records each routed request's blocks on its destination right after the pick (index.Speculative, default TTL and bound)",
			so.pods, placeSpill, so.spillAt, so.window*prefill, prefill, so.busyAt, so.busyRate, so.busyPrefix, spacedGap, index.DefaultSpeculativeTTL.Seconds()),
		points:    []point{{variant: "burst"}, {variant: "busy"}, {variant: "control"}},
		versus:    "speculative",
		published: []string{"(not measured; llm-d's reason for speculativeIndexing) a burst on a new prefix spreads across pods before any KV event arrives"},
		ours: func(s *scenarioResult) []string {
			var out []string
			for i := 0; i+1 < len(s.Arms); i += 2 {
				off, on := s.Arms[i], s.Arms[i+1]
				line := fmt.Sprintf("%s: pods that computed the prefix %.0f -> %.0f, prefix tokens computed %.0f -> %.0f, compute %.2f -> %.2f s, burst TTFT p50 %.2f -> %.2f s, p90 %.2f -> %.2f s",
					off.Variant, off.Figures["prefix_pods"], on.Figures["prefix_pods"], off.Figures["prefix_tokens_computed"], on.Figures["prefix_tokens_computed"],
					off.Figures["compute_s"], on.Figures["compute_s"], off.Figures["burst_p50_s"], on.Figures["burst_p50_s"], off.Figures["burst_p90_s"], on.Figures["burst_p90_s"])
				if _, ok := off.Figures["other_p50_s"]; ok {
					line += fmt.Sprintf("; other traffic p50 %.2f -> %.2f s, p90 %.2f -> %.2f s",
						off.Figures["other_p50_s"], on.Figures["other_p50_s"], off.Figures["other_p90_s"], on.Figures["other_p90_s"])
				}
				out = append(out, line)
			}
			return out
		},
		spec: func(pt point, speculative bool) *runSpec {
			sp := &runSpec{
				scenario: "spec-burst", variant: pt.variant, p2p: true, speculative: speculative,
				armName: "without speculative", place: placeSpill, spillAt: so.spillAt, aggregated: so.pods,
				gpuBlocks: so.gpuBlocks, cpuBlocks: so.cpuBlocks, cost: so.cost, hashing: o.hashing, minDelta: o.minDelta,
				reqs: cloneRequests(variants[pt.variant]),
			}
			if pt.variant == "busy" {
				sp.warm = func(f *fleet) error {
					for i, pr := range busyPrefixes {
						if err := f.warmPrompt(pr, f.pods[i]); err != nil {
							return err
						}
					}
					return nil
				}
			}
			if speculative {
				sp.armName = "with speculative"
			}
			// The control draws its own prompt of the same tokens.
			pre := burst[0].prefix
			if pt.variant == "control" {
				pre = variants["control"][0].prefix
			}
			sp.figures = func(f *fleet, a *armResult) { specBurstFigures(f, a, pre) }
			return sp
		},
	}
}

// specBurstFigures counts the pods that computed any block of the burst's
// prefix pre (a burst request whose prompt was not cached, pulled or landed
// on its pod up to the prefix's end), the prefix tokens computed, the pods'
// busy compute seconds (what the fleet had left for other traffic is the
// rest), the burst's and the other traffic's TTFT, and the speculative
// entries' fate.
func specBurstFigures(f *fleet, a *armResult, pre *prompt) {
	prefixBlocks := len(pre.tokens) / f.blockSize
	pods := map[string]bool{}
	computed := 0
	var burst, other []float64
	for _, r := range f.spec.reqs {
		if r.prefix != pre {
			other = append(other, r.ttft)
			continue
		}
		burst = append(burst, r.ttft)
		if l := r.localBlocks + r.pulledBlocks; l < prefixBlocks {
			pods[r.destName] = true
			computed += prefixBlocks - l
		}
	}
	busy := 0.0
	for _, p := range f.pods {
		busy += p.compute.busy
	}
	// The last prefills' events may still be on their way: the counters
	// are read once the index has applied them all.
	if err := f.sdk.sync(f.ctx); err != nil {
		f.fail(err)
		return
	}
	st := f.sdk.ev.speculativeStats()
	a.Figures = map[string]float64{
		"compute_s":              busy,
		"prefix_pods":            float64(len(pods)),
		"prefix_tokens_computed": float64(computed * f.blockSize),
		"speculative_recorded":   float64(st.Recorded),
		"speculative_replaced":   float64(st.Replaced),
	}
	for _, g := range []struct {
		name string
		xs   []float64
	}{{"burst_", burst}, {"other_", other}} {
		if len(g.xs) == 0 {
			continue
		}
		slices.Sort(g.xs)
		a.Figures[g.name+"p50_s"] = quantile(g.xs, 0.5)
		a.Figures[g.name+"p90_s"] = quantile(g.xs, 0.9)
	}
}
