// Package index records which holder (a vLLM engine: pod and data-parallel
// rank) holds which KV cache block in which tier, and answers, for a
// prompt's block keys, how long a prefix each holder has.
//
// # Model
//
// A holding is (model, block key, holder, tier, KV cache group). A block
// counts as held by a holder in a tier when any group holds it, so removing
// one group's copy keeps the others'. Tiers are the media engines report
// ("GPU", "CPU", or any other non-empty name). Keys are vLLM's uint64 event
// block keys; each model has its own key space.
//
// For a prompt, Lookup gives every holder with a hit the longest prefix held
// in any tier (a block counts when some tier holds it) and, per tier, the
// longest prefix held in that tier alone. Run gives the consecutive run a
// holder has from a given block in a given set of tiers: what it could
// supply to a destination that already has the blocks before. Holders lists
// the holders of one block; HoldersAt does too, given the prompt before it,
// at a cost that follows the prompt rather than the model's holders. There
// is no cap on holders per block.
//
// # Exactness
//
// Answers equal those of a brute-force model that checks every block of
// the prompt against every holding, including holdings with holes (a parent
// removed, its child kept), blocks stored without a parent, several tiers
// and groups. Three properties of vLLM's chained hashes are relied on: the
// keys passed to Lookup and Run are a chain (each key's parent block is the
// key before it), a block's parent is the same in every event that reports
// it, and the keys of one Store are consecutive blocks. Events whose blocks
// are not consecutive (hybrid models' groups that skip blocks) must be
// stored one key at a time without a parent.
//
// A lookup searches only the holders that start a chain at the prompt's
// first block: the index keeps, per model and key, the holders with a
// block stored there without a parent (or named as an unknown parent), its
// roots. A prompt's first block has no parent, so a holder of it is among
// them; keys passed to Lookup must therefore start at a prompt's first
// block, as the hashing package's do. A lookup's cost follows those
// holders, not the model's: holders that share nothing with the prompt
// cost nothing.
//
// Lookups are fast because engines store a block only after its parent.
// For each holder and tier the index keeps, per block, the slot of its
// reported parent and its depth, the length of the chain of reported
// parents above it, and it lists the gaps: blocks not held whose children
// are. A held block at position j whose chain reaches back j-i blocks,
// with no gap at the positions their depths put them, proves blocks i..j
// held; that proof only gets harder further along the prompt, so a binary
// search finds each holder's prefix in about log2(n) probes instead of n.
// A block stored without a parent starts a new run, searched the same way.
// Where a tier has more gaps than a lookup checks (32), it is checked block
// by block: slower, equally exact.
//
// # Concurrency
//
// Readers (Lookup, Run, Holders, HoldersAt, HolderBlocks, Stats) take no
// lock and never wait for writers: each holder's blocks live in hash tables
// written by one writer and read with atomic loads; a growing table is
// rebuilt aside and swapped in. A model's roots are lists copied on
// removal and published atomically; their writers (a store that starts a
// chain, a rebuild or clear that drops one) take a per-model mutex readers
// never touch. Writers (Store, Remove, ClearHolder, RemoveHolder) serialise
// per holder and model on a mutex readers never touch; the events package
// calls them from one goroutine per holder, so different holders proceed in
// parallel. A lookup concurrent with writes sees each block either before
// or after each write.
//
// # Memory
//
// Memory is bounded by holdings: a (block, tier) pair costs a 16-byte table
// slot at 50-81% occupancy and a 5-byte eviction-queue entry, about 30
// bytes in all for a holder that grew to its size, about 40 for one that
// keeps replacing its blocks (removed blocks hold their slots until the
// table is rebuilt). Config.HolderCapacity (or SetHolderCapacity: the
// pod's real cache size in blocks) caps one holder; Config.MaxHolderBlocks
// caps the total, or Config.MemoryBytes in bytes, at HolderBlockBytes a
// holding. Past either, the oldest holdings are evicted (the
// largest holder's, for the total), counted in Stats and logged at debug
// level, so lost removal events cannot grow the index without bound. A
// holding removed and stored again keeps its first place in that order
// until the holder's eviction queue is next compacted. Unheld ancestors of
// held blocks are kept as long as those are, so that depths stay
// meaningful. Roots cost a list entry per chain start, not per block: with
// engines that report parents, one per stored request prefix; a producer
// that reports none makes every block a chain start.
//
// # Snapshots
//
// SaveFile writes the whole index and the per-holder last event sequence
// numbers to a versioned, checksummed file, atomically; LoadFile reads it
// back, rejecting a corrupt or foreign file with ErrBadSnapshot and loading
// nothing. A restarted router loads its snapshot and asks each engine to
// replay what it missed after the saved sequence.
package index
