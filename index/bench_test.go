package index

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvsource/kvsource/internal/cputime"
)

const (
	benchPromptBlocks = 2048
	benchHolders      = 64
)

// benchFleet is the lookup set-up: a 2,048-block prompt and 64
// holders, half of them holding a random-length prefix of it, the other
// half other chains of random length.
type benchFleet struct {
	ix      *Index
	prompt  []uint64
	holders []Holder
	keys    []uint64 // every key the index holds, for the map floor
}

func newBenchFleet() *benchFleet {
	rng := rand.New(rand.NewPCG(1, 2))
	f := &benchFleet{ix: New(Config{}), prompt: chain(rng.Uint64(), benchPromptBlocks)}
	seen := make(map[uint64]bool)
	for i := range benchHolders {
		h := Holder{Pod: fmt.Sprintf("10.1.%d.%d:8000", i/8, i%8)}
		f.holders = append(f.holders, h)
		keys := f.prompt[:1+rng.IntN(benchPromptBlocks)]
		if i%2 == 1 {
			keys = chain(rng.Uint64(), 1+rng.IntN(benchPromptBlocks))
		}
		for j := 0; j < len(keys); j += 16 {
			var parent uint64
			if j > 0 {
				parent = keys[j-1]
			}
			f.ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Parent: parentIf(j > 0, parent), Keys: keys[j:min(j+16, len(keys))]})
		}
		for _, k := range keys {
			if !seen[k] {
				seen[k] = true
				f.keys = append(f.keys, k)
			}
		}
	}
	return f
}

func BenchmarkLookup(b *testing.B) {
	f := newBenchFleet()
	var res Result
	f.ix.Lookup("m", f.prompt, &res)
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for b.Loop() {
		f.ix.Lookup("m", f.prompt, &res)
	}
	b.ReportMetric(float64(time.Since(start).Nanoseconds())/float64(b.N), "ns/lookup")
	if len(res.Hits) != benchHolders/2 {
		b.Fatalf("%d hits, want %d", len(res.Hits), benchHolders/2)
	}
}

// BenchmarkLookupMapFloor is the floor for a design that probes once per
// block: 2,048 probes of a plain map holding every key of the fleet.
func BenchmarkLookupMapFloor(b *testing.B) {
	f := newBenchFleet()
	m := make(map[uint64]uint64, len(f.keys))
	for i, k := range f.keys {
		m[k] = uint64(i)
	}
	var sink uint64
	b.ResetTimer()
	start := time.Now()
	for b.Loop() {
		for _, k := range f.prompt {
			sink += m[k]
		}
	}
	b.ReportMetric(float64(time.Since(start).Nanoseconds())/float64(b.N), "ns/lookup")
	if sink == 0 {
		b.Fatal("no probe hit")
	}
}

// BenchmarkLookupUnderIngest measures lookups while a writer stores and
// removes chains for the same holders, including the tails of the prompt's
// prefixes: flat out (as fast as one core can write, 10M writes/s and more,
// some 40 times what a fleet's events bring), and paced at 1M writes/s (4
// times the 258K blocks/s of the issue-14 load run).
//
// After each lookup it times a control: fixed arithmetic without memory
// accesses, as long as a median lookup. Its quantiles (p50-control-ns,
// p99-control-ns) are what the machine alone does to the tail of a task
// that long, in the same run; x-control-p99 is the lookups' p99 over the
// control's. ns/op counts a lookup and its control, about twice a lookup.
func BenchmarkLookupUnderIngest(b *testing.B) {
	b.Run("flat-out", func(b *testing.B) { benchLookupUnderIngest(b, 0) })
	b.Run("paced-1M", func(b *testing.B) { benchLookupUnderIngest(b, 1e6) })
}

// benchLookupUnderIngest runs the writer at rate writes/s, or flat out for 0.
func benchLookupUnderIngest(b *testing.B, rate float64) {
	f := newBenchFleet()
	var stop atomic.Bool
	var writes atomic.Int64
	var wg sync.WaitGroup
	began := time.Now()
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(3, 4))
		// A ring of stored chains, reused so that the writer does not
		// allocate: the index's own garbage is what lookups should feel.
		type stored struct {
			h    Holder
			keys []uint64
		}
		ring := make([]stored, 512)
		for i := range ring {
			ring[i].keys = make([]uint64, 64)
		}
		for n := 0; !stop.Load(); n++ {
			s := &ring[n%len(ring)]
			if n >= len(ring) {
				f.ix.Remove("m", s.h, TierGPU, 0, s.keys)
			}
			s.h = f.holders[rng.IntN(len(f.holders))]
			k := rng.Uint64()
			for j := range s.keys {
				s.keys[j] = k
				k = chainKey(k, 0)
			}
			f.ix.Store(Blocks{Model: "m", Holder: s.h, Tier: TierGPU, Keys: s.keys})
			// Engines evict and re-store prompt tails too.
			i := 2 * rng.IntN(len(f.holders)/2)
			tail := f.prompt[benchPromptBlocks-64:]
			f.ix.Remove("m", f.holders[i], TierGPU, 0, tail)
			f.ix.Store(Blocks{Model: "m", Holder: f.holders[i], Tier: TierCPU, Parent: ParentKey(f.prompt[benchPromptBlocks-65]), Keys: tail})
			w := writes.Add(4 * 64)
			if rate > 0 {
				if ahead := time.Duration(float64(w)/rate*1e9) - time.Since(began); ahead > 0 {
					time.Sleep(ahead)
				}
			}
		}
	})
	var res Result
	var lat, cpu, control latencies
	// The thread's CPU time per lookup leaves out the time the OS ran
	// other processes, which on a shared machine sets the wall-time tail.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	spins := controlSpins(f, &res)
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	b.ResetTimer()
	for b.Loop() {
		c0 := cputime.Thread()
		t0 := time.Now()
		f.ix.Lookup("m", f.prompt, &res)
		t1 := time.Now()
		lat.add(t1.Sub(t0))
		cpu.add(cputime.Thread() - c0)
		controlSink += controlWork(spins)
		control.add(time.Since(t1))
	}
	elapsed := time.Since(began)
	stop.Store(true)
	wg.Wait()
	runtime.ReadMemStats(&ms1)
	// Garbage per write and GC cycles per million writes: what the index
	// does to the GC, whatever the machine's load does to wall times.
	w := float64(writes.Load())
	b.ReportMetric(float64(ms1.TotalAlloc-ms0.TotalAlloc)/w, "alloc-B/write")
	b.ReportMetric(float64(ms1.NumGC-ms0.NumGC)/w*1e6, "gc/Mwrite")
	b.ReportMetric(float64(lat.quantile(0.5)), "p50-ns")
	b.ReportMetric(float64(lat.quantile(0.99)), "p99-ns")
	if cpu.quantile(0.5) > 0 {
		b.ReportMetric(float64(cpu.quantile(0.5)), "p50-cpu-ns")
		b.ReportMetric(float64(cpu.quantile(0.99)), "p99-cpu-ns")
	}
	b.ReportMetric(float64(writes.Load())/elapsed.Seconds(), "writes/s")
	b.ReportMetric(float64(control.quantile(0.5)), "p50-control-ns")
	b.ReportMetric(float64(control.quantile(0.99)), "p99-control-ns")
	b.ReportMetric(float64(lat.quantile(0.99))/float64(control.quantile(0.99)), "x-control-p99")
}

// controlWork is n dependent multiply-adds: work of a fixed length that
// touches no memory, so that only the machine varies its time.
func controlWork(n int) uint64 {
	x := uint64(n)
	for i := range n {
		x = x*0x9E3779B97F4A7C15 + uint64(i)
	}
	return x
}

var controlSink uint64

// controlSpins returns the n for which controlWork takes as long as a
// median lookup of f's prompt, both measured here with the writer running,
// after lookups as many as the measurement's to warm up the caches.
func controlSpins(f *benchFleet, res *Result) int {
	const probe, rounds = 4096, 2000
	for range rounds {
		f.ix.Lookup("m", f.prompt, res)
	}
	var look, spin latencies
	for range rounds {
		t0 := time.Now()
		f.ix.Lookup("m", f.prompt, res)
		t1 := time.Now()
		controlSink += controlWork(probe)
		look.add(t1.Sub(t0))
		spin.add(time.Since(t1))
	}
	return max(1, int(int64(probe)*look.quantile(0.5)/spin.quantile(0.5)))
}

// latencies is a histogram of durations: 16 ns buckets to 64 µs, 4 µs
// buckets to 16 ms. Unlike a slice of samples it does not grow while it
// records, so the measuring goroutine neither allocates (which brought GC
// cycles into the figure it measures) nor copies megabytes between lookups.
type latencies struct {
	n       int
	buckets [8192]int
}

func (l *latencies) add(d time.Duration) {
	ns := max(d.Nanoseconds(), 0)
	i := ns >> 4
	if ns >= 1<<16 {
		i = min(4096+(ns>>12)-16, int64(len(l.buckets)-1))
	}
	l.buckets[i]++
	l.n++
}

// quantile returns the upper bound in ns of the bucket holding quantile q.
func (l *latencies) quantile(q float64) int64 {
	want := int(q * float64(l.n))
	seen := 0
	for i, c := range l.buckets {
		seen += c
		if seen > want {
			if i < 4096 {
				return int64(i+1) << 4
			}
			return int64(i-4096+17) << 12
		}
	}
	return 0
}

// BenchmarkAdd measures stores per second on one goroutine, in 16-block
// chained batches as engines report them:
//   - pod: one holder with a 64Ki-block cache, storing 256-block chains
//     and, past 64Ki blocks, removing its oldest chain leaf first, as vLLM
//     evicts: one event worker's load;
//   - fleet: the same for 64 holders in turn, 4Mi holdings, so that tables
//     no longer fit in the CPU caches;
//   - evict: 64 holders without removals, so their 64Ki capacity evicts
//     their oldest blocks, parents first;
//   - fleet-parallel: fleet with one writer goroutine per GOMAXPROCS, each
//     with its own holders, as the events package runs one per holder;
//   - fleet-shared-prefix: fleet-parallel where every chain continues a
//     32-block system prompt all 64 holders hold, shared in the layer
//     (64 holders is the default share threshold). Its holders' own
//     blocks are in their tables, so -cpu 1,2 should scale as
//     fleet-parallel does.
func BenchmarkAdd(b *testing.B) {
	b.Run("fleet-parallel", func(b *testing.B) { benchAddParallel(b, 0) })
	b.Run("fleet-shared-prefix", func(b *testing.B) { benchAddParallel(b, 32) })
	cases := []struct {
		name     string
		holders  int
		capacity int
		remove   bool
	}{
		{"pod", 1, 0, true},
		{"fleet", 64, 0, true},
		{"evict", 64, 1 << 16, false},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			const batch, chainLen, limit = 16, 256, 1 << 16
			ix := New(Config{HolderCapacity: tc.capacity, MaxHolderBlocks: -1})
			rng := rand.New(rand.NewPCG(5, 6))
			type holderLoad struct {
				h      Holder
				chains [][]uint64 // oldest first
				cur    []uint64
				off    int
				blocks int
			}
			hl := make([]*holderLoad, tc.holders)
			for i := range hl {
				hl[i] = &holderLoad{h: Holder{Pod: fmt.Sprintf("10.3.0.%d:8000", i)}}
			}
			// Keys are made ahead so the loop measures the index alone.
			pool := make([][]uint64, 4096)
			for i := range pool {
				pool[i] = chain(rng.Uint64(), chainLen)
			}
			next := 0
			start, cpu0 := time.Now(), cputime.Process()
			stored := 0
			for i := 0; b.Loop(); i++ {
				l := hl[i%len(hl)]
				if l.off == len(l.cur) {
					// Pool chains are salted so that keys stay unique.
					src := pool[next%len(pool)]
					next++
					salt := rng.Uint64()
					l.cur = make([]uint64, len(src))
					for j, k := range src {
						l.cur[j] = k ^ salt
					}
					l.off = 0
					l.chains = append(l.chains, l.cur)
				}
				var parent uint64
				if l.off > 0 {
					parent = l.cur[l.off-1]
				}
				ix.Store(Blocks{Model: "m", Holder: l.h, Tier: TierGPU, Parent: parentIf(l.off > 0, parent), Keys: l.cur[l.off : l.off+batch]})
				l.off += batch
				l.blocks += batch
				stored += batch
				if tc.remove && l.blocks > limit {
					// vLLM frees a request's blocks tail first, so it evicts
					// and reports them leaf first.
					old := l.chains[0]
					slices.Reverse(old)
					for j := 0; j < len(old); j += batch {
						ix.Remove("m", l.h, TierGPU, 0, old[j:j+batch])
					}
					l.chains = l.chains[1:]
					l.blocks -= len(old)
				} else if !tc.remove && len(l.chains) > limit/chainLen+1 {
					l.chains = l.chains[1:]
				}
			}
			b.ReportMetric(float64(stored)/time.Since(start).Seconds(), "blocks/s")
			if cpu := cputime.Process() - cpu0; cpu > 0 {
				b.ReportMetric(float64(stored)/cpu.Seconds(), "blocks/cpu-s")
			}
		})
	}
}

// benchAddParallel is BenchmarkAdd's fleet with GOMAXPROCS writers, each
// storing for its own share of the 64 holders, their chains continuing a
// system prompt of prompt blocks (none for 0) that every holder holds.
func benchAddParallel(b *testing.B, prompt int) {
	const holders, batch, chainLen, limit = 64, 16, 256, 1 << 16
	ix := New(Config{MaxHolderBlocks: -1})
	sys := chain(0x5157, prompt)
	hs := make([]Holder, holders)
	for i := range hs {
		hs[i] = Holder{Pod: fmt.Sprintf("10.3.1.%d:8000", i)}
		for j := 0; j < prompt; j += batch {
			ix.Store(Blocks{Model: "m", Holder: hs[i], Tier: TierGPU, Parent: parentIf(j > 0, sys[max(j-1, 0)]), Keys: sys[j:min(j+batch, prompt)]})
		}
	}
	if got := ix.Stats().SharedBlocks; got != int64(prompt) {
		b.Fatalf("%d shared blocks, want the %d of the system prompt", got, prompt)
	}
	pool := make([][]uint64, 4096)
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range pool {
		pool[i] = chain(rng.Uint64(), chainLen)
	}
	workers := runtime.GOMAXPROCS(0)
	if workers > holders {
		b.Skipf("%d writers for %d holders", workers, holders)
	}
	var worker atomic.Int64
	var stored atomic.Int64
	start, cpu0 := time.Now(), cputime.Process()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		w := int(worker.Add(1) - 1)
		type holderLoad struct {
			h      Holder
			chains [][]uint64 // oldest first
			cur    []uint64
			off    int
			blocks int
		}
		var mine []*holderLoad
		for i := w % workers; i < holders; i += workers {
			mine = append(mine, &holderLoad{h: hs[i]})
		}
		rng := rand.New(rand.NewPCG(uint64(w), 7))
		n := 0
		for i := 0; pb.Next(); i++ {
			l := mine[i%len(mine)]
			if l.off == len(l.cur) {
				// Pool chains are salted so that keys stay unique.
				src := pool[rng.IntN(len(pool))]
				salt := rng.Uint64()
				l.cur = make([]uint64, len(src))
				for j, k := range src {
					l.cur[j] = k ^ salt
				}
				l.off = 0
				l.chains = append(l.chains, l.cur)
			}
			parent := Parent{}
			switch {
			case l.off > 0:
				parent = ParentKey(l.cur[l.off-1])
			case prompt > 0:
				parent = ParentKey(sys[prompt-1])
			}
			ix.Store(Blocks{Model: "m", Holder: l.h, Tier: TierGPU, Parent: parent, Keys: l.cur[l.off : l.off+batch]})
			l.off += batch
			l.blocks += batch
			n += batch
			if l.blocks > limit {
				// Leaf first, as vLLM frees a request's blocks; the
				// system prompt stays.
				old := l.chains[0]
				slices.Reverse(old)
				for j := 0; j < len(old); j += batch {
					ix.Remove("m", l.h, TierGPU, 0, old[j:j+batch])
				}
				l.chains = l.chains[1:]
				l.blocks -= len(old)
			}
		}
		stored.Add(int64(n))
	})
	b.StopTimer()
	b.ReportMetric(float64(stored.Load())/time.Since(start).Seconds(), "blocks/s")
	if cpu := cputime.Process() - cpu0; cpu > 0 {
		b.ReportMetric(float64(stored.Load())/cpu.Seconds(), "blocks/cpu-s")
	}
	if got := ix.Stats().SharedBlocks; got != int64(prompt) {
		b.Fatalf("%d shared blocks after the run, want %d", got, prompt)
	}
}

// BenchmarkMemory measures heap per holding with 10M holdings: 64 holders,
// each with its own chains of up to 2,048 blocks, on the GPU and a quarter
// of them on CPU too. "grown" stores them; "steady" then replaces every
// holding once, oldest chains removed leaf first, as holders at their
// cache size do.
func BenchmarkMemory(b *testing.B) {
	const total = 10_000_000
	for _, steady := range []bool{false, true} {
		name := "grown"
		if steady {
			name = "steady"
		}
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				ix := New(Config{MaxHolderBlocks: -1})
				rng := rand.New(rand.NewPCG(7, 8))
				type stored struct {
					h    Holder
					tier string
					keys []uint64
				}
				var fifo []stored
				n, churned := 0, 0
				for n < total || steady && churned < total {
					h := Holder{Pod: fmt.Sprintf("10.2.0.%d:8000", rng.IntN(benchHolders))}
					keys := chain(rng.Uint64(), 1+rng.IntN(benchPromptBlocks))
					if n < total && len(keys) > total-n {
						keys = keys[:total-n]
					}
					tier := TierGPU
					if rng.IntN(4) == 0 {
						tier = TierCPU
					}
					ix.Store(Blocks{Model: "m", Holder: h, Tier: tier, Keys: keys})
					n += len(keys)
					if steady {
						fifo = append(fifo, stored{h, tier, keys})
						for n > total {
							old := fifo[0]
							fifo = fifo[1:]
							slices.Reverse(old.keys)
							ix.Remove("m", old.h, old.tier, 0, old.keys)
							n -= len(old.keys)
							churned += len(old.keys)
						}
					}
				}
				fifo = nil
				runtime.GC()
				runtime.ReadMemStats(&after)
				live := ix.Stats().HolderBlocks
				if live != int64(n) {
					b.Fatalf("%d holdings, want %d", live, n)
				}
				b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(live), "bytes/holder-block")
				runtime.KeepAlive(ix)
			}
		})
	}
}
