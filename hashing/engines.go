package hashing

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
)

// Engine-key algorithms: the block keys other engines than vLLM put in
// their KV events, reproduced so that a router can index those engines by
// their own keys (no content-key translation). None of them has a seed.
const (
	// SGLang is SGLang's radix-cache page key (mem_cache's get_hash_str and
	// hash_str_to_int64): SHA-256 over the previous page's 32-byte digest
	// (nothing for the first page) and each token as 4 bytes little-endian;
	// the key is the digest's first 8 bytes big-endian, which SGLang sends
	// as a signed int64. LoRA and cache salt are not hashed.
	SGLang Algo = "sglang"
	// SGLangEAGLE is SGLang with EAGLE speculative decoding, whose radix
	// keys are token bigrams: a page of BlockSize positions hashes the pairs
	// (t[i], t[i+1]) of its positions, both elements, so a block needs the
	// token after it too and a prompt of n tokens has (n-1)/BlockSize full
	// blocks. Prefix and Cache do not support it.
	SGLangEAGLE Algo = "sglang_eagle"
	// TRTV1 is TensorRT-LLM's default v1_block_key (kv_cache_hash.py's
	// hash_v1_block_key): a 64-bit mix of the block's length, its parent key
	// and its tokens, the parent key being 0 for block 0. A Request's
	// CacheSalt mixes into block 0 as TensorRT-LLM's KV cache manager V2
	// does (the salt id of get_cache_salt_id); the V1 manager's C++ hasher
	// mixes std::hash of the salt instead, which no router reproduces. A
	// LoRA task id, which the engine mixes into every block, is not
	// modelled.
	TRTV1 Algo = "trtllm_v1_block_key"
	// TRTV2SHA256_64 is TensorRT-LLM's v2_sha256_64: the V2 KV cache
	// manager's radix block key, SHA-256 over the parent's 32-byte digest
	// and each token as 4 bytes little-endian, from a root that is the
	// SHA-256 of the request's reuse scope (LoRA id and salt id); the key is
	// the digest's first 8 bytes big-endian.
	TRTV2SHA256_64 Algo = "trtllm_v2_sha256_64"
	// TRTV2SHA256 is TensorRT-LLM's v2_sha256, the same digests sent as hex
	// strings; package events keys a hex hash by its first 8 bytes, so its
	// keys are TRTV2SHA256_64's.
	TRTV2SHA256 Algo = "trtllm_v2_sha256"
)

// EngineAlgos lists the engine-key algorithms of engines other than vLLM.
var EngineAlgos = []Algo{SGLang, SGLangEAGLE, TRTV1, TRTV2SHA256_64, TRTV2SHA256}

// ErrUnsupported reports a request option an engine-key algorithm does not
// hash as its engine does (LoRA names, multimodal items, explicit extra
// keys), or an operation it does not support.
var ErrUnsupported = errors.New("hashing: not supported by this algorithm")

// IsEngineAlgo reports whether a is one of EngineAlgos.
func IsEngineAlgo(a Algo) bool {
	switch a {
	case SGLang, SGLangEAGLE, TRTV1, TRTV2SHA256_64, TRTV2SHA256:
		return true
	}
	return false
}

// checkEngineRequest refuses what an engine algorithm cannot hash as the
// engine does.
func (h *Hasher) checkEngineRequest(req *Request) error {
	if !IsEngineAlgo(h.cfg.Algo) {
		return nil
	}
	if req.LoRAName != "" || len(req.MM) > 0 || req.Extra != nil {
		return fmt.Errorf("%w: %s keys with a LoRA name, multimodal items or explicit extra keys", ErrUnsupported, h.cfg.Algo)
	}
	return nil
}

// blockSpan is how many tokens from a block's start its key covers: one
// more than the block for EAGLE's bigrams.
func (h *Hasher) blockSpan() int {
	if h.enc == encSGLangEAGLE {
		return h.cfg.BlockSize + 1
	}
	return h.cfg.BlockSize
}

// fullBlocks is the number of full blocks n tokens make.
func (h *Hasher) fullBlocks(n int) int {
	if h.enc == encSGLangEAGLE {
		if n == 0 {
			return 0
		}
		n--
	}
	return n / h.cfg.BlockSize
}

// appendLE32 appends each token as 4 bytes little-endian.
func appendLE32(b []byte, tokens []uint32) []byte {
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	return b
}

// appendBigrams appends, for each of the len(tokens)-1 positions, the pair
// (t[i], t[i+1]) as two 4-byte little-endian tokens.
func appendBigrams(b []byte, tokens []uint32) []byte {
	for i := 0; i+1 < len(tokens); i++ {
		b = binary.LittleEndian.AppendUint32(b, tokens[i])
		b = binary.LittleEndian.AppendUint32(b, tokens[i+1])
	}
	return b
}

// TensorRT-LLM's v1 constants (kv_cache_hash.py).
const (
	trtC1 = 0xBF58476D1CE4E5B9
	trtC2 = 0x94D049BB133111EB
	trtK  = 0x45D9F3B
	trtG  = 0x9E3779B9
)

func trtMix32(v uint32, seed uint64) uint64 {
	v = ((v >> 16) ^ v) * trtK
	v = ((v >> 16) ^ v) * trtK
	v = (v >> 16) ^ v
	v += trtG // wraps at 32 bits, as C++'s uint32_t sum does
	return seed ^ (uint64(v) + seed<<6 + seed>>2)
}

func trtMix64(v, seed uint64) uint64 {
	v = (v ^ v>>30) * trtC1
	v = (v ^ v>>27) * trtC2
	v ^= v >> 31
	return seed ^ (v + trtG + seed<<6 + seed>>2)
}

// trtV1Key is hash_v1_block_key without a LoRA task id.
func trtV1Key(tokens []uint32, parent uint64, salt string) uint64 {
	seed := uint64(len(tokens)) ^ parent*trtC1
	if parent == 0 && salt != "" {
		seed = trtMix64(TRTSaltID(salt), seed)
	}
	for _, t := range tokens {
		seed = trtMix32(t, seed)
	}
	return seed
}

// TRTSaltID is TensorRT-LLM's get_cache_salt_id: the first 8 bytes of the
// salt's SHA-256, little-endian, which keys a salted request's namespace
// in both v1 and v2 keys.
func TRTSaltID(salt string) uint64 {
	s := sha256.Sum256([]byte(salt))
	return binary.LittleEndian.Uint64(s[:8])
}

// trtV2Root is the root digest of a reuse scope with no LoRA id and the
// given salt ("" for none): SHA-256 of reuse_scope_to_bytes, a mask byte
// with bit 1 for the salt, then the salt id as 8 bytes little-endian.
func trtV2Root(salt string) Digest {
	b := []byte{0}
	if salt != "" {
		b[0] = 2
		b = binary.LittleEndian.AppendUint64(b, TRTSaltID(salt))
	}
	return Digest{n: sha256Size, first: true, b: sha256.Sum256(b)}
}
