package transfer

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
)

// GroupLen is the length of the KV-cache group index that ends a Key.
const GroupLen = 4

// Key is a vLLM OffloadKey: the block-hash digest bytes followed by the
// KV-cache group index as 4 bytes big-endian. It is the unit a peer looks up,
// pins and transfers. Convert to string to use it as a map key.
type Key []byte

// NewKey returns the key of a block digest in KV-cache group g.
func NewKey(digest []byte, g uint32) Key {
	k := make(Key, len(digest)+GroupLen)
	copy(k, digest)
	binary.BigEndian.PutUint32(k[len(digest):], g)
	return k
}

// KeyFromUint64 returns a key whose digest is h as 8 bytes big-endian, in
// KV-cache group g.
//
// vLLM's KV events carry the low 64 bits of a digest by default, which is
// not enough to name a block to a real vLLM peer (its keys hold the full
// digest). Use this for simulations and fakes keyed by 64-bit hashes; use
// NewKey with the full digest (from prompt hashing or raw-digest events) to
// talk to vLLM.
func KeyFromUint64(h uint64, g uint32) Key {
	var d [8]byte
	binary.BigEndian.PutUint64(d[:], h)
	return NewKey(d[:], g)
}

// Digest returns the block-hash digest part of k (aliasing k), or nil when k
// is too short to be a key.
func (k Key) Digest() []byte {
	if len(k) < GroupLen {
		return nil
	}
	return k[:len(k)-GroupLen]
}

// Group returns the KV-cache group index of k, 0 when k is too short.
func (k Key) Group() uint32 {
	if len(k) < GroupLen {
		return 0
	}
	return binary.BigEndian.Uint32(k[len(k)-GroupLen:])
}

// Uint64 returns the event form of k's digest: its last 8 bytes read big
// endian, as vLLM's KV events report block hashes by default. Digests shorter
// than 8 bytes are read as a big-endian number.
func (k Key) Uint64() uint64 {
	d := k.Digest()
	if len(d) > 8 {
		d = d[len(d)-8:]
	}
	var v uint64
	for _, b := range d {
		v = v<<8 | uint64(b)
	}
	return v
}

// String renders k as hex digest, a slash and the group index.
func (k Key) String() string {
	if len(k) < GroupLen {
		return "invalid:" + hex.EncodeToString(k)
	}
	return fmt.Sprintf("%s/%d", hex.EncodeToString(k.Digest()), k.Group())
}

// Valid reports whether k has a non-empty digest.
func (k Key) Valid() bool { return len(k) > GroupLen }

// OffloadKeys returns the keys vLLM's offload tier stores for a request whose
// block digests are digests, in KV-cache group g, when each offloaded chunk
// holds blocksPerChunk blocks: chunk k is named by the digest of its last
// block, digests[(k+1)*blocksPerChunk-1]. A trailing partial chunk is not
// offloaded and has no key. blocksPerChunk < 1 is treated as 1.
func OffloadKeys(digests [][]byte, blocksPerChunk int, g uint32) []Key {
	if blocksPerChunk < 1 {
		blocksPerChunk = 1
	}
	n := len(digests) / blocksPerChunk
	keys := make([]Key, n)
	for c := range n {
		keys[c] = NewKey(digests[(c+1)*blocksPerChunk-1], g)
	}
	return keys
}
