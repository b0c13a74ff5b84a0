package main

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/transfer"
)

// pricingModel is one deployment of the pricing scenario, with the study's
// figures for it.
type pricingModel struct {
	name    string
	cost    CostModel
	lengths []int
	// published recompute and pull TTFT in ms at lengths (0: not published).
	recompute, pull []float64
	note            string // published figures that are not per length
}

// gptOSS120B is fitted to the study's H200 figures: recompute 78 / 250 /
// 510 / 1,173 / 1,988 ms and pull 35 / 57 / 86 / 165 / 235 ms at 2,048 /
// 8,192 / 16,384 / 32,768 / 49,152 tokens.
var gptOSS120B = CostModel{
	Linear:       2.55e-5,
	Quadratic:    2.85e-10,
	PullFloor:    0.005,
	PullPerToken: 4.3e-6,
	FirstToken:   0.02,
}

// glm753BPricing has the study's GLM-753B pricing shape: a pull floor of
// about 1.25 s, recompute and pull tied near 8K tokens, the pull 27% faster
// at 12K and 61% at 24K.
var glm753BPricing = CostModel{
	Linear:       1.028e-4,
	Quadratic:    1.535e-9,
	PullFloor:    0.865,
	PullPerToken: 1e-5,
	FirstToken:   0.385,
}

// sessionSetup is the modelled cost of a pull session's first round
// between two peers (connect, handshake, memory registration), which the
// cold probe pays and warmed pulls do not.
const sessionSetup = 0.2

func pricingModels() []pricingModel {
	return []pricingModel{
		{
			name: "gpt-oss-120b-like", cost: gptOSS120B,
			lengths:   []int{2048, 8192, 16384, 32768, 49152},
			recompute: []float64{78, 250, 510, 1173, 1988},
			pull:      []float64{35, 57, 86, 165, 235},
		},
		{
			name: "GLM-753B-like", cost: glm753BPricing,
			lengths:   []int{4096, 8192, 12288, 24576, 49152},
			recompute: make([]float64, 5), pull: make([]float64, 5),
			note: "GLM-753B: pull floor about 1.2-1.3 s, tie near 8K, pull 27% faster at 12K and 61% at 24K",
		},
	}
}

func (o *options) pricingScenario() *scenario {
	return &scenario{
		name:  "pricing",
		title: "Pricing: the transfer price, isolated (a pod pair, no router)",
		setup: fmt.Sprintf("a fresh salted prefix seeded on the source, requested on the consumer with the source injected; pulls over vLLM's P2P protocol (transfer/p2p) timed by transfer.MeasurePull on virtual time (3 warmed pulls per length; the cold probe pays a modelled %.0f ms session set-up), fitted with picker.Fit (margin %.0f%%)",
			sessionSetup*1000, picker.DefaultMargin*100),
		published: []string{
			"gpt-oss-120b H200: recompute 78 / 250 / 510 / 1,173 / 1,988 ms, pull 35 / 57 / 86 / 165 / 235 ms at 2K / 8K / 16K / 32K / 48K tokens",
			"GLM-753B: pull floor about 1.2-1.3 s, tie near 8K, pull 27% faster at 12K and 61% at 24K",
		},
		run: func(ctx context.Context, o *options) (*scenarioResult, error) {
			res := &scenarioResult{table: writePricing, plot: plotPricing}
			for _, m := range pricingModels() {
				rows, ours, err := o.price(ctx, m)
				if err != nil {
					return nil, fmt.Errorf("%s: %w", m.name, err)
				}
				res.Pricing = append(res.Pricing, rows...)
				res.Ours = append(res.Ours, ours)
			}
			return res, nil
		},
	}
}

// timedSession charges a pull session's calls on the fleet's virtual clock
// (the set-up on the first lookup, the cost model's pull on each fetch) and
// verifies every fetch's blocks.
type timedSession struct {
	transfer.Session
	f        *fleet
	dest     *pod
	setup    float64
	fresh    bool
	pulls    int
	verified int
	bytes    int64
}

func (s *timedSession) Lookup(ctx context.Context, keys []transfer.Key) ([]bool, error) {
	if s.fresh {
		s.f.clk.now += s.setup
		s.fresh = false
	}
	return s.Session.Lookup(ctx, keys)
}

func (s *timedSession) Fetch(ctx context.Context, keys []transfer.Key, idx []int) (transfer.Stats, error) {
	st, err := s.Session.Fetch(ctx, keys, idx)
	if err != nil || len(keys) == 0 {
		return st, err
	}
	s.f.clk.now += s.f.cost().Pull(len(keys) * s.f.blockSize)
	s.pulls++
	s.bytes += st.Bytes
	if s.f.sdk.verifyAt(s.dest, keys, idx, st) {
		s.verified++
	}
	return st, nil
}

// price measures one model: recompute and pull at each length, the cold
// probe, and the fit.
func (o *options) price(ctx context.Context, m pricingModel) ([]pricingRow, string, error) {
	bs := o.hashing.BlockSize
	if bs == 0 {
		bs = hashing.DefaultBlockSize
	}
	longest := m.lengths[len(m.lengths)-1]
	rng := newRand(o.seed, 0x9e1ce)
	pr := &prompt{id: 0, tokens: randomTokens(rng, longest), salt: fmt.Sprintf("pricing-%s-%d", m.name, o.seed)}
	probe := &request{name: "pricing-probe", prefix: pr}
	spec := &runSpec{
		scenario: "pricing", aggregated: 2, gpuBlocks: 2 * longest / bs, cpuBlocks: 2 * longest / bs,
		cost: m.cost, hashing: o.hashing, minDelta: o.minDelta, reqs: []*request{probe},
	}
	f, err := newFleet(ctx, spec, sdkOptions{transport: "p2p", blockBytes: o.blockBytes, hashCheck: o.hashCheck, logger: o.logger})
	if err != nil {
		return nil, "", err
	}
	defer f.sdk.close()
	src, dest := f.pods[0], f.pods[1]
	if err := f.warmPrompt(pr, src); err != nil {
		return nil, "", err
	}
	if err := f.sdk.sync(ctx); err != nil {
		return nil, "", err
	}
	if probe.eng.keys, err = f.eng.keys(probe); err != nil {
		return nil, "", err
	}
	keys := make([]transfer.Key, len(probe.eng.keys))
	idx := make([]int, len(keys))
	for i, k := range probe.eng.keys {
		keys[i], idx[i] = f.eng.offload[k], i
	}
	// The source injected as kv_transfer_params would name it.
	raw, err := f.sdk.session(dest, f.sdk.mv.addr(src))
	if err != nil {
		return nil, "", err
	}
	s := &timedSession{Session: raw, f: f, dest: dest, setup: sessionSetup, fresh: true}
	plan := transfer.PullPlan{TokensPerKey: bs, Now: f.clk.wall}
	plan.Sizes = []int{m.lengths[0] / bs}
	cold, err := transfer.MeasurePull(ctx, s, keys, idx, plan)
	if err != nil {
		return nil, "", err
	}
	plan.Sizes, plan.Repeats = nil, 3
	for _, n := range m.lengths {
		plan.Sizes = append(plan.Sizes, n/bs)
	}
	warm, err := transfer.MeasurePull(ctx, s, keys, idx, plan)
	if err != nil {
		return nil, "", err
	}
	first := m.cost.FirstToken * 1000
	var rec, pull []transfer.Sample
	for _, n := range m.lengths {
		rec = append(rec, transfer.Sample{Tokens: n, Millis: (m.cost.Prefill(0, n) + m.cost.FirstToken) * 1000})
	}
	for _, w := range warm {
		pull = append(pull, transfer.Sample{Tokens: w.Tokens, Millis: w.Millis + first})
	}
	cal, err := picker.Fit(rec, pull, picker.DefaultMargin)
	if err != nil {
		return nil, "", err
	}
	var rows []pricingRow
	for i, n := range m.lengths {
		ms := 0.0
		for _, w := range pull {
			if w.Tokens == n {
				ms += w.Millis / float64(plan.Repeats)
			}
		}
		rows = append(rows,
			pricingRow{Scenario: "pricing", Arm: "without P2P", Model: m.name, Tokens: n, Millis: rec[i].Millis, Published: m.recompute[i]},
			pricingRow{Scenario: "pricing", Arm: "with P2P", Model: m.name, Tokens: n, Millis: ms, Published: m.pull[i]})
	}
	rows = append(rows, pricingRow{Scenario: "pricing", Arm: "with P2P (cold probe)", Model: m.name, Tokens: cold[0].Tokens, Millis: cold[0].Millis + first})
	for i := range rows {
		rows[i].Crossover, rows[i].Threshold = cal.Crossover, cal.Threshold
	}
	last := &rows[len(rows)-1]
	last.Pulls, last.Verified, last.BytesMoved = s.pulls, s.verified, s.bytes
	if s.verified != s.pulls {
		return nil, "", fmt.Errorf("%d of %d pulls failed verification", s.pulls-s.verified, s.pulls)
	}
	if err := f.sdk.sync(ctx); err != nil {
		return nil, "", err
	}
	if err := f.sdk.ev.stats().trusted(); err != nil {
		return nil, "", err
	}
	ours := fmt.Sprintf("%s: crossover %.0f tokens, recommended --min-cached-token-delta %d tokens; pull floor %.0f ms fitted; %d pulls over transfer/p2p, %d verified; cold probe %.0f ms vs warmed %.0f ms at %d tokens",
		m.name, cal.Crossover, cal.Threshold, cal.Pull.Floor, s.pulls, s.verified, cold[0].Millis+first, rows[1].Millis, m.lengths[0])
	return rows, ours, nil
}

func writePricing(w io.Writer, s *scenarioResult) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "model\ttokens\trecompute ms\tpublished\tpull ms\tpublished\tpull / recompute\t")
	pub := func(v float64) string {
		if v == 0 {
			return "-"
		}
		return fmt.Sprintf("%.0f", v)
	}
	for i := 0; i+1 < len(s.Pricing); i++ {
		r, p := s.Pricing[i], s.Pricing[i+1]
		if r.Arm != "without P2P" || p.Arm != "with P2P" {
			continue
		}
		fmt.Fprintf(tw, "%s\t%d\t%.0f\t%s\t%.0f\t%s\t%.2f\t\n", r.Model, r.Tokens, r.Millis, pub(r.Published), p.Millis, pub(p.Published), p.Millis/r.Millis)
	}
	for _, r := range s.Pricing {
		if strings.Contains(r.Arm, "cold") {
			fmt.Fprintf(tw, "%s\t%d\t\t\t%.0f\t(cold probe)\t\t\n", r.Model, r.Tokens, r.Millis)
		}
	}
	tw.Flush()
}

// plotPricing draws recompute and pull time over prefix length per model.
func plotPricing(dir string, s *scenarioResult) ([]string, error) {
	p := plot.New()
	p.Title.Text = "Pricing: recompute versus pull"
	p.X.Label.Text = "prefix tokens"
	p.Y.Label.Text = "time to first token (ms)"
	p.Add(plotter.NewGrid())
	p.Legend.Top, p.Legend.Left = true, true
	series := map[string]plotter.XYs{}
	var order []string
	for _, r := range s.Pricing {
		if strings.Contains(r.Arm, "cold") {
			continue
		}
		k := r.Model + ", " + map[string]string{"without P2P": "recompute", "with P2P": "pull"}[r.Arm]
		if _, ok := series[k]; !ok {
			order = append(order, k)
		}
		series[k] = append(series[k], plotter.XY{X: float64(r.Tokens), Y: r.Millis})
	}
	for i, k := range order {
		l, pts, err := plotter.NewLinePoints(series[k])
		if err != nil {
			return nil, err
		}
		st := armStyle["without P2P"]
		if strings.HasSuffix(k, "pull") {
			st = armStyle["with P2P"]
		}
		l.Color, pts.Color, pts.Shape = st.c, st.c, st.shape
		if i >= 2 {
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(2)}
		}
		p.Add(l, pts)
		p.Legend.Add(k, l, pts)
	}
	var paths []string
	for _, ext := range []string{".png", ".svg"} {
		path := filepath.Join(dir, "pricing"+ext)
		if err := p.Save(9*vg.Inch, 4.5*vg.Inch, path); err != nil {
			return nil, fmt.Errorf("plot %s: %w", path, err)
		}
		paths = append(paths, path)
	}
	return paths, nil
}
