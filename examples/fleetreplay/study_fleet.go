package main

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
)

// docQA70B is a dense-70B-like aggregated deployment for the document
// Q&A comparison: a 48K-token prefill takes about 12 s alone, a turn of
// 1,000 new tokens over a 48K context about 0.4 s, and pulling 48K tokens
// about 0.5 s.
var docQA70B = CostModel{
	Linear:       6.0 / 48000,
	Quadratic:    6.0 / (48000.0 * 48000.0),
	PullFloor:    0.1,
	PullPerToken: 0.4 / 48000,
	CPULoad:      0.1 / 48000,
	FirstToken:   0.1,
}

// clientTimeout is the client timeout the document Q&A counts requests
// against.
const clientTimeout = 60.0

func (o *options) docQAScenario() *scenario {
	k := o.studyScale
	shape := sessionShape{
		conversations: o.docs, sysMin: 48000, sysMax: 48000, turnsMin: 6, turnsMax: 6,
		inMin: 500, inMax: 1500, outMin: 100, outMax: 300, gapMin: 0.5, gapMax: 3,
		decodePerToken: 0.01, active: o.docActive, start: 5, scale: k,
	}
	reqs := sessions(o.seed+3, "docqa", shape)
	var docs []*prompt
	for _, r := range reqs {
		if r.turn == 0 {
			docs = append(docs, r.prefix)
		}
	}
	const delta = 2048
	return &scenario{
		name:  "doc-qa",
		title: fmt.Sprintf("Document Q&A: %d pods, %d distinct 48K-token documents, six turns each, %d conversations at once", o.docPods, o.docs, o.docActive),
		setup: fmt.Sprintf("aggregated pods; earlier traffic left each document on one pod (drawn at random); precise prefix affinity versus load-aware placement (affinity until the holder has %d in flight, then the least-loaded pod), each without and with P2P at min delta %d; dense-70B-like cost (48K prefill %.0f s alone, pull %.2f s); client timeout %.0f s; tokens / %d",
			o.docSpillAt, delta, docQA70B.Prefill(0, 48000), docQA70B.Pull(48000), clientTimeout, k),
		points: []point{{variant: "prefix-affinity"}, {variant: "load-aware"}},
		published: []string{
			"affinity median 0.3 s, p99 25.2 s; load+P2P median 0.6 s, p99 16.6 s, +35% throughput",
			"freshly rolled fleet with empty tiers: load+P2P completed every request, affinity hit 48 client timeouts",
		},
		ours: func(s *scenarioResult) []string {
			aff, lp := s.Arms[0], s.Arms[3]
			return []string{fmt.Sprintf("affinity median %.2f s, p99 %.1f s; load+P2P median %.2f s, p99 %.1f s, %+.0f%% throughput; over %.0f s: %.0f (affinity) / %.0f (load+P2P)",
				aff.P50, aff.P99, lp.P50, lp.P99, 100*(lp.Throughput/aff.Throughput-1), clientTimeout, aff.Figures["over_timeout"], lp.Figures["over_timeout"])}
		},
		spec: func(pt point, p2p bool) *runSpec {
			place := placeAffinity
			if pt.variant == "load-aware" {
				place = placeSpill
			}
			rng := newRand(o.seed, 0xd0c)
			home := make([]int, len(docs))
			for i := range home {
				home[i] = rng.IntN(o.docPods)
			}
			return &runSpec{
				scenario: "doc-qa", variant: pt.variant, p2p: p2p, place: place, spillAt: o.docSpillAt, aggregated: o.docPods,
				gpuBlocks: 12000 / k, cpuBlocks: 240000 / k, cost: docQA70B.scaled(k), hashing: o.hashing, minDelta: delta,
				reqs: cloneRequests(reqs),
				warm: func(f *fleet) error {
					for i, d := range docs {
						if err := f.warmPrompt(d, f.pods[home[i]]); err != nil {
							return err
						}
					}
					return nil
				},
				figures: func(f *fleet, a *armResult) {
					n := 0
					for _, r := range f.spec.reqs {
						if r.ttft > clientTimeout {
							n++
						}
					}
					a.Figures = map[string]float64{"over_timeout": float64(n)}
				},
			}
		},
	}
}

// zipfLoad draws requests at rate per second for duration seconds, the
// prefix of each drawn with probability proportional to 1/(rank+1)^s.
func zipfLoad(seed uint64, prefixes []*prompt, s, rate, duration float64, suffixMin, suffixMax int) []*request {
	rng := newRand(seed, 0x21bf)
	w := make([]float64, len(prefixes))
	total := 0.0
	for i := range w {
		w[i] = 1 / math.Pow(float64(i+1), s)
		total += w[i]
	}
	var reqs []*request
	for t := rng.ExpFloat64() / rate; t < duration; t += rng.ExpFloat64() / rate {
		x, j := rng.Float64()*total, 0
		for ; j < len(w)-1 && x >= w[j]; j++ {
			x -= w[j]
		}
		i := len(reqs)
		reqs = append(reqs, &request{
			id: i, name: fmt.Sprintf("zipf-%d-%d", seed, i), arrival: t, prefix: prefixes[j],
			suffix: randomTokens(rng, suffixMin+rng.IntN(suffixMax-suffixMin+1)),
		})
	}
	return reqs
}

func (o *options) hotSkewScenario() *scenario {
	k := o.studyScale
	prefixes := sharedPrefixes(o.seed+4, o.prefixes, o.prefixTokens/k)
	reqs := zipfLoad(o.seed, prefixes, o.skewS, o.skewRate, o.skewDuration, o.suffixMin/k, o.suffixMax/k)
	return &scenario{
		name:  "hot-skew",
		title: fmt.Sprintf("Hot skew: Zipf(%.1f) over %d shared %d-token prefixes concentrates work on their owners", o.skewS, o.prefixes, o.prefixTokens),
		setup: fmt.Sprintf("%d aggregated pods, %s placement (spill at %d in flight), Poisson %g req/s for %g s, the load spill's 8B cost model; prefill balance = busiest pod's compute time over the mean; tokens / %d",
			o.pods, placeSpill, o.skewSpillAt, o.skewRate, o.skewDuration, k),
		points:    rates(o.skewRate),
		published: []string{"(listed as next in the study, not measured) per-pod prefill balance and p99 TTFT under a skewed prefix distribution"},
		ours: func(s *scenarioResult) []string {
			off, on := s.Arms[0], s.Arms[1]
			return []string{fmt.Sprintf("p99 TTFT %.2f -> %.2f s; prefill balance (busiest / mean) %.2f -> %.2f, busiest pod %.0f%% -> %.0f%% of a total prefill time of %.0f -> %.0f s (spills pull instead of recomputing on the cold pods)",
				off.P99, on.P99, off.Figures["prefill_balance"], on.Figures["prefill_balance"], 100*off.Figures["busiest_share"], 100*on.Figures["busiest_share"], off.Figures["prefill_s"], on.Figures["prefill_s"])}
		},
		spec: func(pt point, p2p bool) *runSpec {
			return &runSpec{
				scenario: "hot-skew", rate: pt.rate, p2p: p2p, place: placeSpill, spillAt: o.skewSpillAt, aggregated: o.pods,
				gpuBlocks: o.gpuBlocks / k, cpuBlocks: o.cpuBlocks / k, cost: o.spillCost.scaled(k), hashing: o.hashing, minDelta: o.minDelta,
				reqs: cloneRequests(reqs),
				warm: func(f *fleet) error {
					for i, pr := range prefixes {
						if err := f.warmPrompt(pr, f.pods[i%len(f.pods)]); err != nil {
							return err
						}
					}
					return nil
				},
				figures: func(f *fleet, a *armResult) {
					var busy []float64
					sum := 0.0
					for _, p := range f.computePods() {
						busy = append(busy, p.compute.busy)
						sum += p.compute.busy
					}
					mx := slices.Max(busy)
					a.Figures = map[string]float64{
						"prefill_balance": mx / (sum / float64(len(busy))),
						"busiest_share":   mx / sum,
						"prefill_s":       sum,
					}
				},
			}
		},
	}
}

func (o *options) scaleOutScenario() *scenario {
	k := o.studyScale
	prefixes := sharedPrefixes(o.seed+5, o.scalePrefixes, o.prefixTokens/k)
	reqs := poissonLoad(o.seed+5, prefixes, o.scaleRate, o.scaleDuration, o.suffixMin/k, o.suffixMax/k)
	join := o.scaleJoin
	return &scenario{
		name:  "scale-out",
		title: fmt.Sprintf("Scale-out: a cold pod joins %d warm ones at %g s under steady shared-prefix traffic", o.pods-1, join),
		setup: fmt.Sprintf("%d shared %d-token prefixes on every warm pod, %s placement, Poisson %g req/s for %g s, the load spill's 8B cost model; useful = the new pod's TTFT over its next %d requests at most %.0fx the warm fleet's median before it joined; tokens / %d",
			o.scalePrefixes, o.prefixTokens, placeLoad, o.scaleRate, o.scaleDuration, usefulWindow, usefulFactor, k),
		points:    rates(o.scaleRate),
		published: []string{"(listed as next in the study, not measured) time until a cold pod reaches useful TTFT and hit rate, with and without pulls"},
		ours: func(s *scenarioResult) []string {
			off, on := s.Arms[0].Figures, s.Arms[1].Figures
			return []string{fmt.Sprintf("time to useful %.1f -> %.1f s (ratio %.2f); the new pod's first 10 s: median TTFT %.2f -> %.2f s, prefix blocks local or pulled %.0f%% -> %.0f%%",
				off["time_to_useful_s"], on["time_to_useful_s"], on["time_to_useful_s"]/off["time_to_useful_s"],
				off["new_pod_first10s_p50_s"], on["new_pod_first10s_p50_s"], 100*off["new_pod_first10s_reuse"], 100*on["new_pod_first10s_reuse"])}
		},
		spec: func(pt point, p2p bool) *runSpec {
			last := o.pods - 1
			return &runSpec{
				scenario: "scale-out", rate: pt.rate, p2p: p2p, place: placeLoad, aggregated: o.pods,
				gpuBlocks: o.gpuBlocks / k, cpuBlocks: o.cpuBlocks / k, cost: o.spillCost.scaled(k), hashing: o.hashing, minDelta: o.minDelta,
				reqs: cloneRequests(reqs),
				down: []int{last},
				actions: []action{{at: join, do: func(f *fleet) error {
					f.pods[last].down = false
					return nil
				}}},
				warm: func(f *fleet) error {
					for _, pr := range prefixes {
						if err := f.warmPrompt(pr, f.pods[:last]...); err != nil {
							return err
						}
					}
					return nil
				},
				figures: func(f *fleet, a *armResult) { scaleOutFigures(f, a, f.pods[last].name, join) },
			}
		},
	}
}

const (
	usefulWindow = 8
	usefulFactor = 2.0
)

// scaleOutFigures measures the joined pod: the time from its join to the
// first of usefulWindow consecutive requests on it whose median TTFT is
// within usefulFactor of the warm fleet's median before the join, and its
// first ten seconds.
func scaleOutFigures(f *fleet, a *armResult, name string, join float64) {
	var before []float64
	var mine []*request
	for _, r := range f.spec.reqs {
		switch {
		case r.arrival < join:
			before = append(before, r.ttft)
		case r.destName == name:
			mine = append(mine, r)
		}
	}
	base := median(before)
	a.Figures = map[string]float64{"fleet_p50_before_s": base, "time_to_useful_s": math.NaN()}
	for i := 0; i+usefulWindow <= len(mine); i++ {
		w := make([]float64, usefulWindow)
		for j := range w {
			w[j] = mine[i+j].ttft
		}
		if median(w) <= usefulFactor*base {
			a.Figures["time_to_useful_s"] = mine[i].arrival - join
			break
		}
	}
	var first []float64
	reuse, all := 0, 0
	for _, r := range mine {
		if r.arrival < join+10 {
			first = append(first, r.ttft)
			reuse += r.localBlocks + r.pulledBlocks
			all += r.localBlocks + r.pulledBlocks + r.computedBlocks
		}
	}
	a.Figures["new_pod_first10s_p50_s"] = median(first)
	a.Figures["new_pod_first10s_reuse"] = float64(reuse) / math.Max(float64(all), 1)
}

func (o *options) routerRestartScenario() *scenario {
	k := o.studyScale
	prefixes := sharedPrefixes(o.seed+6, o.prefixes, o.prefixTokens/k)
	reqs := poissonLoad(o.seed+6, prefixes, o.routerRate, o.routerDuration, o.suffixMin/k, o.suffixMax/k)
	at, saved := o.routerAt, o.routerAt-o.routerSnapshotAge
	return &scenario{
		name:  "router-restart",
		title: fmt.Sprintf("Router restart: the router restarts at %g s, cold or from its snapshot", at),
		setup: fmt.Sprintf("the load-spill workload (%d pods, %s placement, Poisson %g req/s for %g s); each pod keeps its last %d batches for replay (a long-running fleet's buffer covers only its recent past; for the cold restart it holds none of the caches); the snapshot is saved %g s before the restart and the new subscriber replays what the pods published since; pulls counted by arrival second; tokens / %d",
			o.pods, placeLoad, o.routerRate, o.routerDuration, o.routerReplaySteps, o.routerSnapshotAge, k),
		points: []point{{rate: o.routerRate, variant: "cold"}, {rate: o.routerRate, variant: "from snapshot"}},
		published: []string{
			"negative control: a restarted router has no source map (no pulls until it relearns); the shared-stream restart waits for the scale-out issue",
		},
		ours: func(s *scenarioResult) []string {
			cold, snap := s.Arms[1].Figures, s.Arms[3].Figures
			return []string{fmt.Sprintf("pulls in the first second after the restart: %.0f cold, %.0f from snapshot (%.1f/s before it); p50 TTFT in the 5 s after: %.2f s cold, %.2f s from snapshot (%.2f / %.2f s without P2P)",
				cold["pulls_first_s"], snap["pulls_first_s"], snap["pulls_per_s_before"], cold["after_p50_s"], snap["after_p50_s"], s.Arms[0].Figures["after_p50_s"], s.Arms[2].Figures["after_p50_s"])}
		},
		spec: func(pt point, p2p bool) *runSpec {
			path := ""
			sp := &runSpec{
				scenario: "router-restart", variant: pt.variant, rate: pt.rate, p2p: p2p, place: placeLoad, aggregated: o.pods,
				gpuBlocks: o.gpuBlocks / k, cpuBlocks: o.cpuBlocks / k, cost: o.spillCost.scaled(k), hashing: o.hashing, minDelta: o.minDelta,
				reqs: cloneRequests(reqs), replaySteps: o.routerReplaySteps,
				warm: func(f *fleet) error {
					for i, pr := range prefixes {
						if err := f.warmPrompt(pr, f.pods[i%len(f.pods)]); err != nil {
							return err
						}
					}
					return nil
				},
				figures: func(f *fleet, a *armResult) {
					a.Figures = map[string]float64{}
					pulls := func(from, to float64) float64 {
						n := 0
						for _, r := range f.spec.reqs {
							if r.arrival >= from && r.arrival < to && r.pulledBlocks > 0 {
								n++
							}
						}
						return float64(n)
					}
					a.Figures["pulls_first_s"] = pulls(at, at+1)
					a.Figures["pulls_per_s_after_5s"] = pulls(at, at+5) / 5
					a.Figures["pulls_per_s_before"] = pulls(0, at) / at
					windowFigures(f.spec.reqs, at, at+5, "after_", a.Figures)
					a.Figures["unrecovered_gaps"] = float64(a.Events.Unrecovered)
				},
			}
			sp.coldRestart = pt.variant == "cold"
			if pt.variant == "from snapshot" {
				sp.actions = append(sp.actions, action{at: saved, do: func(f *fleet) error {
					dir, err := os.MkdirTemp("", "fleetreplay-snapshot-")
					if err != nil {
						return err
					}
					path = filepath.Join(dir, "index.snap")
					return f.sdk.snapshot(f.ctx, path)
				}})
			}
			sp.actions = append(sp.actions, action{at: at, do: func(f *fleet) error {
				if sp.coldRestart {
					if err := f.sdk.pushOutReplay(f.ctx, o.routerReplaySteps); err != nil {
						return err
					}
				}
				err := f.sdk.restartRouter(f.ctx, path)
				if path != "" {
					os.RemoveAll(filepath.Dir(path))
				}
				return err
			}})
			return sp
		},
	}
}
