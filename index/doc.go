// Package index records which holder (a vLLM engine: pod and data-parallel
// rank) holds which KV cache block in which tier, and answers, for a
// prompt's block keys, how long a prefix each holder has.
//
// # Model
//
// A holding is (model, block key, holder, tier, KV cache group). A block
// counts as held by a holder in a tier when any group holds it, so removing
// one group's copy keeps the others'. Tiers are the media engines report
// ("GPU", "CPU", or any other non-empty name; at most 8 per holder and
// model). Keys are vLLM's uint64 event block keys; each model has its own
// key space.
//
// For a prompt, Lookup gives every holder with a hit the longest prefix held
// in any tier (a block counts when some tier holds it) and, per tier, the
// longest prefix held in that tier alone. Run gives the consecutive run a
// holder has from a given block in a given set of tiers: what it could
// supply to a destination that already has the blocks before. Holders lists
// the holders of one block. There is no cap on holders per block. Answers
// equal those of a brute-force model that checks every block of the prompt
// against every holding, holes (a parent removed, its child kept) and
// blocks stored without a parent included.
//
// # Design
//
// Each model is one block-major store: every block is kept once, as an
// entry, whoever holds it, and a holding is a bit in its block's entry.
//
//   - Entries (entry.go) live in an arena of chunks that never move, so an
//     entry's id is stable for its life. An entry is 16 bytes: its key and
//     its holder word, which holds one holder inline, or names a holder
//     set: a small sorted array, never changed once published and shared
//     by consecutive blocks with the same holders, or per-lane bitsets by
//     holder id once there are many (update.go changes the form). A
//     holder's element is its model-local id and, per lane (its tiers, in
//     the order it first stored in them), a held bit and a ghost bit.
//   - The key table (keytable.go) maps keys to entry ids: 32 shards of
//     open addressing, each rebuilt aside as it grows.
//   - Each holder (holderstate.go) has its lanes, counts per lane, the KV
//     cache groups of holdings not of group 0 alone, and its eviction
//     queue (queue.go): its holdings oldest first as runs of consecutive
//     entry ids, which a store of new blocks gets. A removed holding
//     becomes a ghost: its queue place stays, so a holding stored again
//     keeps its first place, until the queue drops ghosts (past a quarter
//     of the holdings and 64).
//   - A lookup (lookup.go) takes the holders of the prompt's first block
//     as the candidates (as bitsets when they are many: a system prompt
//     every holder holds) and walks the prompt once narrowing them: a
//     candidate leaves at the first block it holds in no tier. Each block
//     is looked for first beside the one before in the arena (a chain a
//     store made has consecutive ids), then in the key table. A block
//     whose holder set is the one before's costs one comparison; many
//     candidates leave a word of bitsets at a time.
//   - Snapshots: snapshot.go (format 3) and snapshot_v2.go (formats 1, 2).
//   - model.go has a model's state, index.go the writes, speculative.go
//     the router's guesses, holderlist.go the listings.
//
// Invariants, checked at rest by the property tests (checkInvariants):
//
//  1. Each listed holder has its id in the registry, and no free id names
//     a holder.
//  2. Each live key table slot names a live entry of its key, each entry
//     once; a shard's used and tomb counts are exact.
//  3. Each entry is free (on the free list, named by no slot) or live: it
//     has a holder bit, and its set is in its form's shape (small: 2 to
//     256 elements sorted by id; large: its count exact).
//  4. Each element is a listed holder's, with bits only in lanes it has.
//  5. A holder's queue names each of its holdings and ghosts outside the
//     speculative lane exactly once, its guess queue those in that lane,
//     and nothing else; ghost, lane and holding counts are exact, and
//     capacity holds.
//  6. Groups are listed only for holdings, sorted, never group 0 alone.
//  7. The index's holding and shared-block counts are the sums of its
//     holders' and models'.
//
// Lock order: a model's mu (holders), then a holder's mu, then an entry's
// lock bit, then a key shard's mutex or the model's allocMu. The budget
// takes a second holder's mu only with TryLock.
//
// # Concurrency
//
// Readers (Lookup, Run, Holders, HoldersAt, HolderBlocks, Stats) take no
// lock and never wait for writers: they load an entry's word, then check
// its key (a freed entry reused for another key changes its key first),
// and a holder set, published whole or written with atomic operations.
// Writers (Store, Remove, ClearHolder, RemoveHolder) serialise per holder
// and model on a mutex readers never touch; a write holds an entry's lock
// bit for that block alone, so writers of different holders proceed in
// parallel whatever they share. A holder id freed and given again while
// a lookup runs is not credited with its predecessor's blocks: the
// lookup drops holders that got their id after it started. A lookup
// concurrent with writes sees each block either before or after each
// write.
//
// # Memory
//
// Memory is bounded by holdings. A block one holder holds costs its
// 16-byte entry, its key's 4-byte slot at 3/16 to 3/4 occupancy and a
// share of a queue run: about 23 bytes in all for a holder that grew to
// its size (BenchmarkMemory/grown), 33 for one that keeps replacing its
// blocks (ghosts keep entries until their queue drops them). A block many
// holders hold costs its set once (an array shared along a chain, or a
// bit a holder a lane): under a byte a holding for 128 holders
// (BenchmarkMemoryShared). Config.HolderCapacity (or SetHolderCapacity:
// the pod's real cache size in blocks) caps one holder; Config.MaxHolderBlocks
// caps the total, or Config.MemoryBytes in bytes, at HolderBlockBytes a
// holding, each model's state counting as about 9 KiB of holdings and each
// block with a holder set as setBlockHoldings (a model is freed with its
// last holder, RemoveHolder). Past either, the oldest holdings are evicted
// (the largest holder's, for the total), counted in Stats and logged at
// debug level, so lost removal events cannot grow the index without bound.
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
// back, rejecting a corrupt or foreign file with ErrBadSnapshot and
// loading nothing. Files of formats 1 and 2 (per-holder tables, and the
// shared-block layer) load; a build that reads an older format refuses
// format 3 with ErrSnapshotVersion. Saving leaves each holder's eviction order as
// it was, and the file keeps that order: the saving index and the loaded
// copy evict next what the index would have without the save. A restarted
// router loads its snapshot and asks each engine to replay what it missed
// after the saved sequence.
package index
