// Package hashing computes the chained block hashes of a prompt exactly as
// vLLM's prefix cache does, so that a router can tell which engine holds
// which blocks of a prompt from the engines' KV events alone.
//
// # Blocks and chains
//
// A prompt is cut into blocks of Config.BlockSize tokens (vLLM's default,
// 16). Only full blocks are hashed. Block i's hash is H((parent, tokens,
// extra)): parent is block i-1's digest, or for block 0 the hash of the seed
// (vLLM's NONE_HASH, see Hasher.Root); tokens is the block's token ids; extra
// is None or a tuple of the block's extra keys. A block's hash therefore
// identifies the whole prefix up to and including it.
//
// # Algorithms
//
// Config.Algo selects H, spelled as vLLM's --prefix-caching-hash-algo:
//
//   - SHA256 (the default): SHA-256 of the value pickled by CPython at
//     protocol 5, reproduced byte for byte, framing included. Every value
//     is pickled as a distinct object, as vLLM builds them, except that a
//     repeated empty or one-character str or bytes is a memo reference, as
//     CPython shares those objects.
//   - SHA256CBOR: SHA-256 of the value's canonical CBOR (RFC 8949 §4.2).
//   - XXHash, XXHashCBOR: XXH3-128 of the pickle or CBOR bytes; the 16-byte
//     digest is the high then the low 64 bits, big-endian.
//   - SHA256CBOR64: vLLM 0.10.0-0.10.1's sha256_cbor_64bit, the low 64 bits
//     of SHA-256 of canonical CBOR, chained as integers.
//   - Content: kvsource's own keys, described below.
//
// Other engines' keys (EngineAlgos, see engines.go) let a router index
// those engines by their own block keys: SGLang and SGLangEAGLE (its
// radix cache's SHA-256 page chain, EAGLE's token bigrams), TRTV1,
// TRTV2SHA256_64 and TRTV2SHA256 (TensorRT-LLM's v1_block_key and its KV
// cache manager V2's SHA-256 block keys). They have no seed and refuse
// what their engine does not hash as vLLM does (LoRA names, multimodal
// items, explicit extra keys: ErrUnsupported). Their key forms are the
// engines' own: the first 8 digest bytes for the SHA-256 ones.
//
// KV events carry a block's hash as a uint64, its event form: the last 8
// bytes of the digest read big-endian (Digest.Key). BlockKeys returns the
// event forms, which is what the index stores; Blocks adds full digests and
// each block's extra keys.
//
// # Seeds
//
// Config.Seed is the engine's PYTHONHASHSEED string; the seed's hash is the
// parent of block 0. PYTHONHASHSEED="" is a seed like any other (vLLM hashes
// the empty string): express it with Config.SeedSet, since an empty Seed
// alone means unset. An engine without PYTHONHASHSEED uses DefaultSeed for
// the SHA-256 algorithms (since vLLM's change of August 2026; older engines
// use a random per-process seed for every algorithm) but a random seed for
// the xxhash ones, so New refuses XXHash and XXHashCBOR without a set seed
// (ErrSeedRequired): set PYTHONHASHSEED on such engines and pass the same
// value here. Engines
// share blocks only when algorithm, seed and block size all match, and a
// mismatch shows up as no hits at all, never as an error; compare a few
// hashes recomputed from events' token ids to catch it, and Diagnose to
// find the setting that differs (Diagnosis.Explain says which, or that no
// vLLM configuration reproduces the keys).
//
// # Extra keys
//
// A Request's LoRAName, CacheSalt and MM items give each block's extra keys
// as vLLM derives them, in this order: the LoRA name (every block); for each
// multimodal item overlapping the block, (identifier, offset - block start),
// walked with vLLM's cursor over the items sorted by offset; the cache salt
// (block 0 only); None when there are none. For what the SDK does not model,
// such as prompt embeddings (the SHA-256 digest bytes of each block's
// embedding slice), or to re-hash a KV event's blocks from its extra_keys,
// pass Request.Extra: each block's complete tuple, built with Str, Int,
// Bytes and Tuple.
//
// # Content keys
//
// Content is not a vLLM algorithm. It serves engines whose hashes a router
// cannot reproduce (a random xxhash seed, an unknown algorithm, another
// engine): the events layer re-keys each stored block from the token ids and
// extra keys in the event, and requests are hashed with the same Hasher, so
// both sides agree without knowing the engine's hash. A Content key is the
// xxh64 (github.com/cespare/xxhash/v2) of: the parent key as uint64
// little-endian (for block 0, the root xxh64(seed)); each token as uint32
// little-endian; the extra keys as tag 0 (None) or tag 4, a uint32 count and
// each element tagged: 1 str and 3 bytes (uint32 length and payload), 2 int
// (int64), 4 tuple (uint32 count and elements), all little-endian. The key is
// its own event form, and its digest is the key's 8 bytes big-endian.
//
// Use Content only when the engines' own keys cannot be matched: xxhash
// engines without PYTHONHASHSEED, or an engine version this package does not
// reproduce. It needs events that carry token ids (blocks known by hash
// alone, such as older CPU-offload events, cannot be re-keyed), and it costs
// a hash per stored block on the event path. Otherwise prefer the engines'
// algorithm: its keys come straight from the events.
//
// Because a Content or SHA256CBOR64 parent is a plain uint64, a chain can be
// continued from a KV event's parent_block_hash with BlockKeysFrom; the other
// algorithms chain on a full digest, which BlocksFrom and Prefix take.
//
// # Incremental hashing
//
// A Prefix holds a hashed prefix and its pending partial block: Append hashes
// only the new tokens, so the next turn of a conversation or a forked
// subagent extends a shared prefix (Clone) without rehashing it.
//
// A router that sees each turn as a new, whole request has no Prefix to
// extend; a Cache remembers recent prompts' chains by content instead, and
// Cache.BlockKeys hashes only the blocks past the longest remembered
// leading run (at checkpoint granularity for forks), after a content pass
// over the whole prompt that costs a fraction of SHA-256.
//
// # Cost
//
// Values are encoded straight into a pooled buffer without reflection; a
// Hasher is safe for concurrent use and BlockKeys allocates nothing when dst
// has room. No cgo.
package hashing
