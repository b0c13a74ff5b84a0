package hashing

import "encoding/binary"

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
func appendCBORBlock(b []byte, parent Digest, intParent bool, tokens []uint32, ex *extraSource) []byte {
	b = append(b, cborArray|3)
	if intParent {
		b = appendCBORHead(b, cborUint, parent.Key())
	} else {
		b = appendCBORHead(b, cborBytes, uint64(parent.n))
		b = append(b, parent.b[:parent.n]...)
	}
	b = appendCBORHead(b, cborArray, uint64(len(tokens)))
	for _, t := range tokens {
		switch {
		case t < 24:
			b = append(b, byte(t))
		case t <= 0xff:
			b = append(b, 24, byte(t))
		case t <= 0xffff:
			b = append(b, 25, byte(t>>8), byte(t))
		default:
			b = append(b, 26, byte(t>>24), byte(t>>16), byte(t>>8), byte(t))
		}
	}
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
