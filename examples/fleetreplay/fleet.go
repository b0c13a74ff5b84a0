package main

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// placement is how the router chooses the pod that computes a prefill.
type placement string

const (
	// placeLoad sends each request to the least-loaded pod, ignoring
	// prefixes: locality breaks whenever load says so.
	placeLoad placement = "least-loaded"
	// placeAffinity sends each request to the pod holding the longest
	// prefix of it, by the index (picker.Score).
	placeAffinity placement = "prefix-affinity"
	// placeSpill is prefix affinity until the holder has spillAt requests
	// in flight, then the least-loaded pod: what a router with a prefix
	// scorer and a queue scorer does under a burst.
	placeSpill placement = "affinity-spill"
)

// runSpec is one arm of one scenario.
type runSpec struct {
	scenario   string
	rate       float64 // offered req/s; 0 for a burst
	p2p        bool
	place      placement
	spillAt    int
	prefill    int // prefill pods (a P/D split) ...
	decode     int // ... and decode pods
	aggregated int // or aggregated pods
	gpuBlocks  int
	cpuBlocks  int
	// decodeGPU and decodeCPU size the decode pods' tiers (0: as the
	// others').
	decodeGPU int
	decodeCPU int
	cost      CostModel
	hashing   hashing.Config
	minDelta  int // picker threshold in tokens
	reqs      []*request
	// warm fills the caches before the first arrival, as the traffic
	// before the replay did.
	warm func(f *fleet) error
	// replay, when set, is the destination pod of every request: the other
	// arm's placement, so both arms see the same placement.
	replay []int
	// armName, when set, names the arm instead of with/without P2P.
	armName string
	// finished, when set, sees every request's first token: a scenario
	// whose requests follow one another (a session's turns) schedules the
	// next there. Requests with a negative arrival are not scheduled at
	// the start; such a hook schedules them.
	finished func(f *fleet, r *request)
	// actions run at their virtual times: a restart, a pod joining.
	actions []action
	// down lists pods that take no requests until an action brings them up.
	down []int
	// replaySteps is how many batches each pod keeps for replay (0: the
	// publisher's default).
	replaySteps int
	// coldRestart marks a router restarted without a snapshot, whose
	// subscriber meets gaps it cannot recover.
	coldRestart bool
	// variant labels the arm within its scenario ("" when rate does).
	variant string
	// figures, when set, adds the scenario's own figures to the result.
	figures func(f *fleet, a *armResult)
	// speculative makes the router index each routed request's blocks on
	// its destination right after the pick (index.Speculative), before the
	// destination's events say so.
	speculative bool
	// hints, when set, routes the picker's pulls as KV hints the
	// destination's KVCR reads, instead of remote_kv_source.
	hints *hintsSpec
}

// action is something that happens to the fleet at a virtual time.
type action struct {
	at float64
	do func(f *fleet) error
}

func (s *runSpec) arm() string {
	if s.armName != "" {
		return s.armName
	}
	if s.p2p {
		return "with P2P"
	}
	return "without P2P"
}

// fleet is one arm's simulation: the pods, the virtual clock and the SDK path
// between them.
type fleet struct {
	spec      *runSpec
	clk       clock
	pods      []*pod
	byHost    map[string]*pod
	blockSize int
	model     string
	eng       *chainHasher
	rtr       *routerHasher
	sdk       *sdkPath
	rr        int // tie-break rotation of least-loaded placement
	rrDecode  int
	placed    []int
	res       *armResult
	err       error
	onDone    func()
	// ctx is the run's context, for arrivals scheduled while it runs.
	ctx context.Context
	// audit, when set, sees every decision with the pods' true state.
	audit func(r *request, dest *pod, d *picker.Decision)
}

// The model name the simulated engines report in their events.
const simModel = "sim/model"

func newFleet(ctx context.Context, spec *runSpec, opt sdkOptions) (*fleet, error) {
	f := &fleet{spec: spec, byHost: make(map[string]*pod), model: simModel}
	var err error
	if f.eng, err = newChainHasher(spec.hashing, true); err != nil {
		return nil, err
	}
	if f.rtr, err = newRouterHasher(spec.hashing); err != nil {
		return nil, err
	}
	f.blockSize = f.eng.h.Config().BlockSize
	add := func(r role, n int) {
		for range n {
			i := len(f.pods)
			host := fmt.Sprintf("10.0.0.%d", i+1)
			gpu, cpu := spec.gpuBlocks, spec.cpuBlocks
			if r == roleDecode && spec.decodeGPU > 0 {
				gpu, cpu = spec.decodeGPU, spec.decodeCPU
			}
			p := &pod{
				f: f, idx: i, role: r, host: host, name: host + ":8000",
				gpu: newLRU(gpu), cpu: newLRU(cpu),
				pending: make(map[uint64]*landing),
			}
			p.compute.c, p.link.c = &f.clk, &f.clk
			f.pods = append(f.pods, p)
			f.byHost[host] = p
		}
	}
	add(rolePrefill, spec.prefill)
	add(roleDecode, spec.decode)
	add(roleBoth, spec.aggregated)
	f.res = &armResult{Scenario: spec.scenario, Arm: spec.arm(), Variant: spec.variant, Rate: spec.rate, Decisions: map[string]int{}}
	if f.sdk, err = newSDKPath(ctx, f, opt); err != nil {
		return nil, err
	}
	return f, nil
}

// run replays the spec's requests and returns the arm's result and the
// placement it used.
func (f *fleet) run(ctx context.Context) (*armResult, []int, error) {
	defer f.sdk.close()
	f.ctx = ctx
	if f.spec.warm != nil {
		if err := f.spec.warm(f); err != nil {
			return nil, nil, err
		}
	}
	f.placed = make([]int, len(f.spec.reqs))
	for _, i := range f.spec.down {
		f.pods[i].down = true
	}
	for _, a := range f.spec.actions {
		f.clk.at(a.at, func() {
			if err := a.do(f); err != nil {
				f.fail(err)
			}
		})
	}
	for _, r := range f.spec.reqs {
		if r.arrival >= 0 && !r.chained {
			f.clk.at(r.arrival, func() { f.arrive(ctx, r) })
		}
	}
	for f.err == nil && f.clk.step() {
		if err := ctx.Err(); err != nil {
			return nil, nil, err
		}
	}
	if f.err != nil {
		return nil, nil, f.err
	}
	for _, r := range f.spec.reqs {
		if !r.done {
			return nil, nil, fmt.Errorf("%s %s: request %s never finished", f.spec.scenario, f.spec.arm(), r.name)
		}
	}
	f.res.finish(f.spec.reqs)
	if f.spec.figures != nil {
		f.spec.figures(f, f.res)
		if f.err != nil {
			return nil, nil, f.err
		}
	}
	// The requests outlive the fleet (in the results, and in the replay's
	// list of arms): a link from them to a pod would keep every arm's
	// caches, index and transfer memory live until the replay ends
	// (gigabytes over the default load spill).
	for _, r := range f.spec.reqs {
		r.decode = nil
	}
	f.res.Utilisation = f.utilisation()
	f.res.Transfer = f.sdk.transferStats()
	f.res.Events = f.sdk.ev.stats()
	ev := f.res.Events
	if f.spec.coldRestart {
		// A cold router cannot recover what the pods' replay buffers no
		// longer hold: those gaps are the scenario's point.
		ev.Unrecovered = 0
	}
	if err := ev.trusted(); err != nil {
		return nil, nil, fmt.Errorf("%s %s: %w", f.spec.scenario, f.spec.arm(), err)
	}
	return f.res, f.placed, nil
}

func (f *fleet) fail(err error) {
	if f.err == nil {
		f.err = err
	}
}

// arrive is the router's work for one request: hash it, bring the index up
// to date, place it, and with P2P ask the picker whether to pull.
func (f *fleet) arrive(ctx context.Context, r *request) {
	if f.err != nil {
		return
	}
	var err error
	if r.eng.keys, err = f.eng.keys(r); err != nil {
		f.fail(err)
		return
	}
	if r.keys, err = f.rtr.keys(r); err != nil {
		f.fail(err)
		return
	}
	if err := f.sdk.sync(ctx); err != nil {
		f.fail(err)
		return
	}
	f.sdk.ev.expireGuesses()
	dest, err := f.place(r)
	if err != nil {
		f.fail(err)
		return
	}
	f.placed[r.id] = dest.idx
	if f.spec.decode > 0 {
		r.decode = f.nextDecode()
		r.decodeName = r.decode.name
	}
	var o *pullOrder
	if f.spec.p2p {
		if o, err = f.sdk.decide(r, dest); err != nil {
			f.fail(err)
			return
		}
	}
	f.sdk.ev.speculate(f.model, dest.holder(), r.keys)
	dest.admit(r, o)
}

var errPlacement = errors.New("placement")

func (f *fleet) place(r *request) (*pod, error) {
	s := f.spec
	if s.replay != nil {
		if r.id >= len(s.replay) || s.replay[r.id] >= len(f.pods) {
			return nil, fmt.Errorf("%w: no recorded destination for %s", errPlacement, r.name)
		}
		return f.pods[s.replay[r.id]], nil
	}
	switch s.place {
	case placeLoad:
		return f.leastLoaded(), nil
	case placeAffinity, placeSpill:
		best, err := f.sdk.affinity(r)
		if err != nil {
			return nil, err
		}
		if best == nil || (s.place == placeSpill && best.load >= s.spillAt) {
			return f.leastLoaded(), nil
		}
		return best, nil
	}
	return nil, fmt.Errorf("%w: unknown policy %q", errPlacement, s.place)
}

// leastLoaded returns the computing pod with the fewest requests in flight,
// rotating among ties.
func (f *fleet) leastLoaded() *pod {
	var best *pod
	n := len(f.pods)
	for k := range n {
		p := f.pods[(f.rr+k)%n]
		if p.computes() && (best == nil || p.load < best.load) {
			best = p
		}
	}
	f.rr = (f.rr + 1) % n
	return best
}

func (f *fleet) nextDecode() *pod {
	var ds []*pod
	for _, p := range f.pods {
		if p.role == roleDecode {
			ds = append(ds, p)
		}
	}
	d := ds[f.rrDecode%len(ds)]
	f.rrDecode++
	return d
}

// finished records a request's first token. A conversation's turn goes on
// decoding on holder (its decode pod, or in an aggregated fleet the pod
// that computed it), which holds the reply when it is done; the next turn
// follows after the tool gap.
func (f *fleet) finished(r *request, holder *pod) {
	if f.onDone != nil {
		f.onDone()
	}
	if f.spec.finished != nil {
		f.spec.finished(f, r)
	}
	if r.answer == nil {
		return
	}
	f.clk.after(f.cost().FirstToken+r.decodeTime, func() {
		if f.err != nil {
			return
		}
		a := &request{name: r.name + "-answer", prefix: r.answer}
		ch, err := f.eng.prefix(r.answer)
		if err != nil {
			f.fail(err)
			return
		}
		a.eng.keys = ch.keys
		n := len(a.eng.keys)
		holder.store(a, 0, n, index.TierGPU)
		holder.store(a, 0, n, index.TierCPU)
		holder.touch(a.eng.keys)
		holder.flush()
		if nx := r.next; nx != nil {
			nx.arrival = f.clk.now + r.gap
			f.clk.at(nx.arrival, func() { f.arrive(f.ctx, nx) })
		}
	})
}

// warmPrompt caches tokens on the pods, as earlier traffic left them: each
// pod computes the prompt (in no time, before the replay starts) and
// publishes the events.
func (f *fleet) warmPrompt(pr *prompt, pods ...*pod) error {
	r := &request{name: fmt.Sprintf("warm-%d", pr.id), prefix: pr}
	var err error
	if r.eng.keys, err = f.eng.keys(r); err != nil {
		return err
	}
	for _, p := range pods {
		n := len(r.eng.keys)
		p.store(r, 0, n, "GPU")
		p.store(r, 0, n, "CPU")
		p.touch(r.eng.keys)
		p.flush()
	}
	return nil
}

// computePods returns the pods that compute prefills.
func (f *fleet) computePods() []*pod {
	return slices.DeleteFunc(slices.Clone(f.pods), func(p *pod) bool { return !p.computes() })
}

// pullOrder is a pull the router ordered: the destination reads the source
// from the request's kv_transfer_params, as vLLM's P2P tier does.
type pullOrder struct {
	source *pod
	addr   string // the source's P2P address
	end    int    // the pull covers the prompt's blocks up to end
	d      picker.Decision
	// hinted, when set, are a kv.fetch hint's block hashes as the
	// destination's KVCR read them: it pulls the prompt's blocks from its
	// local prefix on while they are in the set (end is not used).
	hinted map[uint64]bool
}

// reach returns the end of the blocks the order pulls when the
// destination holds the prompt's first from.
func (o *pullOrder) reach(keys []uint64, from int) int {
	if o.hinted == nil {
		return o.end
	}
	e := from
	for e < len(keys) && o.hinted[keys[e]] {
		e++
	}
	return e
}

// release tells the picker the pull is over.
func (o *pullOrder) release() { o.d.Done() }

func (f *fleet) cost() *CostModel { return &f.spec.cost }

// utilisation returns the computing pods' mean busy share of the run.
func (f *fleet) utilisation() float64 {
	first, last := -1.0, 0.0
	for _, r := range f.spec.reqs {
		if first < 0 || r.arrival < first {
			first = r.arrival
		}
		last = max(last, r.arrival+r.ttft-f.cost().FirstToken)
	}
	ps := f.computePods()
	if last <= first || len(ps) == 0 {
		return 0
	}
	busy := 0.0
	for _, p := range ps {
		busy += p.compute.busy
	}
	return busy / float64(len(ps)) / (last - first)
}
