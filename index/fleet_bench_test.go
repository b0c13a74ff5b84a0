package index_test

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// Only the public API, so that the same benchmarks build against the index
// before issue 24 and after it, and old and new binaries can be alternated.

// fleetKey derives a child block's key from its parent's, as vLLM's chained
// hash does.
func fleetKey(parent uint64) uint64 {
	x := parent*0x9E3779B97F4A7C15 + 0x94D049BB133111EB
	x ^= x >> 31
	x *= 0xD6E8FEB86659FD93
	return x ^ x>>29
}

func fleetChain(root uint64, n int) []uint64 {
	keys := make([]uint64, n)
	k := root
	for i := range keys {
		if i > 0 {
			k = fleetKey(k)
		}
		keys[i] = k
	}
	return keys
}

// storeChain stores keys as an engine reports them: 16-block events, each
// naming the block before it as its parent.
func storeChain(ix *index.Index, h index.Holder, tier string, keys []uint64) {
	for j := 0; j < len(keys); j += 16 {
		b := index.Blocks{Model: "m", Holder: h, Tier: tier, Keys: keys[j:min(j+16, len(keys))]}
		if j > 0 {
			b.Parent = index.ParentKey(keys[j-1])
		}
		ix.Store(b)
	}
}

// lookupFleet is issue 24's fleet: background holders of one model, 100 to
// 1,000 blocks each, and the 64 holders of a 2,048-block prompt, holder i
// its first 32(i+1) blocks. With shared, every background chain starts with
// the prompt's first 32 blocks (a system prompt); without, it shares
// nothing with the prompt. A destination holds the prompt's first 8 blocks.
type lookupFleet struct {
	ix     *index.Index
	prompt []uint64
	dest   index.Holder
}

const (
	fleetPromptBlocks  = 2048
	fleetPromptHolders = 64
	fleetSystemBlocks  = 32
)

func newLookupFleet(background int, shared bool) *lookupFleet {
	rng := rand.New(rand.NewPCG(11, uint64(background)))
	f := &lookupFleet{
		ix:     index.New(index.Config{MaxHolderBlocks: -1}),
		prompt: fleetChain(rng.Uint64(), fleetPromptBlocks),
		dest:   index.Holder{Pod: "10.9.9.9:8000"},
	}
	for i := range background {
		h := index.Holder{Pod: fmt.Sprintf("10.%d.%d.%d:8000", 100+i/65536, i/256%256, i%256)}
		n := 100 + rng.IntN(901)
		keys := fleetChain(rng.Uint64(), n)
		if shared {
			copy(keys, f.prompt[:fleetSystemBlocks])
			keys = append(keys[:fleetSystemBlocks], fleetChain(fleetKey(keys[fleetSystemBlocks-1]^rng.Uint64()), n-fleetSystemBlocks)...)
		}
		storeChain(f.ix, h, index.TierGPU, keys)
	}
	for i := range fleetPromptHolders {
		h := index.Holder{Pod: fmt.Sprintf("10.1.0.%d:8000", i)}
		storeChain(f.ix, h, index.TierGPU, f.prompt[:fleetPromptBlocks*(i+1)/fleetPromptHolders])
	}
	storeChain(f.ix, f.dest, index.TierGPU, f.prompt[:8])
	return f
}

// BenchmarkLookupFleet is issue 24's measure of how lookups grow with the
// fleet: prompts of 64 and 2,048 blocks against 64, 1,000 and 10,000
// background holders of the same model (plus the prompt's 64 holders and
// the destination), which share nothing with the prompt (disjoint) or its
// first 32 blocks (system); per lookup (ns/lookup) and per picker.Pick
// (ns/pick). The index should cost about the same at every fleet size when
// disjoint, and grow at most linearly with the holders sharing the prompt's
// prefix when system.
func BenchmarkLookupFleet(b *testing.B) {
	for _, shared := range []bool{false, true} {
		kind := "disjoint"
		if shared {
			kind = "system"
		}
		for _, background := range []int{64, 1000, 10000} {
			var f *lookupFleet
			fleet := func() *lookupFleet {
				if f == nil {
					f = newLookupFleet(background, shared)
				}
				return f
			}
			for _, blocks := range []int{64, fleetPromptBlocks} {
				name := fmt.Sprintf("%s/holders-%d/prompt-%d", kind, background, blocks)
				b.Run(name+"/lookup", func(b *testing.B) {
					f := fleet()
					keys := f.prompt[:blocks]
					var res index.Result
					f.ix.Lookup("m", keys, &res)
					want := len(res.Hits)
					b.ReportAllocs()
					for b.Loop() {
						f.ix.Lookup("m", keys, &res)
					}
					b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/lookup")
					b.ReportMetric(float64(want), "hits")
					if len(res.Hits) != want {
						b.Fatalf("%d hits, then %d", want, len(res.Hits))
					}
				})
				b.Run(name+"/pick", func(b *testing.B) {
					f := fleet()
					p, err := picker.New(picker.Config{Index: f.ix, PullTiers: []string{index.TierGPU, index.TierCPU}})
					if err != nil {
						b.Fatal(err)
					}
					req := picker.Request{ID: "bench", Model: "m", Keys: f.prompt[:blocks], Destination: f.dest}
					b.ReportAllocs()
					for b.Loop() {
						d, err := p.Pick(req)
						if err != nil || d.Reason != picker.ReasonPull {
							b.Fatal(d.Reason, err)
						}
						d.Done()
					}
					b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/pick")
				})
			}
			f = nil
			runtime.GC()
		}
	}
}

// BenchmarkMemoryShared measures heap per holding for blocks every holder
// holds: 128 holders each holding the same 64 chains of 1,024 blocks, 8Mi
// holdings of 64Ki distinct blocks.
func BenchmarkMemoryShared(b *testing.B) {
	const holders, chains, length = 128, 64, 1024
	rng := rand.New(rand.NewPCG(13, 14))
	var all [][]uint64
	for range chains {
		all = append(all, fleetChain(rng.Uint64(), length))
	}
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		ix := index.New(index.Config{MaxHolderBlocks: -1})
		for i := range holders {
			h := index.Holder{Pod: fmt.Sprintf("10.4.0.%d:8000", i)}
			for _, keys := range all {
				storeChain(ix, h, index.TierGPU, keys)
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		live := ix.Stats().HolderBlocks
		if live != holders*chains*length {
			b.Fatalf("%d holdings", live)
		}
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(live), "bytes/holder-block")
		runtime.KeepAlive(ix)
	}
}

// BenchmarkSnapshot times SaveFile and LoadFile of 64 holders with 2Mi
// holdings in all, a quarter of them on CPU too, per holding.
func BenchmarkSnapshot(b *testing.B) {
	rng := rand.New(rand.NewPCG(15, 16))
	ix := index.New(index.Config{MaxHolderBlocks: -1})
	for i := range 64 {
		h := index.Holder{Pod: fmt.Sprintf("10.5.0.%d:8000", i)}
		for range 16 {
			keys := fleetChain(rng.Uint64(), 2048)
			storeChain(ix, h, index.TierGPU, keys)
			if rng.IntN(4) == 0 {
				storeChain(ix, h, index.TierCPU, keys)
			}
		}
	}
	live := float64(ix.Stats().HolderBlocks)
	path := filepath.Join(b.TempDir(), "index.snap")
	b.Run("save", func(b *testing.B) {
		for b.Loop() {
			if err := ix.SaveFile(path, nil); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/live, "ns/holder-block")
	})
	b.Run("load", func(b *testing.B) {
		if err := ix.SaveFile(path, nil); err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if _, _, err := index.LoadFile(path, index.Config{MaxHolderBlocks: -1}); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/live, "ns/holder-block")
	})
}
