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
// A lookup searches only the holders of the prompt's first block: the
// index keeps, per model and key, the holders with a block stored there
// without a parent (or named as an unknown parent), its roots, and the
// layer (below) lists its holders of each block it keeps. A prompt's
// first block has no parent, so a holder of it is among them; keys passed
// to Lookup must therefore start at a prompt's first block, as the
// hashing package's do. A lookup's cost follows those holders, not the
// model's: holders that share nothing with the prompt cost nothing.
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
// # Shared blocks
//
// A block that Config.ShareThreshold holders (64 by default) hold in a
// tier is kept once, in the model's layer: its key, its chain and its
// holders as a set (a few ids in place, then a bitset), instead of a table
// slot per holder. A store that finds the block held by that many holders
// moves their holdings there, and holders that store it later store it
// there; each keeps its place in its holder's eviction order. A lookup
// searches the layer's holders of the prompt's first block together:
// along the prompt, a binary search finds how far all of those still in
// the run hold every block, the ones not holding the next block leave it
// there, and each goes on in its own tables from where it left. So a
// system prompt shared by 10,000 holders costs its blocks once and is
// searched once, and each holder pays only for what follows it. At most
// two tiers per model are shared (the first two that reach the
// threshold, never TierSpeculative), and only blocks stored for KV cache
// group 0 become shared; a shared holding keeps the other groups stored
// for it, and blocks stored for other groups alone stay in their holders'
// tables.
//
// # Concurrency
//
// Readers (Lookup, Run, Holders, HoldersAt, HolderBlocks, Stats) take no
// lock and never wait for writers: each holder's blocks live in hash tables
// written by one writer and read with atomic loads; a growing table is
// rebuilt aside and swapped in. The layer is read the same way; writes of
// shared blocks (a store, removal or eviction of one, or a store of a
// block it may share: a chain start or a shared block's child) serialise
// on a per-model mutex readers never touch, taken after the holder's and
// held for those blocks alone, so that the holders of a shared system
// prompt write their own blocks in parallel. A model's roots are lists copied on
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
// slot at 50-81% occupancy and a 5-byte eviction-queue entry, about 28.5
// bytes in all for a holder that grew to its size, about 39 for one that
// keeps replacing its blocks (removed blocks hold their slots until the
// table is rebuilt). A shared block costs about 120 bytes once (its entry,
// its key's slot in the layer's table and its holder set) and a bit or 4
// bytes per holder; consecutive shared blocks share one eviction-queue
// entry per holder: about 1.2 bytes a holding for a block 128 holders
// hold. An entry stays while a holder holds it, another chains through it
// or a holder's eviction queue names it (until that queue is compacted). Config.HolderCapacity (or SetHolderCapacity: the
// pod's real cache size in blocks) caps one holder; Config.MaxHolderBlocks
// caps the total, or Config.MemoryBytes in bytes, at HolderBlockBytes a
// holding, each model's state counting as about 9 KiB of holdings
// (a model is freed with its last holder, RemoveHolder). Past either, the oldest holdings are evicted (the
// largest holder's, for the total), counted in Stats and logged at debug
// level, so lost removal events cannot grow the index without bound. A
// holding removed and stored again keeps its first place in that order
// until the holder's eviction queue is next compacted. Unheld ancestors of
// held blocks are kept as long as those are, so that depths stay
// meaningful. Roots cost a list entry per chain start, not per block: with
// engines that report parents, one per stored request prefix; a producer
// that reports none makes every block a chain start.
//
// # Speculative entries
//
// Speculative records a router's guesses, a prompt it just routed, as
// blocks of TierSpeculative that score (as GPU blocks, by the picker's
// default weights, and stay so beside the blocks the engine then stores)
// until their TTL passes or the engine evicts them. They are bounded by
// their own bytes, not by Config.HolderCapacity, MaxHolderBlocks or
// MemoryBytes: they are in no holder's eviction queue, never evict a
// stored block and are not in Stats.HolderBlocks. A block stays guessed
// while the newest entry holding it lasts. A destination the index knew
// nothing of becomes a holder until its last entry goes, and at most
// SpeculativeConfig.MaxHolders of those are kept at once: clients that
// name made-up destinations cannot grow the holders lookups search.
//
// # Snapshots
//
// SaveFile writes the whole index and the per-holder last event sequence
// numbers to a versioned, checksummed file, atomically; LoadFile reads it
// back, shared blocks shared again, rejecting a corrupt or foreign file
// with ErrBadSnapshot and loading nothing. Files of format 1 (before
// shared blocks) load; a build that reads only format 1 refuses format 2
// with ErrSnapshotVersion. Saving leaves each holder's eviction order as
// it was, and the file keeps that order: the saving index and the loaded
// copy evict next what the index would have without the save. A restarted
// router loads its snapshot and asks each engine to replay what it missed
// after the saved sequence.
package index
