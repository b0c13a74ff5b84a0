package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"weak"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// shortOptions is the default replay, shortened to keep the test fast: the
// fork burst as published; the load spill at 8 and 16 req/s for 12 s, with
// every prompt and cache a quarter as long and the cost model scaled to
// charge the same time for it.
func shortOptions(t *testing.T) *options {
	o := defaultOptions()
	o.scenarios = []string{"fork", "spill", "control"}
	o.rates = []float64{8, 16}
	o.duration = 12
	o.plots = false
	o.outDir = t.TempDir()
	const k = 4
	o.prefixTokens /= k
	o.suffixMin /= k
	o.suffixMax /= k
	o.gpuBlocks /= k
	o.cpuBlocks /= k
	m := &o.spillCost
	m.Linear *= k
	m.Quadratic *= k * k
	m.PullPerToken *= k
	m.CPULoad *= k
	return &o
}

// auditor checks every decision against the pods' true caches: the index the
// picker read must agree with what the simulated engines hold.
type auditor struct {
	mu        sync.Mutex
	decisions int
	problems  []string
}

func (a *auditor) check(r *request, dest *pod, d *picker.Decision) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.decisions++
	keys := r.eng.keys
	// A router restarted cold does not know what the pods hold: that is
	// the router-restart scenario's point.
	cold := dest.f.spec.coldRestart && dest.f.sdk.ev.restarts > 0
	got, want := d.Cached, dest.localPrefix(keys)
	// A router indexing speculatively counts as the destination's the
	// blocks a request routed there is still computing: more than it
	// holds, but only blocks on their way in.
	if dest.f.spec.speculative && got > want {
		for _, k := range keys[want:got] {
			if dest.pending[k] == nil {
				a.problems = append(a.problems, fmt.Sprintf("%s: picker's local prefix %d counts blocks beyond %d that are not landing on the destination", r.name, got, want))
				return
			}
		}
		want = got
	}
	if got != want && !cold {
		a.problems = append(a.problems, fmt.Sprintf("%s: picker's local prefix %d differs from the destination's cache %d", r.name, got, want))
	}
	if d.Reason != picker.ReasonPull {
		return
	}
	src := dest.f.podByName(d.Source.Pod)
	for _, k := range keys[d.Cached : d.Cached+d.Gain] {
		if src == nil || !src.cpu.has(k) {
			a.problems = append(a.problems, r.name+": pull names a block its source does not hold in CPU")
			return
		}
	}
}

func TestReplayReproducesThePublishedShape(t *testing.T) {
	o := shortOptions(t)
	o.scenarios = []string{"fork", "spill", "control"}
	// The in-memory transport keeps this fast under the race detector;
	// TestTransportsAgree shows vLLM's P2P protocol replays identically.
	o.transport = "fake"
	a := &auditor{}
	o.audit = a.check
	res, err := replay(context.Background(), o, &bytes.Buffer{})
	require.NoError(t, err)
	require.Len(t, res, 3)
	require.Empty(t, a.problems)
	require.Positive(t, a.decisions)

	for _, s := range res {
		for _, arm := range s.Arms {
			require.Equal(t, arm.PullsIssued, arm.PullsVerified, "%s %s %g: every pull verified", s.Name, arm.Arm, arm.Rate)
			require.Zero(t, arm.PullsFailed)
			require.Positive(t, arm.Events.HashChecks, "the subscriber checked hash agreement")
			require.Zero(t, arm.Events.HashMismatches)
			require.Zero(t, arm.Events.Unrecovered)
			require.Equal(t, arm.Requests, len(arm.ttft))
		}
	}

	fork := res[0]
	require.Equal(t, "fork-burst", fork.Name)
	off, on := fork.Arms[0], fork.Arms[1]
	require.Positive(t, on.PullsIssued)
	require.LessOrEqual(t, on.P90, off.P90/2, "fork burst: p90 with P2P at most half of without")
	// The slow starts left with P2P are the burst head: every branch
	// noticeably slower than the median arrived in the first half.
	for i, v := range on.ttft {
		if v > 1.5*on.P50 {
			require.Less(t, i, len(on.ttft)/2, "slow branch %d (%.2f s) is not in the burst head", i, v)
		}
	}

	spill := res[1]
	require.Equal(t, "load-spill", spill.Name)
	require.Len(t, spill.Arms, 4)
	at8off, at8on, at16off, at16on := spill.Arms[0], spill.Arms[1], spill.Arms[2], spill.Arms[3]
	require.Equal(t, 8.0, at8off.Rate)
	require.Less(t, at8on.P50, at8off.P50, "load spill: lower p50 at 8 req/s with P2P")
	require.Equal(t, 16.0, at16off.Rate)
	require.Greater(t, at16on.Throughput, at16off.Throughput, "load spill: higher throughput at 16 req/s with P2P")
	require.Positive(t, at16on.PullsIssued)

	control := res[2]
	require.Equal(t, "negative-control", control.Name)
	cOn := control.Arms[1]
	require.Zero(t, cOn.PullDecisions, "negative control: the picker pulls nothing")
	require.Zero(t, cOn.PullsIssued)
	require.Zero(t, cOn.BytesMoved)
	require.Positive(t, cOn.LocalBlocks)
	require.Zero(t, cOn.Decisions[string(picker.ReasonPull)])
}

func TestReplayIsDeterministic(t *testing.T) {
	run := func() []*scenarioResult {
		o := shortOptions(t)
		o.scenarios = []string{"fork"}
		o.transport = "fake"
		res, err := replay(context.Background(), o, &bytes.Buffer{})
		require.NoError(t, err)
		return res
	}
	a, b := run(), run()
	for i := range a[0].Arms {
		require.Equal(t, a[0].Arms[i].ttft, b[0].Arms[i].ttft)
		require.Equal(t, a[0].Arms[i].Decisions, b[0].Arms[i].Decisions)
	}
}

func TestFinishedArmReleasesItsFleet(t *testing.T) {
	// The replay keeps every arm's result and requests to the end; if they
	// reached the fleet, each arm's caches, index and transfer memory would
	// stay live with them (gigabytes over the default load spill).
	o := shortOptions(t)
	o.forkBranches = 8
	spec := o.forkScenario().spec(point{}, true)
	f, err := newFleet(context.Background(), spec, sdkOptions{transport: "fake"})
	require.NoError(t, err)
	res, _, err := f.run(context.Background())
	require.NoError(t, err)
	require.NotEmpty(t, spec.reqs[0].decodeName, "the P/D split names a decode pod")
	wf := weak.Make(f)
	f = nil
	// Objects with finalizers (the ZMQ sockets) and what they reach are
	// freed a cycle later than the rest.
	for range 5 {
		runtime.GC()
	}
	require.Nil(t, wf.Value(), "the fleet is still reachable from its results")
	runtime.KeepAlive(res)
	runtime.KeepAlive(spec)
}

func TestTransportsAgree(t *testing.T) {
	// The pull's virtual time comes from the cost model, so vLLM's P2P
	// protocol over ZMQ and the in-memory fake must replay identically: the
	// fork burst's single pull of a long prefix, and the load spill's many
	// pulls from sources that evict as they go.
	var res [2][]*scenarioResult
	for i, tr := range []string{"p2p", "fake"} {
		o := shortOptions(t)
		o.scenarios = []string{"fork", "spill"}
		o.forkBranches = 16
		o.rates = []float64{16}
		o.duration = 2
		o.transport = tr
		var err error
		res[i], err = replay(context.Background(), o, &bytes.Buffer{})
		require.NoError(t, err)
	}
	for s := range res[0] {
		for i := range res[0][s].Arms {
			a, b := res[0][s].Arms[i], res[1][s].Arms[i]
			require.Equal(t, a.ttft, b.ttft, "%s %s", a.Scenario, a.Arm)
			require.Equal(t, a.PullsIssued, b.PullsIssued)
			require.Equal(t, a.PullsVerified, b.PullsVerified)
			require.Equal(t, a.BytesMoved, b.BytesMoved)
		}
		p2pArm := res[0][s].Arms[1]
		require.Positive(t, p2pArm.PullsIssued, p2pArm.Scenario)
		require.Equal(t, p2pArm.PullsIssued, p2pArm.PullsVerified, "%s: every pull over ZMQ verified", p2pArm.Scenario)
		require.Contains(t, p2pArm.Transfer, "transfer/p2p")
		require.Contains(t, res[1][s].Arms[1].Transfer, "transfer/fake")
	}
}

func TestRunWritesTablesPlotsAndJSON(t *testing.T) {
	dir := t.TempDir()
	jsonPath := filepath.Join(dir, "tables.json")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{
		"--scenarios", "fork", "--out", dir, "--json", jsonPath, "--progress", "never",
		"--fork-branches", "12", "--transport", "fake",
	}, &stdout, &stderr)
	require.Equal(t, 0, code, stderr.String())
	out := stdout.String()
	require.Contains(t, out, "p90 TTFT s")
	require.Contains(t, out, "pulls verified")
	for _, ext := range []string{".png", ".svg"} {
		p := filepath.Join(dir, "fork-burst"+ext)
		require.Contains(t, out, p)
		st, err := os.Stat(p)
		require.NoError(t, err)
		require.Positive(t, st.Size())
	}
	var doc struct {
		Scenarios []struct {
			Name string `json:"name"`
			Arms []struct {
				Scenario      string  `json:"scenario"`
				Arm           string  `json:"arm"`
				Rate          float64 `json:"rate"`
				P50           float64 `json:"p50_s"`
				P90           float64 `json:"p90_s"`
				P99           float64 `json:"p99_s"`
				Throughput    float64 `json:"throughput_rps"`
				PullsIssued   int     `json:"pulls_issued"`
				PullsVerified int     `json:"pulls_verified"`
			} `json:"arms"`
		} `json:"scenarios"`
	}
	b, err := os.ReadFile(jsonPath)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &doc))
	require.Len(t, doc.Scenarios, 1)
	arms := doc.Scenarios[0].Arms
	require.Len(t, arms, 2)
	require.Equal(t, []string{"without P2P", "with P2P"}, []string{arms[0].Arm, arms[1].Arm})
	for _, a := range arms {
		require.Equal(t, "fork-burst", a.Scenario)
		require.Positive(t, a.P50)
		require.LessOrEqual(t, a.P50, a.P90)
		require.LessOrEqual(t, a.P90, a.P99)
		require.Positive(t, a.Throughput)
	}
}

func TestBadFlagsAreRejected(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"unknown scenario", []string{"--scenarios", "nope"}, "unknown scenario"},
		{"negative rate", []string{"--rates", "8,-1"}, "not a positive number"},
		{"cost key", []string{"--fork-cost", "speed=3"}, "unknown cost key"},
		{"negative cost", []string{"--spill-cost", "linear=-1"}, "negative"},
		{"tiny cache", []string{"--gpu-blocks", "10"}, "must be at least"},
		{"bad algorithm", []string{"--algo", "md5", "--scenarios", "fork", "--plot=false"}, "unknown algorithm"},
		{"stray argument", []string{"extra"}, "unexpected argument"},
		{"study scale", []string{"--study-scale", "0"}, "--study-scale"},
		{"router restart after the run", []string{"--router-at", "99"}, "inside their runs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run(context.Background(), tc.args, &stdout, &stderr)
			require.NotEqual(t, 0, code)
			require.Contains(t, stderr.String(), tc.want)
		})
	}
}

func TestSharedResourceSplitsSpeedAmongJobs(t *testing.T) {
	var c clock
	s := shared{c: &c}
	var done []float64
	s.add(1, func() { done = append(done, c.now) })
	c.after(0.5, func() { s.add(0.25, func() { done = append(done, c.now) }) })
	for c.step() {
	}
	// Alone until 0.5 s (half the first job done), then both at half speed:
	// the second needs 0.5 s more, the first 0.25 s alone after that.
	require.InDeltaSlice(t, []float64{1.0, 1.25}, done, 1e-9)
}

func TestLRUEvictsLeastRecentlyUsed(t *testing.T) {
	l := newLRU(3)
	var ev []uint64
	for _, k := range []uint64{1, 2, 3} {
		ev = l.insert(k, ev)
	}
	require.True(t, l.touch(1))
	ev = l.insert(4, ev)
	ev = l.insert(5, ev)
	require.Equal(t, []uint64{2, 3}, ev)
	require.True(t, l.has(1))
	require.Equal(t, 3, l.len())
}

func TestPodEvictsPromptTailsFirstAndQueuesTheEvents(t *testing.T) {
	f := &fleet{blockSize: 1, spec: &runSpec{}}
	p := &pod{f: f, name: "p:1", gpu: newLRU(4), cpu: newLRU(100), pending: map[uint64]*landing{}}
	a := &request{prefix: &prompt{tokens: []uint32{1, 2, 3}}, eng: engineBlocks{keys: []uint64{10, 11, 12}}}
	b := &request{prefix: &prompt{tokens: []uint32{4, 5}}, eng: engineBlocks{keys: []uint64{20, 21}}}
	p.store(a, 0, 3, index.TierGPU)
	p.touch(a.eng.keys)
	p.store(b, 1, 2, index.TierGPU)
	p.store(b, 0, 2, index.TierGPU)
	// b's second block evicts nothing (room for 4); its first evicts one of
	// a's blocks: the tail, 12, not the head.
	require.True(t, p.gpu.has(10))
	require.True(t, p.gpu.has(11))
	require.False(t, p.gpu.has(12))
	var got []string
	for _, e := range p.out.Events {
		parent, hasParent := e.Parent.Get()
		got = append(got, fmt.Sprintf("%s %s %v parent=%v/%d tokens=%v", e.Type, e.Medium, e.BlockHashes, hasParent, parent, e.TokenIDs))
	}
	require.Equal(t, []string{
		"BlockStored GPU [10 11 12] parent=false/0 tokens=[1 2 3]",
		"BlockStored GPU [21] parent=true/20 tokens=[5]",
		"BlockRemoved GPU [12] parent=false/0 tokens=[]",
		"BlockStored GPU [20] parent=false/0 tokens=[4]",
	}, got)
}

func TestProgressBarAppearsOnlyOnLongRunsAndIsCleared(t *testing.T) {
	var buf bytes.Buffer
	quick := newProgress(&buf, 10, true)
	quick.add(10)
	quick.finish()
	require.Empty(t, buf.String(), "a replay shorter than the delay draws nothing")

	long := newProgress(&buf, 10, true)
	long.start = long.start.Add(-2 * delay)
	long.last = long.start
	long.add(5)
	require.Contains(t, buf.String(), "50%  5/10 requests")
	long.finish()
	require.True(t, strings.HasSuffix(buf.String(), "\r"+strings.Repeat(" ", 80)+"\r"), "the bar is cleared")

	buf.Reset()
	off := newProgress(&buf, 10, false)
	off.start = off.start.Add(-2 * delay)
	off.last = off.start
	off.add(5)
	off.finish()
	require.Empty(t, buf.String(), "--progress never draws nothing")
}

func TestQuantileInterpolates(t *testing.T) {
	s := []float64{1, 2, 3, 4, 5}
	require.Equal(t, 3.0, quantile(s, 0.5))
	require.InDelta(t, 4.6, quantile(s, 0.9), 1e-9)
	require.Equal(t, 5.0, quantile(s, 1))
	require.True(t, slices.IsSorted(s))
	require.True(t, strings.HasPrefix(humanBytes(3<<20), "3.0 MiB"))
}

func TestPodStoreNeverEvictsTheRunsOwnHeldBlocks(t *testing.T) {
	// The run [3, 7] holds 3 at the LRU tail: inserting 7 must evict 2, not
	// 3, or the pod would publish 3 removed and never store it again.
	f := &fleet{blockSize: 1, spec: &runSpec{}}
	p := &pod{f: f, name: "p:1", gpu: newLRU(3), cpu: newLRU(100), pending: map[uint64]*landing{}}
	a := &request{prefix: &prompt{tokens: []uint32{1, 2, 3}}, eng: engineBlocks{keys: []uint64{1, 2, 3}}}
	b := &request{prefix: &prompt{tokens: []uint32{3, 7}}, eng: engineBlocks{keys: []uint64{3, 7}}}
	p.store(a, 0, 3, index.TierGPU)
	p.out.Events = p.out.Events[:0]
	p.store(b, 0, 2, index.TierGPU)
	require.True(t, p.gpu.has(3))
	require.True(t, p.gpu.has(7))
	var got []string
	for _, e := range p.out.Events {
		got = append(got, fmt.Sprintf("%s %v", e.Type, e.BlockHashes))
	}
	require.Equal(t, []string{"BlockRemoved [2]", "BlockStored [7]"}, got)
}
