package index_test

import (
	"fmt"

	"github.com/kvsource/kvsource/index"
)

// Two engines hold a system prompt; one of them has the rest of a
// conversation too, partly offloaded to its CPU tier. A lookup of the
// conversation gives each engine its prefix, and per tier.
func Example() {
	ix := index.New(index.Config{})
	a, b := index.Holder{Pod: "10.0.0.1:8000"}, index.Holder{Pod: "10.0.0.2:8000"}
	system := []uint64{101, 102, 103, 104}
	turn := []uint64{201, 202, 203}
	for _, h := range []index.Holder{a, b} {
		ix.Store(index.Blocks{Model: "llama", Holder: h, Tier: index.TierGPU, Keys: system})
	}
	ix.Store(index.Blocks{Model: "llama", Holder: a, Tier: index.TierGPU, Parent: index.ParentKey(104), Keys: turn[:1]})
	ix.Store(index.Blocks{Model: "llama", Holder: a, Tier: index.TierCPU, Parent: index.ParentKey(201), Keys: turn[1:]})

	var res index.Result
	ix.Lookup("llama", append(system, turn...), &res)
	for _, h := range []index.Holder{a, b} {
		hit := res.Holder(h)
		fmt.Printf("%v: %d blocks, %d on GPU, %d on CPU\n", h, hit.Prefix, hit.Tier(index.TierGPU), hit.Tier(index.TierCPU))
	}
	// What a could send a destination that has the system prompt:
	fmt.Println("run after the system prompt:", ix.Run("llama", a, append(system, turn...), len(system), nil))
	fmt.Println("blocks two or more engines hold:", ix.Stats().SharedBlocks)
	// Output:
	// 10.0.0.1:8000: 7 blocks, 5 on GPU, 0 on CPU
	// 10.0.0.2:8000: 4 blocks, 4 on GPU, 0 on CPU
	// run after the system prompt: 3
	// blocks two or more engines hold: 4
}
