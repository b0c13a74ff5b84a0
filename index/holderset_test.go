package index

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestHolderSetsChangingFormMatchAModel drives the holders of a few
// blocks up and down, through every form of their holder word (none, one
// inline, a small array, bitsets, and back), with holder ids spread out
// (many holders of other blocks) and two tiers, against a plain model of
// who holds what: every answer must match after every change.
func TestHolderSetsChangingFormMatchAModel(t *testing.T) {
	for seed := range uint64(sized(4, 1)) {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 77))
			ix := New(Config{MaxHolderBlocks: -1})
			keys := chain(9, 3)
			var hs []Holder
			for i := range largeMin + 64 {
				h := Holder{Pod: fmt.Sprintf("10.40.%d.%d:8000", i/256, i%256)}
				hs = append(hs, h)
				// Holders of other blocks in between spread the ids.
				if i%3 == 0 {
					ix.Store(Blocks{Model: "m", Holder: Holder{Pod: fmt.Sprintf("10.41.%d.%d:8000", i/256, i%256)}, Tier: TierGPU, Keys: chain(uint64(1000+i), 1)})
				}
			}
			tiers := []string{TierGPU, TierCPU}
			// held[key][holder][tier]
			held := make([]map[Holder]map[string]bool, len(keys))
			for i := range held {
				held[i] = make(map[Holder]map[string]bool)
			}
			forms := make(map[string]bool)
			// Waves: grow to a crowd, shrink to few, again.
			ops := sized(6000, 1500)
			for op := range ops {
				grow := (op/500)%2 == 0
				h := hs[rng.IntN(len(hs))]
				tier := tiers[rng.IntN(2)]
				k := rng.IntN(len(keys))
				if grow == (rng.IntN(4) != 0) {
					ix.Store(Blocks{Model: "m", Holder: h, Tier: tier, Keys: keys[k : k+1]})
					if held[k][h] == nil {
						held[k][h] = make(map[string]bool)
					}
					held[k][h][tier] = true
				} else {
					ix.Remove("m", h, tier, 0, keys[k:k+1])
					delete(held[k][h], tier)
					if len(held[k][h]) == 0 {
						delete(held[k], h)
					}
				}
				var want []Holder
				for x := range held[k] {
					want = append(want, x)
				}
				require.ElementsMatch(t, want, ix.Holders("m", keys[k], nil), "op %d", op)
				for range 2 {
					x := hs[rng.IntN(len(hs))]
					n := 0
					for n < len(keys) && len(held[n][x]) > 0 {
						n++
					}
					var res Result
					ix.Lookup("m", keys, &res)
					got := 0
					if hit := res.Holder(x); hit != nil {
						got = hit.Prefix
						require.Equal(t, held[0][x][TierGPU], hit.Tier(TierGPU) > 0, "op %d", op)
					}
					require.Equal(t, n, got, "op %d lookup of %v", op, x)
				}
				v, _ := ix.model("m", false).view(keys[k])
				switch {
				case v.set == nil && elemHeld(v.one) != 0:
					forms["one"] = true
				case v.set != nil && v.set.large():
					forms["large"] = true
				case v.set != nil:
					forms["small"] = true
					if forms["large"] {
						forms["small after large"] = true
					}
				}
				if op%500 == 0 {
					checkInvariants(t, ix, op)
				}
			}
			checkInvariants(t, ix, ops)
			require.Equal(t, map[string]bool{"one": true, "small": true, "large": true, "small after large": true}, forms)
		})
	}
}
