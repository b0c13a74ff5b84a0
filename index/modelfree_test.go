package index

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// A model's state goes with its last holder: names a peer made up and
// dropped (a new one per message cost 9 KiB each, for good) leave
// nothing, and a store under the name later starts afresh.
func TestAModelNobodyHoldsIsFreed(t *testing.T) {
	for _, shared := range []bool{false, true} { // true: a second holder of m's blocks
		t.Run(fmt.Sprintf("shared %v", shared), func(t *testing.T) {
			ix := New(Config{})
			a, b := Holder{Pod: "10.0.0.1:8000"}, Holder{Pod: "10.0.0.2:8000"}
			keys := chain(1, 8)
			ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: keys})
			if shared {
				ix.Store(Blocks{Model: "m", Holder: b, Tier: TierGPU, Keys: keys})
			} else {
				ix.Store(Blocks{Model: "m", Holder: b, Tier: TierGPU, Keys: chain(2, 8)})
			}
			const names = 2000
			for i := range names {
				ix.Store(Blocks{Model: fmt.Sprintf("made-up-%d", i), Holder: b, Tier: TierGPU, Keys: keys[:1]})
			}
			require.Equal(t, names+1, ix.models.Size())
			ix.RemoveHolder(b)
			require.Equal(t, []string{"m"}, ix.Models(nil))
			require.Equal(t, 1, ix.models.Size(), "the models only b held are freed")
			require.Equal(t, int64(modelStateBytes+1), ix.modelBytes.Load())

			ix.RemoveHolder(a)
			require.Zero(t, ix.models.Size())
			require.Zero(t, ix.modelBytes.Load())
			st := ix.Stats()
			require.Zero(t, st.HolderBlocks)
			require.Zero(t, st.SharedBlocks)

			ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: keys})
			var res Result
			ix.Lookup("m", keys, &res)
			require.Equal(t, []Hit{{Holder: a, Prefix: 8, Tiers: []TierPrefix{{TierGPU, 8}}}}, res.Hits)
		})
	}
}

// A store racing the removal of its model's last holder lands in a model
// state that is kept, never in the one being freed.
func TestAStoreRacingTheRemovalOfAModelsLastHolderIsKept(t *testing.T) {
	ix := New(Config{})
	kept, gone := Holder{Pod: "10.0.0.1:8000"}, Holder{Pod: "10.0.0.2:8000"}
	var res Result
	for i := range 2000 {
		model := fmt.Sprintf("m-%d", i)
		ix.Store(Blocks{Model: model, Holder: gone, Tier: TierGPU, Keys: []uint64{1}})
		var wg sync.WaitGroup
		wg.Go(func() { ix.Store(Blocks{Model: model, Holder: kept, Tier: TierGPU, Keys: []uint64{2}}) })
		wg.Go(func() { ix.RemoveHolder(gone) })
		wg.Wait()
		ix.Lookup(model, []uint64{2}, &res)
		require.NotNil(t, res.Holder(kept), "model %s: the store was lost with the freed state", model)
	}
	require.Equal(t, 2000, ix.models.Size())
}

// Model states count in MemoryBytes: an index holding many models' states
// stays within its bound, evicting holdings to make room for them, and
// modelStateBytes covers what a model's state costs the heap.
func TestModelStatesCountInTheMemoryBudget(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's allocations are not the heap this measures")
	}
	heap := func() int64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return int64(m.HeapAlloc)
	}
	name := strings.Repeat("m", 490)
	const budget = 32 << 20
	const models = 2000 // about 19 MiB of model states
	before := heap()
	ix := New(Config{MemoryBytes: budget})
	h := Holder{Pod: "10.0.0.1:8000"}
	for i := range models {
		ix.Store(Blocks{Model: fmt.Sprintf("%s-%04d", name, i), Holder: h, Tier: TierGPU, Keys: []uint64{uint64(i + 1)}})
	}
	perModel := (heap() - before) / models
	t.Logf("a model's state with one holder of one block: %d heap bytes; modelStateBytes %d, name %d", perModel, modelStateBytes, len(name)+5)
	require.LessOrEqual(t, perModel, int64(modelStateBytes+len(name)+5)+2<<10, "modelStateBytes undercounts a model's state")

	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]uint64, 1024)
	for stored := int64(0); stored < 2*ix.Budget(); stored += int64(len(keys)) {
		for i := range keys {
			keys[i] = rng.Uint64()
		}
		ix.Store(Blocks{Model: "big", Holder: Holder{Pod: fmt.Sprintf("10.0.1.%d:8000", rng.IntN(8))}, Tier: TierGPU, Keys: keys})
	}
	grew := heap() - before
	st := ix.Stats()
	t.Logf("%d models and %d holdings: heap %d bytes of a %d-byte bound", st.Models, st.HolderBlocks, grew, budget)
	require.NotZero(t, st.EvictedBudget)
	require.LessOrEqual(t, grew, int64(budget))
	runtime.KeepAlive(ix)
}
