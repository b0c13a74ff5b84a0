package main

import (
	"fmt"
	"math"
	"slices"
)

// The scenarios below are the rest of the P2P study (issue 15): session
// history across prefill/decode roles, a complete-policy comparison,
// skewed prefixes, a pod joining, restarts of the prefill fleet and of the
// router, and the local-CPU-restore negative control. Their prompts and
// caches are divided by --study-scale (default 8) with the cost models
// scaled to charge the same seconds for them, so that the default run fits
// the demo's time budget; --study-scale 1 replays them at published sizes.

// qwen30BA3B is a Qwen3-30B-A3B-like prefill/decode deployment: a 62K-token
// prefill takes about 3.2 s alone and pulling it from a decode pod's CPU
// tier about 0.6 s; replies decode at 10 ms a token.
var qwen30BA3B = CostModel{
	Linear:       1.4 / 62000,
	Quadratic:    1.8 / (62000.0 * 62000.0),
	PullFloor:    0.1,
	PullPerToken: 0.5 / 62000,
	CPULoad:      0.05 / 62000,
	FirstToken:   0.1,
}

// scaled returns m charging for tokens k times shorter what it charges for
// the published lengths.
func (m CostModel) scaled(k int) CostModel {
	f := float64(k)
	m.Linear *= f
	m.Quadratic *= f * f
	m.PullPerToken *= f
	m.CPULoad *= f
	return m
}

// pdShape is the published P/D session workload: 24 conversations, system
// prompts of 10K-100K tokens, 4-40 turns of about 1,500 input and 425
// output tokens, tool-call gaps of 1-20 s.
func (o *options) pdShape(conversations int) sessionShape {
	return sessionShape{
		conversations: conversations,
		sysMin:        10000, sysMax: 100000,
		turnsMin: 4, turnsMax: o.pdTurnsMax,
		inMin: 1000, inMax: 2000, outMin: 300, outMax: 550,
		gapMin: 1, gapMax: 20, decodePerToken: 0.01,
		start: 10, scale: o.studyScale,
	}
}

// pdSpec is a P/D session arm: 2 prefill pods and 4 decode pods.
func (o *options) pdSpec(name string, reqs []*request, p2p bool, place placement, prefillGPU, prefillCPU, minDelta int) *runSpec {
	k := o.studyScale
	return &runSpec{
		scenario: name, p2p: p2p, place: place, prefill: 2, decode: 4,
		gpuBlocks: prefillGPU / k, cpuBlocks: prefillCPU / k,
		decodeGPU: 40000 / k, decodeCPU: 200000 / k,
		cost: qwen30BA3B.scaled(k), hashing: o.hashing, minDelta: minDelta,
		reqs: cloneRequests(reqs),
	}
}

// median returns the median of xs (NaN when empty).
func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return quantile(s, 0.5)
}

func (o *options) pdSessionScenario() *scenario {
	reqs := sessions(o.seed, "pd", o.pdShape(o.pdConversations))
	return &scenario{
		name:  "pd-session",
		title: fmt.Sprintf("P/D session: %d conversations carry their history across prefill and decode pods", o.pdConversations),
		setup: fmt.Sprintf("2 prefill + 4 decode pods, least-loaded prefill placement; system prompts 10K-100K tokens, 4-%d turns of 1,000-2,000 in / 300-550 out tokens, tool gaps 1-20 s; Qwen3-30B-A3B-like cost (62K prefill %.1f s alone, pull %.2f s); tokens / %d",
			o.pdTurnsMax, qwen30BA3B.Prefill(0, 62000), qwen30BA3B.Pull(62000), o.studyScale),
		points: rates(0),
		published: []string{
			"Qwen3-30B-A3B: median TTFT 6.83 -> 1.09 s (6.3x), throughput 0.82 -> 1.24 req/s (+50%); worst case (a cold 100K first prefill) unchanged",
		},
		ours: func(s *scenarioResult) []string {
			off, on := s.Arms[0], s.Arms[1]
			return []string{fmt.Sprintf("median TTFT %.2f -> %.2f s (%.1fx, ratio %.2f), throughput %.2f -> %.2f req/s (%+.0f%%); worst first turn %.1f / %.1f s; %.0f history tokens moved",
				off.P50, on.P50, off.P50/on.P50, on.P50/off.P50, off.Throughput, on.Throughput, 100*(on.Throughput/off.Throughput-1),
				off.Figures["worst_first_turn_s"], on.Figures["worst_first_turn_s"], on.Figures["history_tokens_moved"])}
		},
		spec: func(_ point, p2p bool) *runSpec {
			sp := o.pdSpec("pd-session", reqs, p2p, placeLoad, 16000, 32000, o.minDelta)
			sp.figures = func(f *fleet, a *armResult) {
				worst := 0.0
				for _, r := range f.spec.reqs {
					if r.turn == 0 {
						worst = max(worst, r.ttft)
					}
				}
				a.Figures = map[string]float64{
					"worst_first_turn_s":   worst,
					"history_tokens_moved": float64(a.BlocksPulled * f.blockSize * o.studyScale),
				}
			}
			return sp
		},
	}
}

// windowFigures summarises the requests arriving in [from, to): their mean,
// p50 and p90 TTFT.
func windowFigures(reqs []*request, from, to float64, prefix string, into map[string]float64) {
	var xs []float64
	for _, r := range reqs {
		if r.arrival >= from && r.arrival < to {
			xs = append(xs, r.ttft)
		}
	}
	slices.Sort(xs)
	sum := 0.0
	for _, x := range xs {
		sum += x
	}
	into[prefix+"requests"] = float64(len(xs))
	if len(xs) > 0 {
		into[prefix+"mean_s"] = sum / float64(len(xs))
		into[prefix+"p50_s"] = quantile(xs, 0.5)
		into[prefix+"p90_s"] = quantile(xs, 0.9)
	}
}

func (o *options) restartStormScenario() *scenario {
	reqs := sessions(o.seed+1, "storm", o.pdShape(o.stormConversations))
	at, win := o.stormAt, o.stormWindow
	return &scenario{
		name:  "restart-storm",
		title: fmt.Sprintf("Restart storm: both prefill pods restart at %g s under %d live P/D conversations", at, o.stormConversations),
		setup: fmt.Sprintf("2 prefill + 4 decode pods, prefix-affinity prefill placement, prefill tiers hold every history until the restart empties them; the P/D session workload; TTFT through the recovery = turns arriving in [%g, %g) s; tokens / %d",
			at, at+win, o.studyScale),
		points:    rates(0),
		published: []string{"(not measured in the study) without pulls a synchronized recompute storm; with pulls the decode tier serves the history back"},
		ours: func(s *scenarioResult) []string {
			off, on := s.Arms[0].Figures, s.Arms[1].Figures
			return []string{fmt.Sprintf("through the recovery: mean TTFT %.2f -> %.2f s (ratio %.2f), p90 %.2f -> %.2f s; before the restart mean %.2f / %.2f s",
				off["recovery_mean_s"], on["recovery_mean_s"], on["recovery_mean_s"]/off["recovery_mean_s"], off["recovery_p90_s"], on["recovery_p90_s"],
				off["before_mean_s"], on["before_mean_s"])}
		},
		spec: func(_ point, p2p bool) *runSpec {
			sp := o.pdSpec("restart-storm", reqs, p2p, placeAffinity, 80000, 400000, o.minDelta)
			sp.actions = []action{{at: at, do: func(f *fleet) error {
				for _, p := range f.pods {
					if p.role == rolePrefill {
						p.restart()
					}
				}
				return nil
			}}}
			sp.figures = func(f *fleet, a *armResult) {
				a.Figures = map[string]float64{}
				windowFigures(f.spec.reqs, at, at+win, "recovery_", a.Figures)
				windowFigures(f.spec.reqs, 0, at, "before_", a.Figures)
			}
			return sp
		},
	}
}

func (o *options) cpuRestoreScenario() *scenario {
	reqs := sessions(o.seed+2, "cpu", o.pdShape(o.pdConversations))
	const delta = 2048
	return &scenario{
		name:      "cpu-restore-control",
		title:     "Negative control: local CPU restore is not a peer transfer",
		setup:     fmt.Sprintf("the P/D session workload under prefix-affinity prefill placement; prefill GPU tiers too small for the sessions, CPU tiers large: histories come back from the local CPU tier; threshold %d tokens (the reply each decode pod holds is below it); tokens / %d", delta, o.studyScale),
		points:    rates(0),
		published: []string{"P/D with the CPU tier under prefix-affine placement: gains from the local tier, pulls idle"},
		ours: func(s *scenarioResult) []string {
			on := s.Arms[1]
			return []string{fmt.Sprintf("%d pulls; %.0f%% of prompt blocks restored from the local CPU tier, %.0f%% local in all",
				on.PullsIssued, on.Figures["cpu_restored_share"]*100, on.Figures["local_share"]*100)}
		},
		spec: func(_ point, p2p bool) *runSpec {
			sp := o.pdSpec("cpu-restore-control", reqs, p2p, placeAffinity, 12000, 400000, delta)
			sp.figures = func(f *fleet, a *armResult) {
				all := float64(a.LocalBlocks + a.ComputedBlocks + a.BlocksPulled)
				a.Figures = map[string]float64{
					"cpu_restored_share": float64(a.CPURestored) / math.Max(all, 1),
					"local_share":        float64(a.LocalBlocks) / math.Max(all, 1),
				}
			}
			return sp
		},
	}
}
