package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/kvsource/kvsource/picker/kvhints"
)

// Scenario 14, pulls driven by KV hints (issue 31): the load-spill
// workload with the picker's pulls handed to the destinations two ways.
// The P2P connector arm is the fleet's usual path (remote_kv_source, the
// destination looks up the source and fetches the leading hits). The KV
// hints arm attaches a kv.fetch@1.0 envelope (picker/kvhints) to the body
// sent to the destination, whose engine reads that body as KVCR does and
// pulls the hinted blocks from the named control endpoint; a source that
// lost some of them writes the rest (a partial write_done) and the
// destination recomputes from the first it lacks. The negative control
// runs the hints path with no pod's KVCR endpoint configured: no decision
// gets a hint, and the arm must be the no-pull arm request by request.

// hintsOptions configure the KV hints scenario; the fleet, prefixes,
// caches and cost model are the load spill's.
type hintsOptions struct {
	rate      float64
	duration  float64
	placement string
}

func defaultHintsOptions() hintsOptions {
	return hintsOptions{rate: 12, duration: 5, placement: string(kvhints.DefaultPlacement)}
}

func (ho *hintsOptions) register(fs *flag.FlagSet) {
	fs.Float64Var(&ho.rate, "hints-rate", ho.rate, "kv-hints: offered req/s of the load-spill workload")
	fs.Float64Var(&ho.duration, "hints-duration", ho.duration, "kv-hints: seconds of arrivals")
	fs.StringVar(&ho.placement, "hints-placement", ho.placement, "kv-hints: where the router puts the hint and the engines read it: kv_hint, kv_hints or router_hint")
}

func (ho *hintsOptions) validate() error {
	if ho.rate <= 0 || ho.duration <= 0 {
		return errors.New("--hints-rate and --hints-duration must be positive")
	}
	if _, err := kvhints.ParsePlacement(ho.placement); err != nil {
		return fmt.Errorf("--hints-placement: %w", err)
	}
	return nil
}

// The kv-hints arms, in the order they run.
const (
	armNoPull        = "without P2P"
	armConnector     = "P2P connector"
	armHintsDisabled = "hints disabled"
	armHints         = "KV hints"
)

func (o *options) kvHintsScenario() *scenario {
	ho := &o.hints
	placement, _ := kvhints.ParsePlacement(ho.placement)
	prefixes := sharedPrefixes(o.seed, o.prefixes, o.prefixTokens)
	reqs := poissonLoad(o.seed, prefixes, ho.rate, ho.duration, o.suffixMin, o.suffixMax)
	return &scenario{
		name: "kv-hints",
		title: fmt.Sprintf("KV hints: the load-spill workload at %g req/s, pulls sent as kv.fetch@1.0 hints the destination's KVCR reads, against the P2P connector",
			ho.rate),
		setup: fmt.Sprintf("%d aggregated pods, %s placement, %d shared %d-token prefixes, %g s of arrivals; the hint in %s, read by KVCR's rules; "+
			"hints disabled: no KVCR endpoint configured, so no hint (must equal %s); hit rate: prompt blocks not computed; compute: the pods' prefill seconds",
			o.pods, placeLoad, o.prefixes, o.prefixTokens, ho.duration, placementField(placement), armNoPull),
		points: []point{{variant: "connector"}, {variant: "hints"}},
		table:  writeHintsTable,
		ours:   hintsOurs,
		spec: func(pt point, on bool) *runSpec {
			// The load spill's fleet and warm caches, with this scenario's requests.
			sp := o.loadSpec("kv-hints", prefixes, 0, true, placeLoad)
			sp.rate, sp.variant, sp.reqs, sp.figures = ho.rate, pt.variant, cloneRequests(reqs), hintsFigures
			switch {
			case pt.variant == "connector" && !on:
				sp.p2p, sp.armName = false, armNoPull
			case pt.variant == "connector":
				sp.armName = armConnector
			case !on:
				sp.armName, sp.hints = armHintsDisabled, &hintsSpec{placement: placement, disabled: true}
			default:
				sp.armName, sp.hints = armHints, &hintsSpec{placement: placement}
			}
			return sp
		},
	}
}

func placementField(p kvhints.Placement) string {
	if p == kvhints.PlacementKVHints {
		return "the top-level kv_hints"
	}
	return "kv_transfer_params." + string(p)
}

// hintsFigures adds the hit rate, the prefill compute and, on the hints
// path, what became of the hints.
func hintsFigures(f *fleet, a *armResult) {
	busy := 0.0
	for _, p := range f.pods {
		busy += p.compute.busy
	}
	total := a.LocalBlocks + a.BlocksPulled + a.ComputedBlocks
	a.Figures = map[string]float64{"compute_s": busy, "hit_rate": float64(a.LocalBlocks+a.BlocksPulled) / float64(max(total, 1))}
	if h := f.sdk.hints; h != nil {
		a.Figures["hints_sent"] = float64(h.stats.hinted)
		a.Figures["hints_refused"] = float64(h.stats.refused)
		a.Figures["partial_pulls"] = float64(h.stats.partial)
		a.Figures["stranded_blocks"] = float64(h.stats.stranded)
	}
}

func writeHintsTable(w io.Writer, s *scenarioResult) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "arm\treqs\thit rate\tp50 TTFT s\tp90 TTFT s\tp99 TTFT s\tpull decisions\thints sent\tpulls issued\tverified\tpartial\tbytes moved\tcompute s\t")
	for _, a := range s.Arms {
		hints := "-"
		partial := "-"
		if _, ok := a.Figures["hints_sent"]; ok {
			hints = fmt.Sprintf("%.0f", a.Figures["hints_sent"])
			partial = fmt.Sprintf("%.0f", a.Figures["partial_pulls"])
		}
		fmt.Fprintf(tw, "%s\t%d\t%.1f%%\t%.2f\t%.2f\t%.2f\t%d\t%s\t%d\t%d\t%s\t%s\t%.1f\t\n",
			a.Arm, a.Requests, 100*a.Figures["hit_rate"], a.P50, a.P90, a.P99, a.PullDecisions, hints,
			a.PullsIssued, a.PullsVerified, partial, humanBytes(a.BytesMoved), a.Figures["compute_s"])
	}
	tw.Flush()
}

// hintsArms returns the scenario's arms by name.
func hintsArms(s *scenarioResult) map[string]*armResult {
	m := make(map[string]*armResult, len(s.Arms))
	for _, a := range s.Arms {
		m[a.Arm] = a
	}
	return m
}

func hintsOurs(s *scenarioResult) []string {
	m := hintsArms(s)
	off, conn, dis, hint := m[armNoPull], m[armConnector], m[armHintsDisabled], m[armHints]
	if off == nil || conn == nil || dis == nil || hint == nil {
		return nil
	}
	control := "identical request by request (destination, blocks, TTFT)"
	if n := requestsDiffer(off, dis); n > 0 {
		control = fmt.Sprintf("DIFFERENT at %d requests", n)
	}
	return []string{
		fmt.Sprintf("%s vs %s: hit rate %.1f%% -> %.1f%%, pulls %d -> %d (verified %d -> %d, %.0f partial), bytes %s -> %s, TTFT p50 %.2f -> %.2f s, p90 %.2f -> %.2f s, prefill compute %.1f -> %.1f s",
			armHints, armConnector, 100*conn.Figures["hit_rate"], 100*hint.Figures["hit_rate"], conn.PullsIssued, hint.PullsIssued,
			conn.PullsVerified, hint.PullsVerified, hint.Figures["partial_pulls"], humanBytes(conn.BytesMoved), humanBytes(hint.BytesMoved),
			conn.P50, hint.P50, conn.P90, hint.P90, conn.Figures["compute_s"], hint.Figures["compute_s"]),
		fmt.Sprintf("%s vs %s: hit rate %.1f%% -> %.1f%%, TTFT p50 %.2f -> %.2f s, p90 %.2f -> %.2f s, prefill compute %.1f -> %.1f s",
			armHints, armNoPull, 100*off.Figures["hit_rate"], 100*hint.Figures["hit_rate"], off.P50, hint.P50, off.P90, hint.P90,
			off.Figures["compute_s"], hint.Figures["compute_s"]),
		fmt.Sprintf("%s (%d pull decisions, %.0f hints, %d pulls) vs %s: %s", armHintsDisabled, dis.PullDecisions, dis.Figures["hints_sent"], dis.PullsIssued, armNoPull, control),
	}
}

// requestsDiffer counts the requests two arms of one workload served
// differently: destination, where their blocks came from, or TTFT.
func requestsDiffer(a, b *armResult) int {
	if len(a.reqs) != len(b.reqs) {
		return max(len(a.reqs), len(b.reqs))
	}
	n := 0
	for i, r := range a.reqs {
		q := b.reqs[i]
		if r.destName != q.destName || r.localBlocks != q.localBlocks || r.pulledBlocks != q.pulledBlocks ||
			r.computedBlocks != q.computedBlocks || r.ttft != q.ttft {
			n++
		}
	}
	return n
}
