package events

import "github.com/kvsource/kvsource/index"

// Sink is how events drive the index; a custom backend or a test recorder
// can take its place. A Processor calls it for each holder from one
// goroutine at a time, for different holders in parallel. keys belong to the caller and are reused once a call returns:
// a Sink that keeps them must copy them. *index.Index implements it.
//
// The keys of one Store are consecutive blocks, the first one the child of
// Blocks.Parent when it is set. A hybrid model's event that skips blocks is
// stored one key at a time without a parent, since which blocks it skipped
// is unknown.
//
// Tiers are upper-case ("GPU", "CPU"); an event without a medium is "GPU".
// ClearHolder with tier "" clears every tier of the holder.
type Sink interface {
	Store(b index.Blocks)
	Remove(model string, h index.Holder, tier string, group int, keys []uint64)
	ClearHolder(model string, h index.Holder, tier string) // tier "" = all tiers
}
