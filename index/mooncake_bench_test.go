package index_test

import (
	"fmt"
	"math"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/cputime"
	"github.com/kvsource/kvsource/internal/mooncake"
	"github.com/kvsource/kvsource/internal/testenv"
)

// The Mooncake benchmarks measure the index by the method of NVIDIA
// Dynamo's mooncake_bench, whose figures (lib/kv-router/BENCH_SETUP.md)
// they can be set beside: the conversation trace of Mooncake's FAST'25
// release spread over 1,000 mock vLLM engines, replicated 7 times (-d 7:
// 7,000 workers, each replaying its engine's timeline under its own
// holder), Stored events applied by 8 event threads, find_matches (here
// Lookup) timed as the trace's requests come. internal/mooncake builds the
// workload and checks it against Dynamo's counts.

const (
	mooncakeReplicas     = 7 // -d 7
	mooncakeEventThreads = 8 // --num-event-workers 8
	mooncakeModel        = "mooncake"
	mooncakeWindowMS     = 30000 // --benchmark-duration-ms
)

// mooncakeLoad is the benchmark's input, generated once per process (it
// takes about a second) and shared by the sub-benchmarks.
type mooncakeLoad struct {
	workers []mooncake.Worker
	totals  mooncake.Totals
	holders []index.Holder // worker w of replica r is holders[r*len(workers)+w]
}

var (
	mooncakeMu    sync.Mutex
	mooncakeCache *mooncakeLoad
)

func loadMooncake(b *testing.B) *mooncakeLoad {
	b.Helper()
	path := testenv.MooncakeTrace(b)
	mooncakeMu.Lock()
	defer mooncakeMu.Unlock()
	if mooncakeCache != nil {
		return mooncakeCache
	}
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	recs, err := mooncake.Read(f)
	if err != nil {
		b.Fatal(err)
	}
	workers, err := mooncake.Generate(recs, mooncake.DynamoConfig())
	if err != nil {
		b.Fatal(err)
	}
	ld := &mooncakeLoad{workers: workers, totals: mooncake.Count(workers)}
	for w := range mooncakeReplicas * len(workers) {
		ld.holders = append(ld.holders, index.Holder{Pod: fmt.Sprintf("10.%d.%d.%d:8000", 1+w>>16, w>>8&255, w&255)})
	}
	mooncakeCache = ld
	return ld
}

// apply applies one event as a router applies an engine's KV event.
func mooncakeApply(ix *index.Index, h index.Holder, ev *mooncake.Event) {
	switch ev.Kind {
	case mooncake.EventStored:
		b := index.Blocks{Model: mooncakeModel, Holder: h, Tier: index.TierGPU, Keys: ev.Keys}
		if ev.HasParent {
			b.Parent = index.ParentKey(ev.Parent)
		}
		ix.Store(b)
	case mooncake.EventRemoved:
		ix.Remove(mooncakeModel, h, index.TierGPU, 0, ev.Keys)
	}
}

// mooncakeQueue is one event thread's unbounded queue (Dynamo's unbounded
// flume channel): a worker never waits to hand an event over.
type mooncakeQueue struct {
	mu     sync.Mutex
	items  []mooncakeItem
	closed bool
	wake   chan struct{}
}

type mooncakeItem struct {
	holder int
	ev     *mooncake.Event
}

func (q *mooncakeQueue) push(it mooncakeItem) {
	q.mu.Lock()
	q.items = append(q.items, it)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *mooncakeQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// drain applies the queue's events until it is closed and empty, and
// returns the thread CPU it took: the goroutine keeps its OS thread, as
// Dynamo's event workers are OS threads, so the thread's clock is its own.
func (q *mooncakeQueue) drain(ix *index.Index, holders []index.Holder) time.Duration {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cpu0 := cputime.Thread()
	var batch []mooncakeItem
	for {
		q.mu.Lock()
		batch, q.items = q.items, batch[:0]
		closed := q.closed
		q.mu.Unlock()
		for _, it := range batch {
			mooncakeApply(ix, holders[it.holder], it.ev)
		}
		if len(batch) == 0 {
			if closed {
				return cputime.Thread() - cpu0
			}
			<-q.wake
		}
	}
}

// mooncakeResult is one run's measure, with Dynamo's rules: total is from
// the start to the last worker's end (not the event queues' drain), p99 is
// the sorted latencies at len×99/100.
type mooncakeResult struct {
	windowMS      uint64
	ops, blocks   int
	finds, events int
	total         time.Duration
	latencies     []time.Duration // sorted
	findCPU       time.Duration
	eventCPU      time.Duration
}

func (r *mooncakeResult) offered() float64 { return float64(r.ops) / float64(r.windowMS) * 1000 }
func (r *mooncakeResult) achieved() float64 {
	return float64(r.ops) / float64(r.total.Milliseconds()) * 1000
}
func (r *mooncakeResult) offeredBlocks() float64 {
	return float64(r.blocks) / float64(r.windowMS) * 1000
}
func (r *mooncakeResult) achievedBlocks() float64 {
	return float64(r.blocks) / float64(r.total.Milliseconds()) * 1000
}
func (r *mooncakeResult) keptUp() bool {
	return r.total <= time.Duration(r.windowMS*11/10)*time.Millisecond
}
func (r *mooncakeResult) quantileUS(num, den int) float64 {
	return float64(r.latencies[len(r.latencies)*num/den].Nanoseconds()) / 1e3
}

func (r *mooncakeResult) report(b *testing.B) {
	b.ReportMetric(r.achieved(), "ops/s")
	b.ReportMetric(r.offered(), "offered-ops/s")
	b.ReportMetric(r.quantileUS(1, 2), "p50-find-us")
	b.ReportMetric(r.quantileUS(99, 100), "p99-find-us")
	if r.eventCPU > 0 {
		b.ReportMetric(float64(r.findCPU.Nanoseconds())/1e3/float64(r.finds), "cpu-us/find")
		b.ReportMetric(float64(r.eventCPU.Nanoseconds())/1e3/float64(r.events), "cpu-us/event")
	}
	kept := 0.0
	if r.keptUp() {
		kept = 1
	} else {
		b.Logf("WARNING: unable to keep up with the %d ms window: took %v", r.windowMS, r.total.Round(time.Millisecond))
	}
	b.ReportMetric(kept, "kept-up")
}

// mooncakeWorker is one worker's replay: its timeline, where it is in it,
// and its clock (Dynamo's task state).
type mooncakeWorker struct {
	id      int
	tl      []mooncake.Entry
	next    int
	started bool
	target  time.Duration // since the release: when the next entry is due
	seq     uint64        // order of scheduling, among equal targets
	queue   *mooncakeQueue
	lat     []time.Duration
}

// mooncakeSchedule is the workers waiting for their next entry, earliest
// first, and the runners' shared state.
type mooncakeSchedule struct {
	mu       sync.Mutex
	cond     *sync.Cond
	due      []*mooncakeWorker // a heap by target, then seq
	seq      uint64
	inflight int
	kick     chan struct{} // a sleeping runner's wake-up: an earlier worker is due
}

func (s *mooncakeSchedule) before(i, j int) bool {
	a, b := s.due[i], s.due[j]
	return a.target < b.target || (a.target == b.target && a.seq < b.seq)
}

func (s *mooncakeSchedule) push(w *mooncakeWorker) {
	s.seq++
	w.seq = s.seq
	s.due = append(s.due, w)
	i := len(s.due) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !s.before(i, p) {
			break
		}
		s.due[p], s.due[i] = s.due[i], s.due[p]
		i = p
	}
	if i == 0 {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
}

func (s *mooncakeSchedule) pop() *mooncakeWorker {
	top := s.due[0]
	last := len(s.due) - 1
	s.due[0] = s.due[last]
	s.due = s.due[:last]
	for i := 0; ; {
		l, r, m := 2*i+1, 2*i+2, i
		if l < last && s.before(l, m) {
			m = l
		}
		if r < last && s.before(r, m) {
			m = r
		}
		if m == i {
			break
		}
		s.due[m], s.due[i] = s.due[i], s.due[m]
		i = m
	}
	return top
}

// runMooncake is run_benchmark on a fresh index: 7,000 workers, each
// replaying its engine's timeline stretched to windowMS. A worker starts
// its clock when it first runs after the release, submits an entry and
// every following one of the same time, and waits for the next entry's
// time only when that is still ahead: one that has fallen behind runs on
// without yielding, as a tokio task that does not reach sleep_until does.
// A request is a Lookup, timed around the call where it runs; an event
// goes to one of 8 event threads, the worker's for good from its first
// event on, assigned round-robin in order of first events.
//
// The workers are run by one runner goroutine per core (GOMAXPROCS), each
// taking the worker whose next entry is due first: what tokio's
// multi-thread runtime (a thread per core) does with Dynamo's 7,000 tasks.
// Not a goroutine per worker: on 2 cores Go preempts a Lookup that runs
// past 10 ms and queues it behind every runnable goroutine, so its timed
// latency took in thousands of other workers' turns (p99 9.6 s and 58 s
// for two runs of the 30 s window), where a tokio task is never preempted.
//
// CPU: the event threads' is their thread CPU; a find's is the process CPU
// from the release to the queues' drain less the event threads', over the
// finds. So cpu-us/find also carries what the replay itself costs (its
// scheduling and sleeps, the garbage collector's background work): an
// upper bound, close to the finds' cost when they are slow.
func runMooncake(ld *mooncakeLoad, windowMS uint64) *mooncakeResult {
	n := len(ld.workers)
	timelines := make([][]mooncake.Entry, n)
	for w := range ld.workers {
		timelines[w] = ld.workers[w].Timeline(windowMS)
	}
	ix := index.New(index.Config{})
	queues := make([]*mooncakeQueue, mooncakeEventThreads)
	cpus := make([]time.Duration, mooncakeEventThreads)
	var drained sync.WaitGroup
	for i := range queues {
		queues[i] = &mooncakeQueue{wake: make(chan struct{}, 1)}
		drained.Go(func() { cpus[i] = queues[i].drain(ix, ld.holders) })
	}
	runners := runtime.GOMAXPROCS(0)
	s := &mooncakeSchedule{kick: make(chan struct{}, runners)}
	s.cond = sync.NewCond(&s.mu)
	workers := make([]*mooncakeWorker, 0, mooncakeReplicas*n)
	for replica := range mooncakeReplicas {
		for w, tl := range timelines {
			mw := &mooncakeWorker{id: replica*n + w, tl: tl, lat: make([]time.Duration, 0, len(ld.workers[w].Requests))}
			workers = append(workers, mw)
			if len(tl) > 0 {
				s.push(mw)
			}
		}
	}
	var assigned atomic.Uint64
	runtime.GC()
	cpu0 := cputime.Process()
	start := time.Now()
	// run replays w from its next entry until it is ahead of its clock or
	// done, and says whether it has entries left.
	run := func(w *mooncakeWorker, res *index.Result) bool {
		if !w.started {
			w.started, w.target = true, time.Since(start)
		}
		for {
			ts := w.tl[w.next].TimestampUS
			for ; w.next < len(w.tl) && w.tl[w.next].TimestampUS == ts; w.next++ {
				if r := w.tl[w.next].Request; r != nil {
					t0 := time.Now()
					ix.Lookup(mooncakeModel, r.Keys, res)
					w.lat = append(w.lat, time.Since(t0))
					continue
				}
				if w.queue == nil {
					w.queue = queues[(assigned.Add(1)-1)%mooncakeEventThreads]
				}
				w.queue.push(mooncakeItem{holder: w.id, ev: w.tl[w.next].Event})
			}
			if w.next == len(w.tl) {
				return false
			}
			w.target += time.Duration(w.tl[w.next].TimestampUS-ts) * time.Microsecond
			if w.target > time.Since(start) {
				return true
			}
		}
	}
	var done sync.WaitGroup
	for range runners {
		done.Go(func() {
			var res index.Result
			timer := time.NewTimer(time.Hour)
			timer.Stop()
			s.mu.Lock()
			defer s.mu.Unlock()
			for {
				for len(s.due) == 0 && s.inflight > 0 {
					s.cond.Wait()
				}
				if len(s.due) == 0 {
					s.cond.Broadcast()
					return
				}
				if wait := s.due[0].target - time.Since(start); wait > 0 {
					s.mu.Unlock()
					timer.Reset(wait)
					select {
					case <-timer.C:
					case <-s.kick:
						timer.Stop()
					}
					s.mu.Lock()
					continue
				}
				w := s.pop()
				s.inflight++
				s.mu.Unlock()
				more := run(w, &res)
				s.mu.Lock()
				s.inflight--
				if more {
					s.push(w)
				}
				s.cond.Broadcast()
			}
		})
	}
	done.Wait()
	total := time.Since(start)
	for _, q := range queues {
		q.close()
	}
	drained.Wait()
	cpu := cputime.Process() - cpu0

	r := &mooncakeResult{
		windowMS: windowMS,
		ops:      mooncakeReplicas * ld.totals.Ops(),
		blocks:   mooncakeReplicas * ld.totals.Blocks(),
		finds:    mooncakeReplicas * ld.totals.Requests,
		events:   mooncakeReplicas * ld.totals.Events(),
		total:    total,
	}
	for _, w := range workers {
		r.latencies = append(r.latencies, w.lat...)
	}
	slices.Sort(r.latencies)
	for _, c := range cpus {
		r.eventCPU += c
	}
	r.findCPU = cpu - r.eventCPU
	runtime.KeepAlive(ix)
	return r
}

// mooncakeSweepDurations is compute_sweep_durations: steps windows from
// maxMS down to minMS, evenly spaced in log scale, rounded to the ms.
func mooncakeSweepDurations(minMS, maxMS float64, steps int) []uint64 {
	out := make([]uint64, steps)
	for i := range out {
		t := float64(i) / float64(steps-1)
		out[i] = uint64(math.Round(math.Exp(math.Log(maxMS)*(1-t) + math.Log(minMS)*t)))
	}
	return out
}

// BenchmarkMooncake is Dynamo's mooncake_bench run of its published tables
// (--trace-simulation-duration-ms 10000 --benchmark-duration-ms 30000 -d 7,
// 8 event threads) on the index: window-30s is the 30 s window (11,861
// ops/s offered), sweep the throughput sweep, windows from 30 s down to
// 1 s (compute_sweep_durations(1000, 30000, 8)), longest first, each on a
// fresh index, stopping after 5 steps in a row whose achieved block
// throughput is at least 95% of the offered. Dynamo's peak is the highest
// achieved ops/s of a step that kept up (finished within 1.1 × window);
// each step logs it with the sweep's table so far.
//
// Each step runs at least its window (30 s and more): go test -bench
// Mooncake -benchtime 1x. Without the trace (see testenv.MooncakeTrace) it
// is skipped.
func BenchmarkMooncake(b *testing.B) {
	ld := loadMooncake(b)
	b.Run("window-30s", func(b *testing.B) {
		var r *mooncakeResult
		for b.Loop() {
			r = runMooncake(ld, mooncakeWindowMS)
		}
		r.report(b)
	})
	b.Run("sweep", func(b *testing.B) {
		var steps []*mooncakeResult
		inRow := 0
		for _, ms := range mooncakeSweepDurations(1000, 30000, 8) {
			var r *mooncakeResult
			b.Run(fmt.Sprintf("window-%dms", ms), func(b *testing.B) {
				for b.Loop() {
					r = runMooncake(ld, ms)
				}
				r.report(b)
				// The parent's log is not printed: each step logs the
				// sweep so far.
				steps = append(steps, r)
				b.Log(mooncakeSweepTable(steps))
			})
			if r == nil { // filtered out by -bench
				continue
			}
			if r.achievedBlocks() >= 0.95*r.offeredBlocks() {
				inRow++
			} else {
				inRow = 0
			}
			if inRow >= 5 {
				break
			}
		}
	})
}

// mooncakeSweepTable is print_sweep_summary's table, with the peak.
func mooncakeSweepTable(steps []*mooncakeResult) string {
	var s strings.Builder
	fmt.Fprintf(&s, "\n%12s %14s %14s %14s %14s %10s %8s\n", "duration_ms", "ops/s_off", "ops/s", "blk_ops/s_off", "blk_ops/s", "p99(us)", "kept_up")
	var peak *mooncakeResult
	for _, r := range steps {
		fmt.Fprintf(&s, "%12d %14.1f %14.1f %14.1f %14.1f %10.1f %8t\n", r.windowMS, r.offered(), r.achieved(), r.offeredBlocks(), r.achievedBlocks(), r.quantileUS(99, 100), r.keptUp())
		if r.keptUp() && (peak == nil || r.achieved() > peak.achieved()) {
			peak = r
		}
	}
	if peak == nil {
		s.WriteString("peak: no step kept up")
	} else {
		fmt.Fprintf(&s, "peak: %.1f ops/s (p99 %.1f us) at %d ms", peak.achieved(), peak.quantileUS(99, 100), peak.windowMS)
	}
	return s.String()
}

// BenchmarkMooncakeFind times single Lookups of the trace's prompts, one
// after another on one goroutine, against the index of the whole workload
// (every event of the 7,000 workers applied): an iteration is one find of
// each of the 12,031 prompts, in trace order. It reports the mean wall time
// and thread CPU of a find, their p50 and p99, and the index's heap per
// holding (heap growth over building it, per Stats().HolderBlocks).
func BenchmarkMooncakeFind(b *testing.B) {
	ld := loadMooncake(b)
	n := len(ld.workers)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ix := index.New(index.Config{})
	for replica := range mooncakeReplicas {
		for w := range ld.workers {
			for i := range ld.workers[w].Events {
				mooncakeApply(ix, ld.holders[replica*n+w], &ld.workers[w].Events[i])
			}
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	st := ix.Stats()
	if want := int64(mooncakeReplicas * ld.totals.StoredBlocks); st.HolderBlocks != want {
		b.Fatalf("%d holdings, want %d", st.HolderBlocks, want)
	}
	var prompts [][]uint64
	for _, w := range ld.workers {
		for _, r := range w.Requests {
			prompts = append(prompts, r.Keys)
		}
	}
	wall := make([]time.Duration, 0, len(prompts))
	cpu := make([]time.Duration, 0, len(prompts))
	var res index.Result
	hits := 0
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	b.ReportAllocs()
	for b.Loop() {
		wall, cpu, hits = wall[:0], cpu[:0], 0
		for _, keys := range prompts {
			c0, t0 := cputime.Thread(), time.Now()
			ix.Lookup(mooncakeModel, keys, &res)
			wall = append(wall, time.Since(t0))
			cpu = append(cpu, cputime.Thread()-c0)
			hits += len(res.Hits)
		}
	}
	finds := float64(b.N * len(prompts))
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	b.ReportMetric(us(b.Elapsed())/finds, "us/find")
	var sum time.Duration
	for _, c := range cpu {
		sum += c
	}
	if sum > 0 {
		b.ReportMetric(us(sum)/float64(len(cpu)), "cpu-us/find")
	}
	slices.Sort(wall)
	b.ReportMetric(us(wall[len(wall)/2]), "p50-find-us")
	b.ReportMetric(us(wall[len(wall)*99/100]), "p99-find-us")
	b.ReportMetric(float64(hits)/float64(len(prompts)), "hits/find")
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(st.HolderBlocks), "bytes/holder-block")
	b.ReportMetric(float64(st.HolderBlocks), "holder-blocks")
	runtime.KeepAlive(ix)
}
