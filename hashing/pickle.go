package hashing

import (
	"encoding/binary"
	"math/bits"
	"slices"
)

// CPython's pickle opcodes used for the hashed values.
const (
	pkProto          = 0x80
	pkFrame          = 0x95
	pkStop           = '.'
	pkNone           = 'N'
	pkMark           = '('
	pkTuple          = 't'
	pkEmptyTuple     = ')'
	pkTuple1         = 0x85
	pkTuple2         = 0x86
	pkTuple3         = 0x87
	pkMemoize        = 0x94
	pkBinGet         = 'h'
	pkLongBinGet     = 'j'
	pkBinInt1        = 'K'
	pkBinInt2        = 'M'
	pkBinInt         = 'J'
	pkLong1          = 0x8a
	pkShortBinBytes  = 'C'
	pkBinBytes       = 'B'
	pkBinBytes8      = 0x8e
	pkShortBinUnicod = 0x8c
	pkBinUnicode     = 'X'
	pkBinUnicode8    = 0x8d
)

// Framing constants of protocol 4 and later, as in CPython.
const (
	frameHeaderSize = 9
	frameSizeMin    = 4
	frameSizeTarget = 64 * 1024
)

// pickler reproduces the byte stream of CPython's C pickler at protocol 5
// for None, int, str, bytes and tuples of those. Every value is treated as a
// distinct object, as vLLM builds them, except those CPython keeps only one
// object of: the empty str and bytes, each one-character latin-1 str and
// each one-byte bytes. A repeat of one of those within a value is pickled as
// a reference to its memo entry, as CPython does.
//
// Framing follows CPython: a frame opens at the first write after the
// previous one closed; before each object is saved, a frame of at least
// frameSizeTarget bytes is committed; a str or bytes payload of at least
// frameSizeTarget bytes is written outside any frame; a committed frame
// shorter than frameSizeMin loses its header.
type pickler struct {
	b     []byte
	frame int    // offset of the open frame's header, -1 when none is open
	memo  uint32 // memo entries written so far
	// The shared objects memoized so far: the first ones in an array, so
	// that the common case allocates nothing.
	nShared int
	shared  [4]sharedMemo
	more    []sharedMemo
}

// sharedMemo is the memo index of a shared object (see sharedStr).
type sharedMemo struct {
	obj uint16
	idx uint32
}

// sharedStr and sharedBytes number the objects CPython shares: 0 the empty
// str, 1+c the str of latin-1 character c, 257 the empty bytes, 258+b the
// bytes of byte b. ok is false for any other value.
func sharedStr(s string) (obj uint16, ok bool) {
	switch {
	case s == "":
		return 0, true
	case len(s) == 1 && s[0] < 0x80:
		return 1 + uint16(s[0]), true
	case len(s) == 2 && (s[0] == 0xc2 || s[0] == 0xc3) && s[1]&0xc0 == 0x80:
		return 1 + (uint16(s[0]&0x1f)<<6 | uint16(s[1]&0x3f)), true
	}
	return 0, false
}

func sharedBytes(s string) (obj uint16, ok bool) {
	switch len(s) {
	case 0:
		return 257, true
	case 1:
		return 258 + uint16(s[0]), true
	}
	return 0, false
}

// memoized returns the memo index of a shared object pickled before.
func (p *pickler) memoized(obj uint16) (uint32, bool) {
	for i := range min(p.nShared, len(p.shared)) {
		if p.shared[i].obj == obj {
			return p.shared[i].idx, true
		}
	}
	for _, m := range p.more {
		if m.obj == obj {
			return m.idx, true
		}
	}
	return 0, false
}

// memoize writes MEMOIZE, which gives the object just written the next
// memo index.
func (p *pickler) memoize() {
	p.op(pkMemoize)
	p.memo++
}

// data writes a str or bytes, or a memo reference when it is a shared
// object written before.
func (p *pickler) data(short, long, long8 byte, s string, obj uint16, shared bool) {
	if shared {
		if idx, ok := p.memoized(obj); ok {
			p.boundary()
			p.open()
			if idx < 256 {
				p.b = append(p.b, pkBinGet, byte(idx))
			} else {
				p.b = append(p.b, pkLongBinGet)
				p.b = binary.LittleEndian.AppendUint32(p.b, idx)
			}
			return
		}
		m := sharedMemo{obj: obj, idx: p.memo}
		if p.nShared < len(p.shared) {
			p.shared[p.nShared] = m
		} else {
			p.more = append(p.more, m)
		}
		p.nShared++
	}
	p.dataHead(short, long, long8, len(s))
	p.b = append(p.b, s...)
	p.memoize()
}

func (p *pickler) open() {
	if p.frame < 0 {
		p.frame = len(p.b)
		p.b = append(p.b, pkFrame, 0, 0, 0, 0, 0, 0, 0, 0)
	}
}

func (p *pickler) commit() {
	if p.frame < 0 {
		return
	}
	n := len(p.b) - p.frame - frameHeaderSize
	if n >= frameSizeMin {
		binary.LittleEndian.PutUint64(p.b[p.frame+1:], uint64(n))
	} else {
		copy(p.b[p.frame:], p.b[p.frame+frameHeaderSize:])
		p.b = p.b[:len(p.b)-frameHeaderSize]
	}
	p.frame = -1
}

// boundary is CPython's check before saving an object.
func (p *pickler) boundary() {
	if p.frame >= 0 && len(p.b)-p.frame-frameHeaderSize >= frameSizeTarget {
		p.commit()
	}
}

func (p *pickler) op(c byte) {
	p.open()
	p.b = append(p.b, c)
}

func (p *pickler) int(v int64) {
	p.boundary()
	p.open()
	switch {
	case v >= 0 && v <= 0xff:
		p.b = append(p.b, pkBinInt1, byte(v))
	case v >= 0 && v <= 0xffff:
		p.b = append(p.b, pkBinInt2, byte(v), byte(v>>8))
	case v >= -1<<31 && v < 1<<31:
		p.b = append(p.b, pkBinInt)
		p.b = binary.LittleEndian.AppendUint32(p.b, uint32(v))
	default:
		// LONG1: minimal two's complement, little-endian.
		n := 1
		for n < 8 && (v < -1<<(8*n-1) || v >= 1<<(8*n-1)) {
			n++
		}
		p.b = append(p.b, pkLong1, byte(n))
		for i := range n {
			p.b = append(p.b, byte(v>>(8*i)))
		}
	}
}

// token is int for a token id, the hot path.
func (p *pickler) token(t uint32) {
	p.boundary()
	p.open()
	switch {
	case t <= 0xff:
		p.b = append(p.b, pkBinInt1, byte(t))
	case t <= 0xffff:
		p.b = append(p.b, pkBinInt2, byte(t), byte(t>>8))
	case t < 1<<31:
		p.b = append(p.b, pkBinInt, byte(t), byte(t>>8), byte(t>>16), byte(t>>24))
	default:
		p.b = append(p.b, pkLong1, 5, byte(t), byte(t>>8), byte(t>>16), byte(t>>24), 0)
	}
}

// pickleTokenLen and pickleTokenWord give, by bits.Len32 of a token, the
// length of its pickle encoding and the opcode bytes of the little-endian
// word that holds the encoding with the token shifted in.
var (
	pickleTokenLen   [33]uint8
	pickleTokenWord  [33]uint64
	pickleTokenShift [33]uint8
)

func init() {
	for l := range pickleTokenLen {
		switch {
		case l <= 8:
			pickleTokenLen[l], pickleTokenWord[l], pickleTokenShift[l] = 2, pkBinInt1, 8
		case l <= 16:
			pickleTokenLen[l], pickleTokenWord[l], pickleTokenShift[l] = 3, pkBinInt2, 8
		case l <= 31:
			pickleTokenLen[l], pickleTokenWord[l], pickleTokenShift[l] = 5, pkBinInt, 8
		default:
			pickleTokenLen[l], pickleTokenWord[l], pickleTokenShift[l] = 7, pkLong1|5<<8, 16
		}
	}
}

// tokens writes the elements of a tuple of token ids. When no frame can fill
// up within them it skips the per-object frame check and writes each token
// as one little-endian word, advancing by the encoding's length.
func (p *pickler) tokens(tokens []uint32) {
	const maxLen = 7
	p.boundary()
	p.open()
	if len(p.b)-p.frame-frameHeaderSize+maxLen*len(tokens) >= frameSizeTarget {
		for _, t := range tokens {
			p.token(t)
		}
		return
	}
	n := len(p.b)
	p.b = slices.Grow(p.b, maxLen*len(tokens)+8)
	buf := p.b[:cap(p.b)]
	for _, t := range tokens {
		l := bits.Len32(t)
		binary.LittleEndian.PutUint64(buf[n:], pickleTokenWord[l]|uint64(t)<<pickleTokenShift[l])
		n += int(pickleTokenLen[l])
	}
	p.b = p.b[:n]
}

// dataHead writes the opcode and length of a str or bytes of n bytes; the
// caller appends the payload and then memoizes.
func (p *pickler) dataHead(short, long, long8 byte, n int) {
	p.boundary()
	if n >= frameSizeTarget {
		p.commit()
	} else {
		p.open()
	}
	switch {
	case n < 256:
		p.b = append(p.b, short, byte(n))
	case uint64(n) <= 0xffffffff:
		p.b = append(p.b, long)
		p.b = binary.LittleEndian.AppendUint32(p.b, uint32(n))
	default:
		p.b = append(p.b, long8)
		p.b = binary.LittleEndian.AppendUint64(p.b, uint64(n))
	}
}

func (p *pickler) str(s string) {
	obj, shared := sharedStr(s)
	p.data(pkShortBinUnicod, pkBinUnicode, pkBinUnicode8, s, obj, shared)
}

// parent writes a parent digest: bytes of 8 bytes or more, never shared.
func (p *pickler) parent(b []byte) {
	p.dataHead(pkShortBinBytes, pkBinBytes, pkBinBytes8, len(b))
	p.b = append(p.b, b...)
	p.memoize()
}

// bytesStr is bytes for content held in a string.
func (p *pickler) bytesStr(s string) {
	obj, shared := sharedBytes(s)
	p.data(pkShortBinBytes, pkBinBytes, pkBinBytes8, s, obj, shared)
}

// tupleStart and tupleEnd bracket the elements of a tuple of n > 0 elements.
func (p *pickler) tupleStart(n int) {
	p.boundary()
	if n > 3 {
		p.op(pkMark)
	}
}

func (p *pickler) tupleEnd(n int) {
	switch n {
	case 1:
		p.op(pkTuple1)
	case 2:
		p.op(pkTuple2)
	case 3:
		p.op(pkTuple3)
	default:
		p.op(pkTuple)
	}
	p.memoize()
}

func (p *pickler) key(k ExtraKey) {
	switch k.kind {
	case KindStr:
		p.str(k.s)
	case KindInt:
		p.int(k.i)
	case KindBytes:
		p.bytesStr(k.s)
	default:
		p.tuple(k.elems)
	}
}

func (p *pickler) tuple(elems []ExtraKey) {
	if len(elems) == 0 {
		p.boundary()
		p.op(pkEmptyTuple)
		return
	}
	p.tupleStart(len(elems))
	for _, e := range elems {
		p.key(e)
	}
	p.tupleEnd(len(elems))
}

func (p *pickler) begin(b []byte) {
	p.b = append(b, pkProto, 5)
	p.frame = -1
}

func (p *pickler) end() []byte {
	p.op(pkStop)
	p.commit()
	return p.b
}

// appendPickleValue appends pickle.dumps(s, protocol=5) of the str s.
func appendPickleValue(b []byte, s string) []byte {
	var p pickler
	p.begin(b)
	p.str(s)
	return p.end()
}

// appendPickleBlock appends pickle.dumps((parent, tuple(tokens), extra),
// protocol=5), where parent is bytes and extra a tuple or None.
func appendPickleBlock(b []byte, parent *Digest, tokens []uint32, ex *extraSource) []byte {
	var p pickler
	p.begin(b)
	p.tupleStart(3)
	p.parent(parent.b[:parent.n])
	p.tupleStart(len(tokens))
	p.tokens(tokens)
	p.tupleEnd(len(tokens))
	n := ex.count()
	switch {
	case n == 0:
		p.boundary()
		p.op(pkNone)
	case ex.explicit:
		p.tuple(ex.keys)
	default:
		p.tupleStart(n)
		if ex.lora != "" {
			p.str(ex.lora)
		}
		for _, k := range ex.mmIdx {
			it := ex.mm[k]
			p.tupleStart(2)
			p.str(it.ID)
			p.int(int64(it.Offset - ex.start))
			p.tupleEnd(2)
		}
		if ex.salt != "" {
			p.str(ex.salt)
		}
		p.tupleEnd(n)
	}
	p.tupleEnd(3)
	return p.end()
}
