package events

import "github.com/kvsource/kvsource/index"

// Sink is how events drive the index; a custom backend or a test recorder
// can take its place. Called from ONE goroutine per holder (your worker),
// holders in parallel.
//
// Tiers are upper-case ("GPU", "CPU"); an event without a medium is "GPU".
// ClearHolder with tier "" clears every tier of the holder.
type Sink interface {
	Store(model string, h index.Holder, tier string, group int, parent uint64, hasParent bool, keys []uint64)
	Remove(model string, h index.Holder, tier string, group int, keys []uint64)
	ClearHolder(model string, h index.Holder, tier string) // tier "" = all tiers
}
