package hashing

import (
	"encoding/binary"
	"math/bits"
	"slices"
)

// CBOR major types and simple values (RFC 8949).
const (
	cborUint  = 0 << 5
	cborNeg   = 1 << 5
	cborBytes = 2 << 5
	cborText  = 3 << 5
	cborArray = 4 << 5
	cborNull  = 0xf6
)

// appendCBORHead appends a data item head in the shortest form, as RFC 8949
// §4.2.1's deterministic encoding (and cbor2's canonical mode) requires.
func appendCBORHead(b []byte, major byte, n uint64) []byte {
	switch {
	case n < 24:
		return append(b, major|byte(n))
	case n <= 0xff:
		return append(b, major|24, byte(n))
	case n <= 0xffff:
		return append(b, major|25, byte(n>>8), byte(n))
	case n <= 0xffffffff:
		return append(b, major|26, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	default:
		b = append(b, major|27)
		return binary.BigEndian.AppendUint64(b, n)
	}
}

func appendCBORInt(b []byte, v int64) []byte {
	if v < 0 {
		return appendCBORHead(b, cborNeg, uint64(^v))
	}
	return appendCBORHead(b, cborUint, uint64(v))
}

func appendCBORString(b []byte, s string) []byte {
	b = appendCBORHead(b, cborText, uint64(len(s)))
	return append(b, s...)
}

func appendCBORKey(b []byte, k ExtraKey) []byte {
	switch k.kind {
	case KindStr:
		return appendCBORString(b, k.s)
	case KindInt:
		return appendCBORInt(b, k.i)
	case KindBytes:
		b = appendCBORHead(b, cborBytes, uint64(len(k.s)))
		return append(b, k.s...)
	default:
		b = appendCBORHead(b, cborArray, uint64(len(k.elems)))
		for _, e := range k.elems {
			b = appendCBORKey(b, e)
		}
		return b
	}
}

// appendCBORBlock appends the canonical CBOR of [parent, [tokens...], extra],
// parent being a byte string, or for the legacy 64-bit algorithm the parent
// integer.
func appendCBORBlock(b []byte, parent *Digest, intParent bool, tokens []uint32, ex *extraSource) []byte {
	switch {
	case intParent:
		b = append(b, cborArray|3)
		b = appendCBORHead(b, cborUint, parent.Key())
	case parent.n == sha256Size:
		// A fixed-size copy compiles to a few moves instead of a memmove.
		n := len(b)
		b = slices.Grow(b, 3+sha256Size)[:n+3+sha256Size]
		b[n], b[n+1], b[n+2] = cborArray|3, cborBytes|24, sha256Size
		*(*[sha256Size]byte)(b[n+3:]) = parent.b
	default:
		b = append(b, cborArray|3)
		b = appendCBORHead(b, cborBytes, uint64(parent.n))
		b = append(b, parent.b[:parent.n]...)
	}
	b = appendCBORHead(b, cborArray, uint64(len(tokens)))
	b = appendCBORTokens(b, tokens)
	n := ex.count()
	switch {
	case n == 0:
		return append(b, cborNull)
	case ex.explicit:
		b = appendCBORHead(b, cborArray, uint64(n))
		for _, k := range ex.keys {
			b = appendCBORKey(b, k)
		}
		return b
	}
	b = appendCBORHead(b, cborArray, uint64(n))
	if ex.lora != "" {
		b = appendCBORString(b, ex.lora)
	}
	for _, k := range ex.mmIdx {
		it := ex.mm[k]
		b = append(b, cborArray|2)
		b = appendCBORString(b, it.ID)
		b = appendCBORInt(b, int64(it.Offset-ex.start))
	}
	if ex.salt != "" {
		b = appendCBORString(b, ex.salt)
	}
	return b
}

// cborToken packs, by bits.Len32 of a token of at least 24, the head byte
// of its CBOR encoding, the left shift that puts its significant bytes first
// in a big-endian uint32, and the encoding's length.
var cborToken [33]uint32

func init() {
	for l := range cborToken {
		switch {
		case l <= 8:
			cborToken[l] = cborUint | 24 | 24<<8 | 2<<16
		case l <= 16:
			cborToken[l] = cborUint | 25 | 16<<8 | 3<<16
		default:
			cborToken[l] = cborUint | 26 | 0<<8 | 5<<16
		}
	}
}

// appendCBORTokens appends the tokens as CBOR unsigned integers. It writes
// every token's head and a full 4-byte value and advances by the encoding's
// length: random token ids make the branches of a size switch unpredictable.
func appendCBORTokens(b []byte, tokens []uint32) []byte {
	n := len(b)
	if cap(b)-n < 5*len(tokens) {
		b = slices.Grow(b, 5*len(tokens))
	}
	buf := b[:cap(b)]
	for _, t := range tokens {
		if t < 24 {
			buf[n] = byte(t)
			n++
			continue
		}
		e := cborToken[bits.Len32(t)]
		w := buf[n : n+5]
		w[0] = byte(e)
		binary.BigEndian.PutUint32(w[1:], t<<(e>>8&31))
		n += int(e >> 16)
	}
	return b[:n]
}
