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

// HolderRemover is implemented by a Sink that can forget a holder in every
// model at once, which a Processor needs to expire the holders of
// Config.InitialSeqs it never hears from (their models are not known).
// *index.Index implements it.
type HolderRemover interface {
	RemoveHolder(h index.Holder)
}

// HolderPruner is implemented by a Sink that can forget a holder in every
// model but one, which a Processor needs when a holder an index snapshot
// brought in (Config.InitialSeqs) first publishes: its entries under any
// other model are not its stream's, since an engine serves one model, and
// a process that took over the address may serve another. Without it the
// Processor removes the holder in every model (HolderRemover), which costs
// the snapshot's entries of the model it does publish: a miss, never a
// wrong source. *index.Index implements it.
type HolderPruner interface {
	RemoveHolderExcept(h index.Holder, model string)
}
