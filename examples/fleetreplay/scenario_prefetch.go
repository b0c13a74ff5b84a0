package main

import (
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// Scenario 8, prefetch ahead of arrival: agentic sessions whose turns are
// separated by tool calls. When a turn's answer is complete the agent runs a
// tool, and the router already knows the next prompt's prefix (everything
// so far) and the pod the next turn will go to. On-demand P2P pulls that
// history when the next turn arrives, inside its TTFT; prefetch pulls it
// during the tool call, by picker.Prefetcher, through the mechanism a router
// has with vLLM today: a one-token completion of the history naming the
// source in kv_transfer_params, which the destination serves like any
// request (pulling what the source holds, computing the rest), so the turn
// finds the history as a local hit.

// prefetchOptions configure the prefetch scenario.
type prefetchOptions struct {
	sessions       int
	pods           int
	turnsMin       int // turns after the first tool call, per session
	turnsMax       int
	systemMin      int // tokens of context before the first tool call
	systemMax      int
	toolMin        int // tokens of a tool result (a turn's new prompt)
	toolMax        int
	answerMin      int // tokens of an answer
	answerMax      int
	gapMin         float64 // seconds a tool call runs
	gapMax         float64
	stagger        float64 // seconds between sessions' first tool calls
	decodePerToken float64 // seconds per answer token
	gpuBlocks      int
	cpuBlocks      int
	cost           CostModel
}

func defaultPrefetchOptions() prefetchOptions {
	return prefetchOptions{
		sessions: 24, pods: 4,
		turnsMin: 4, turnsMax: 10,
		systemMin: 8192, systemMax: 24576,
		toolMin: 512, toolMax: 4096,
		answerMin: 100, answerMax: 600,
		gapMin: 1, gapMax: 20,
		stagger:        0.5,
		decodePerToken: 0.03,
		gpuBlocks:      12000, cpuBlocks: 40000,
		cost: glm753B,
	}
}

func (po *prefetchOptions) register(fs *flag.FlagSet) {
	fs.IntVar(&po.sessions, "prefetch-sessions", po.sessions, "prefetch: agentic sessions")
	fs.IntVar(&po.pods, "prefetch-pods", po.pods, "prefetch: aggregated pods")
	fs.IntVar(&po.turnsMax, "prefetch-turns", po.turnsMax, fmt.Sprintf("prefetch: most turns after the first tool call per session (at least %d)", po.turnsMin))
	fs.IntVar(&po.systemMax, "prefetch-context", po.systemMax, fmt.Sprintf("prefetch: longest context before the first tool call, tokens (at least %d)", po.systemMin))
	fs.Float64Var(&po.gapMax, "prefetch-gap", po.gapMax, fmt.Sprintf("prefetch: longest tool call, seconds (at least %g)", po.gapMin))
	fs.IntVar(&po.gpuBlocks, "prefetch-gpu-blocks", po.gpuBlocks, "prefetch: GPU cache per pod, blocks")
	fs.IntVar(&po.cpuBlocks, "prefetch-cpu-blocks", po.cpuBlocks, "prefetch: CPU offload tier per pod, blocks")
	fs.Var(costFlag{&po.cost}, "prefetch-cost", "prefetch cost model, seconds: "+strings.Join(costKeys, "=,")+"=")
}

func (po *prefetchOptions) validate(blockSize int) error {
	checks := []struct {
		ok  bool
		msg string
	}{
		{po.sessions > 0 && po.pods > 1, "--prefetch-sessions must be positive and --prefetch-pods at least 2"},
		{po.turnsMin > 0 && po.turnsMax >= po.turnsMin, "--prefetch-turns below the fewest turns"},
		{po.systemMin > 0 && po.systemMax >= po.systemMin, "--prefetch-context below the shortest context"},
		{po.toolMin > 0 && po.toolMax >= po.toolMin && po.answerMin > 0 && po.answerMax >= po.answerMin, "prefetch tool results and answers need positive lengths"},
		{po.gapMin > 0 && po.gapMax >= po.gapMin, "--prefetch-gap below the shortest tool call"},
		{po.stagger >= 0 && po.decodePerToken >= 0, "prefetch stagger and decode time must not be negative"},
	}
	for _, c := range checks {
		if !c.ok {
			return errors.New(c.msg)
		}
	}
	if err := po.cost.validate(); err != nil {
		return fmt.Errorf("--prefetch-cost: %w", err)
	}
	longest := po.systemMax + po.answerMax + po.turnsMax*(po.toolMax+po.answerMax)
	if need := 2 * longest / blockSize; po.gpuBlocks < need || po.cpuBlocks < need {
		return fmt.Errorf("prefetch caches must hold at least %d blocks (two of the longest sessions)", need)
	}
	return nil
}

// agentSession is one session's whole trajectory, drawn once and replayed
// by both arms.
type agentSession struct {
	home  int       // the pod that ran the session before the replay
	start float64   // when its first tool call starts
	hist  []*prompt // hist[k]: everything before turn k's tool result
	tool  [][]uint32
	// answer[k] is the number of tokens turn k's answer adds to hist[k+1];
	// gap[k] is the tool call before turn k; dest[k] is turn k's pod.
	answer []int
	gap    []float64
	dest   []int
}

func uniformInt(rng *rand.Rand, lo, hi int) int { return lo + rng.IntN(hi-lo+1) }

// agentSessions draws the sessions: a context (system prompt, task, first
// answer) that the session's home pod holds, then turns of a tool result
// and an answer. Each turn goes to a pod drawn at random, as a load
// balancer that ignores prefixes places it; the router knows the pod when
// the tool call starts.
func agentSessions(seed uint64, po *prefetchOptions) []*agentSession {
	rng := rand.New(rand.NewPCG(seed, 0xa6e7)) //nolint:gosec // a reproducible workload
	out := make([]*agentSession, po.sessions)
	for s := range out {
		turns := uniformInt(rng, po.turnsMin, po.turnsMax)
		a := &agentSession{home: s % po.pods, start: float64(s) * po.stagger}
		ctx := uniformInt(rng, po.systemMin, po.systemMax) + uniformInt(rng, po.answerMin, po.answerMax)
		tools := make([]int, turns)
		total := ctx
		for k := range turns {
			tools[k] = uniformInt(rng, po.toolMin, po.toolMax)
			a.answer = append(a.answer, uniformInt(rng, po.answerMin, po.answerMax))
			a.gap = append(a.gap, po.gapMin+rng.Float64()*(po.gapMax-po.gapMin))
			a.dest = append(a.dest, rng.IntN(po.pods))
			total += tools[k] + a.answer[k]
		}
		all := randomTokens(rng, total)
		end := ctx
		for k := range turns {
			a.hist = append(a.hist, &prompt{id: s*1000 + k, tokens: all[:end:end]})
			a.tool = append(a.tool, all[end:end+tools[k]:end+tools[k]])
			end += tools[k] + a.answer[k]
		}
		a.hist = append(a.hist, &prompt{id: s*1000 + turns, tokens: all[:end:end]})
		out[s] = a
	}
	return out
}

func (o *options) prefetchScenario() *scenario {
	po := &o.pf
	sessions := agentSessions(o.seed, po)
	turns := 0
	for _, a := range sessions {
		turns += len(a.tool)
	}
	return &scenario{
		name: "prefetch",
		title: fmt.Sprintf("Prefetch ahead of arrival: %d agentic sessions, %d turns after tool calls, %d aggregated pods",
			po.sessions, turns, po.pods),
		setup: fmt.Sprintf("contexts %d-%d tokens, tool results %d-%d, answers %d-%d, tool calls %g-%g s; each turn on a random pod, known when the tool call starts; "+
			"TTFT of every turn after a tool call; P2P on-demand pulls the history when the turn arrives, prefetch during the tool call (a max_tokens=1 completion naming the source); cost model: %d-token prefill %.1f s alone, pull %.1f s",
			po.systemMin, po.systemMax, po.toolMin, po.toolMax, po.answerMin, po.answerMax, po.gapMin, po.gapMax,
			po.systemMax, po.cost.Prefill(0, po.systemMax), po.cost.Pull(po.systemMax)),
		points: rates(0),
		spec: func(_ point, prefetch bool) *runSpec {
			return o.prefetchSpec(sessions, prefetch)
		},
	}
}

// agentRun is one arm's bookkeeping of the sessions.
type agentRun struct {
	sessions []*agentSession
	po       *prefetchOptions
	prefetch bool
	reqs     [][]*request // reqs[s][k]: session s's turn k
	turn     map[*request][2]int
	pf       *picker.Prefetcher
}

func (o *options) prefetchSpec(sessions []*agentSession, prefetch bool) *runSpec {
	po := &o.pf
	a := &agentRun{sessions: sessions, po: po, prefetch: prefetch, turn: make(map[*request][2]int)}
	spec := &runSpec{
		scenario: "prefetch", p2p: true, armName: "P2P on-demand", place: placeLoad, aggregated: po.pods,
		gpuBlocks: po.gpuBlocks, cpuBlocks: po.cpuBlocks, cost: po.cost, hashing: o.hashing, minDelta: o.minDelta,
		finished: a.finished,
	}
	if prefetch {
		spec.armName = "P2P + prefetch"
	}
	for s, ses := range sessions {
		var rs []*request
		for k := range ses.tool {
			r := &request{
				id: len(spec.reqs), name: fmt.Sprintf("agent-%d-s%d-t%d", o.seed, s, k), arrival: -1,
				prefix: ses.hist[k], suffix: ses.tool[k],
			}
			if k == 0 {
				r.arrival = ses.start + ses.gap[0]
			}
			a.turn[r] = [2]int{s, k}
			rs = append(rs, r)
			spec.reqs = append(spec.reqs, r)
			spec.replay = append(spec.replay, ses.dest[k])
		}
		a.reqs = append(a.reqs, rs)
	}
	spec.warm = func(f *fleet) error {
		for s, ses := range sessions {
			if err := f.warmPrompt(ses.hist[0], f.pods[ses.home]); err != nil {
				return err
			}
			f.clk.at(ses.start, func() { a.toolCall(f, s, 0) })
		}
		return nil
	}
	return spec
}

// finished follows a turn's first token: its answer decodes, the answer's
// blocks join the pod's cache (as vLLM caches generated tokens' full
// blocks), and the next tool call starts.
func (a *agentRun) finished(f *fleet, r *request) {
	sk, ok := a.turn[r]
	if !ok {
		return
	}
	s, k := sk[0], sk[1]
	ses := a.sessions[s]
	if k+1 >= len(ses.tool) {
		return
	}
	p := f.podByName(r.destName)
	f.clk.after(float64(ses.answer[k])*a.po.decodePerToken, func() {
		if err := f.warmPrompt(ses.hist[k+1], p); err != nil {
			f.fail(err)
			return
		}
		next := a.reqs[s][k+1]
		next.arrival = f.clk.now + ses.gap[k+1]
		f.clk.at(next.arrival, func() { f.arrive(f.ctx, next) })
		a.toolCall(f, s, k+1)
	})
}

// toolCall runs when the tool call before session s's turn k starts: the
// turn's history is final and its pod known. With prefetch on, the router
// asks the Prefetcher whether to move the history there now.
func (a *agentRun) toolCall(f *fleet, s, k int) {
	if !a.prefetch || f.err != nil {
		return
	}
	ses := a.sessions[s]
	dest := f.pods[ses.dest[k]]
	wr := &request{name: "prefetch-" + a.reqs[s][k].name, prefix: ses.hist[k]}
	var err error
	if wr.eng.keys, err = f.eng.keys(wr); err != nil {
		f.fail(err)
		return
	}
	if wr.keys, err = f.rtr.keys(wr); err != nil {
		f.fail(err)
		return
	}
	if err := f.sdk.sync(f.ctx); err != nil {
		f.fail(err)
		return
	}
	if a.pf == nil {
		a.pf = picker.NewPrefetcher(f.sdk.pk, picker.PrefetchConfig{Now: f.clk.wall})
	}
	pf, err := a.pf.Prefetch(picker.PrefetchRequest{Session: fmt.Sprintf("s%d", s), Request: picker.Request{
		ID: wr.name, Model: f.model, Keys: wr.keys, Destination: dest.holder(), Candidates: f.sdk.candidates(f.pods),
	}})
	if err != nil {
		f.fail(err)
		return
	}
	f.res.Decisions["prefetch_"+pf.State.String()]++
	if pf.State != picker.PrefetchStarted {
		return
	}
	f.res.PullDecisions++
	d := &pf.Decision
	if !slices.Equal(d.Missing, wr.eng.keys[d.Cached:d.Cached+d.Gain]) {
		f.fail(fmt.Errorf("%s: prefetch's missing keys are not the history's blocks %d..%d", wr.name, d.Cached, d.Cached+d.Gain))
		return
	}
	// The router sends the warm-up completion; the pod reads it as vLLM
	// does: one token, the source from kv_transfer_params.
	body, err := pf.Warmup(f.model, ses.hist[k].tokens, "", wr.name)
	if err != nil {
		f.fail(err)
		return
	}
	src := f.byHost[body.KVTransferParams.RemoteKVSource.RemoteHost]
	if src == nil || body.MaxTokens != 1 {
		f.fail(fmt.Errorf("%s: warm-up names unknown host %q", wr.name, body.KVTransferParams.RemoteKVSource.RemoteHost))
		return
	}
	a.warmup(dest, wr, &pullOrder{source: src, addr: f.sdk.mv.addr(src), end: d.Cached + d.Gain}, pf)
}

// warmup serves the one-token completion on p: pull what the source holds,
// compute the rest, then tell the prefetcher. The order's own decision is
// zero: the Prefetch, not the order, releases the source.
func (a *agentRun) warmup(p *pod, r *request, o *pullOrder, pf picker.Prefetch) {
	f := p.f
	p.load++
	r.destName = p.name
	keys := r.eng.keys
	end := func() {
		p.load--
		// The warm-up is no turn, but its blocks count where they came
		// from like any request's.
		f.res.BlocksPulled += r.pulledBlocks
		f.res.ComputedBlocks += r.computedBlocks
		if r.pulledBlocks > 0 {
			pf.Complete()
		} else {
			pf.Cancel()
		}
	}
	rest := func() {
		l := p.localPrefix(keys)
		if l >= len(keys) {
			end()
			return
		}
		r.computedBlocks = len(keys) - l
		w := p.expect(keys[l:])
		p.compute.add(f.cost().Prefill(l*f.blockSize, len(keys)*f.blockSize), func() {
			p.store(r, l, len(keys), index.TierGPU)
			p.store(r, l, len(keys), index.TierCPU)
			p.flush()
			p.land(keys[l:], w)
			end()
		})
	}
	l := p.localPrefix(keys)
	if l >= o.end {
		rest()
		return
	}
	p.pull(r, o, l, o.end, rest)
}
