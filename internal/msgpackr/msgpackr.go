// Package msgpackr reads msgpack values in place from a byte slice: the one
// set of primitives (headers, integers, strings, skipping) that the events
// decoder and the vLLM P2P message codec are built on.
//
// Every length is checked against the bytes left before it is used, so a
// hostile header costs nothing, and nothing is allocated: strings and
// binaries alias the input. A Reader is a cursor; a caller that fails part
// way may reset it or move it back to a position it saved.
package msgpackr

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
)

// Errors a Reader's methods wrap. A value cut short, or a length beyond the
// bytes left, wraps io.ErrUnexpectedEOF.
var (
	// ErrType is a value of another type than the one asked for.
	ErrType = errors.New("msgpack: unexpected type")
	// ErrRange is an integer outside the range asked for.
	ErrRange = errors.New("msgpack: integer out of range")
	// ErrDepth is nesting deeper than the caller allowed.
	ErrDepth = errors.New("msgpack: nesting too deep")
)

// Codes of the msgpack format a caller branches on.
const (
	Nil     = 0xc0
	False   = 0xc2
	True    = 0xc3
	Float32 = 0xca
	Float64 = 0xcb
	Uint8   = 0xcc
	Uint16  = 0xcd
	Uint32  = 0xce
	Uint64  = 0xcf
	Int8    = 0xd0
	Int16   = 0xd1
	Int32   = 0xd2
	Int64   = 0xd3
)

// Kind is the type of value a code starts.
type Kind uint8

// Value kinds. Int is any integer encoding, signed or not.
const (
	KindInvalid Kind = iota // 0xc1, never used by the format
	KindNil
	KindBool
	KindInt
	KindFloat
	KindStr
	KindBin
	KindArray
	KindMap
	KindExt
)

var kindNames = [...]string{"invalid", "nil", "bool", "int", "float", "str", "bin", "array", "map", "ext"}

func (k Kind) String() string { return kindNames[k] }

// KindOf returns the kind of value code c starts.
func KindOf(c byte) Kind {
	switch {
	case c <= 0x7f || c >= 0xe0:
		return KindInt
	case c <= 0x8f:
		return KindMap
	case c <= 0x9f:
		return KindArray
	case c <= 0xbf:
		return KindStr
	}
	return codeKinds[c-0xc0]
}

var codeKinds = [32]Kind{
	KindNil, KindInvalid, KindBool, KindBool,
	KindBin, KindBin, KindBin,
	KindExt, KindExt, KindExt,
	KindFloat, KindFloat,
	KindInt, KindInt, KindInt, KindInt, KindInt, KindInt, KindInt, KindInt,
	KindExt, KindExt, KindExt, KindExt, KindExt,
	KindStr, KindStr, KindStr,
	KindArray, KindArray,
	KindMap, KindMap,
}

// Reader reads msgpack values from a byte slice. The zero value reads an
// empty input.
type Reader struct {
	b []byte
	i int
}

// Reset makes r read b from its start.
func (r *Reader) Reset(b []byte) { r.b, r.i = b, 0 }

// Pos is the offset of the next byte to read.
func (r *Reader) Pos() int { return r.i }

// Seek moves r to offset pos, one Pos returned before.
func (r *Reader) Seek(pos int) { r.i = pos }

// Len is the number of bytes left.
func (r *Reader) Len() int { return len(r.b) - r.i }

// Since returns the input from offset pos to the current position: the raw
// encoding of the values read since Pos returned pos. It aliases the input.
func (r *Reader) Since(pos int) []byte { return r.b[pos:r.i:r.i] }

// Peek returns the code of the next value without reading it.
func (r *Reader) Peek() (byte, error) {
	if r.i >= len(r.b) {
		return 0, fmt.Errorf("msgpack: no value left: %w", io.ErrUnexpectedEOF)
	}
	return r.b[r.i], nil
}

// Nil reads a nil and reports true if the next value is one; otherwise it
// reads nothing.
func (r *Reader) Nil() bool {
	if r.i < len(r.b) && r.b[r.i] == Nil {
		r.i++
		return true
	}
	return false
}

func (r *Reader) typeError(want string) error {
	if r.i >= len(r.b) {
		return fmt.Errorf("msgpack: no value left, want %s: %w", want, io.ErrUnexpectedEOF)
	}
	c := r.b[r.i]
	return fmt.Errorf("%w: not %s (code 0x%02x: %s)", ErrType, want, c, KindOf(c))
}

func truncated(what string) error {
	return fmt.Errorf("msgpack: %s cut short: %w", what, io.ErrUnexpectedEOF)
}

// be reads the n-byte big-endian number after the code at r.i; the caller
// checked that the bytes are there.
func (r *Reader) be(n int) uint64 {
	var v uint64
	for _, x := range r.b[r.i+1 : r.i+1+n] {
		v = v<<8 | uint64(x)
	}
	return v
}

// header reads the code and the n-byte length after it.
func (r *Reader) header(n int, what string) (uint64, error) {
	if r.Len() < 1+n {
		return 0, truncated(what + " header")
	}
	v := r.be(n)
	r.i += 1 + n
	return v, nil
}

// ArrayLen reads an array header. The length is at most the bytes left, as
// each element takes one byte or more.
func (r *Reader) ArrayLen() (int, error) {
	return r.containerLen(0x90, 0xdc, "an array", "array", "items", 1)
}

// MapLen reads a map header. The length is at most half the bytes left, as
// each entry takes two bytes or more.
func (r *Reader) MapLen() (int, error) {
	return r.containerLen(0x80, 0xde, "a map", "map", "entries", 2)
}

// containerLen reads the header of an array or a map (want, for a type
// error): fix is its fix family's tag (length in the low 4 bits), c16 its
// 16-bit form's (the 32-bit one follows), and each of its n items takes
// at least per bytes.
func (r *Reader) containerLen(fix, c16 byte, want, kind, items string, per int) (int, error) {
	if r.i >= len(r.b) {
		return 0, r.typeError(want)
	}
	var n uint64
	var err error
	switch c := r.b[r.i]; {
	case c&0xf0 == fix:
		n = uint64(c & 0x0f)
		r.i++
	case c == c16:
		n, err = r.header(2, kind)
	case c == c16+1:
		n, err = r.header(4, kind)
	default:
		return 0, r.typeError(want)
	}
	if err != nil {
		return 0, err
	}
	if n > uint64(r.Len()/per) {
		return 0, fmt.Errorf("msgpack: %s of %d %s in %d bytes: %w", kind, n, items, r.Len(), io.ErrUnexpectedEOF)
	}
	return int(n), nil
}

func (r *Reader) body(n uint64, what string) ([]byte, error) {
	if n > uint64(r.Len()) {
		return nil, fmt.Errorf("msgpack: %s of %d bytes declared, %d left: %w", what, n, r.Len(), io.ErrUnexpectedEOF)
	}
	end := r.i + int(n)
	s := r.b[r.i:end:end]
	r.i = end
	return s, nil
}

// Str reads a str value; the bytes alias the input.
func (r *Reader) Str() ([]byte, error) {
	if r.i >= len(r.b) {
		return nil, r.typeError("a str")
	}
	var n uint64
	var err error
	switch c := r.b[r.i]; {
	case c&0xe0 == 0xa0:
		n = uint64(c & 0x1f)
		r.i++
	case c == 0xd9:
		n, err = r.header(1, "str")
	case c == 0xda:
		n, err = r.header(2, "str")
	case c == 0xdb:
		n, err = r.header(4, "str")
	default:
		return nil, r.typeError("a str")
	}
	if err != nil {
		return nil, err
	}
	return r.body(n, "str")
}

// Bin reads a bin value; the bytes alias the input.
func (r *Reader) Bin() ([]byte, error) {
	if r.i >= len(r.b) {
		return nil, r.typeError("a bin")
	}
	var n uint64
	var err error
	switch r.b[r.i] {
	case 0xc4:
		n, err = r.header(1, "bin")
	case 0xc5:
		n, err = r.header(2, "bin")
	case 0xc6:
		n, err = r.header(4, "bin")
	default:
		return nil, r.typeError("a bin")
	}
	if err != nil {
		return nil, err
	}
	return r.body(n, "bin")
}

// Bytes reads a str or a bin value; the bytes alias the input.
func (r *Reader) Bytes() ([]byte, error) {
	if r.i < len(r.b) {
		switch KindOf(r.b[r.i]) {
		case KindBin:
			return r.Bin()
		case KindStr:
			return r.Str()
		}
	}
	return nil, r.typeError("a str or bin")
}

// Bool reads a bool.
func (r *Reader) Bool() (bool, error) {
	if r.i < len(r.b) {
		switch r.b[r.i] {
		case True:
			r.i++
			return true, nil
		case False:
			r.i++
			return false, nil
		}
	}
	return false, r.typeError("a bool")
}

// intSize is the number of bytes after an integer code, and whether the
// code is a signed one; -1 for a code that is no integer.
func intSize(c byte) (n int, signed bool) {
	switch c {
	case Uint8:
		return 1, false
	case Uint16:
		return 2, false
	case Uint32:
		return 4, false
	case Uint64:
		return 8, false
	case Int8:
		return 1, true
	case Int16:
		return 2, true
	case Int32:
		return 4, true
	case Int64:
		return 8, true
	}
	return -1, false
}

// Uint reads a non-negative integer in any encoding, signed or not.
func (r *Reader) Uint() (uint64, error) {
	if r.i < len(r.b) && r.b[r.i] <= 0x7f {
		v := r.b[r.i]
		r.i++
		return uint64(v), nil
	}
	return r.uintSlow()
}

func (r *Reader) uintSlow() (uint64, error) {
	if r.i >= len(r.b) {
		return 0, r.typeError("an integer")
	}
	c := r.b[r.i]
	if c >= 0xe0 {
		return 0, fmt.Errorf("%w: negative integer %d", ErrRange, int8(c))
	}
	n, signed := intSize(c)
	if n < 0 {
		return 0, r.typeError("an integer")
	}
	if r.Len() < 1+n {
		return 0, truncated("integer")
	}
	v := r.be(n)
	if signed && v>>(uint(n)*8-1) != 0 {
		return 0, fmt.Errorf("%w: negative integer %d", ErrRange, signExtend(v, n))
	}
	r.i += 1 + n
	return v, nil
}

func signExtend(v uint64, n int) int64 {
	shift := 64 - uint(n)*8
	return int64(v<<shift) >> shift
}

// Int reads an integer in any encoding that fits an int64.
func (r *Reader) Int() (int64, error) {
	if r.i >= len(r.b) {
		return 0, r.typeError("an integer")
	}
	c := r.b[r.i]
	if c <= 0x7f || c >= 0xe0 {
		r.i++
		return int64(int8(c)), nil
	}
	n, signed := intSize(c)
	if n < 0 {
		return 0, r.typeError("an integer")
	}
	if r.Len() < 1+n {
		return 0, truncated("integer")
	}
	v := r.be(n)
	if !signed && v > math.MaxInt64 {
		return 0, fmt.Errorf("%w: integer %d beyond int64", ErrRange, v)
	}
	r.i += 1 + n
	if signed {
		return signExtend(v, n), nil
	}
	return int64(v), nil
}

// Word reads an integer in any encoding as its 64-bit two's-complement
// pattern: a negative one as uint64(int64(v)), a non-negative one as
// itself. Engines that publish hashes as signed int64 (SGLang,
// TensorRT-LLM) send half of them negative; read this way they are the
// same 64 bits an unsigned producer would send.
func (r *Reader) Word() (uint64, error) {
	if r.i < len(r.b) && r.b[r.i] == Uint64 {
		return r.Uint()
	}
	v, err := r.Int()
	return uint64(v), err
}

// Float reads a float32, a float64 or an integer as a float64.
func (r *Reader) Float() (float64, error) {
	if r.i >= len(r.b) {
		return 0, r.typeError("a number")
	}
	switch r.b[r.i] {
	case Float32:
		if r.Len() < 5 {
			return 0, truncated("float32")
		}
		v := math.Float32frombits(uint32(r.be(4)))
		r.i += 5
		return float64(v), nil
	case Float64:
		if r.Len() < 9 {
			return 0, truncated("float64")
		}
		v := math.Float64frombits(r.be(8))
		r.i += 9
		return v, nil
	}
	if KindOf(r.b[r.i]) != KindInt {
		return 0, r.typeError("a number")
	}
	if r.b[r.i] == Uint64 {
		u, err := r.Uint()
		return float64(u), err
	}
	v, err := r.Int()
	return float64(v), err
}

// Uint32s reads len(dst) integers into dst, each non-negative and within
// 32 bits: the elements of an array whose header was read. The usual
// encodings are decoded inline, for token ids.
func (r *Reader) Uint32s(dst []uint32) error {
	b, i := r.b, r.i
	for j := range dst {
		if i+5 <= len(b) {
			switch c := b[i]; {
			case c <= 0x7f:
				dst[j] = uint32(c)
				i++
				continue
			case c == Uint8:
				dst[j] = uint32(b[i+1])
				i += 2
				continue
			case c == Uint16:
				dst[j] = uint32(binary.BigEndian.Uint16(b[i+1:]))
				i += 3
				continue
			case c == Uint32:
				dst[j] = binary.BigEndian.Uint32(b[i+1:])
				i += 5
				continue
			}
		}
		r.i = i
		v, err := r.Uint()
		if err != nil {
			return err
		}
		if v > math.MaxUint32 {
			r.i = i
			return fmt.Errorf("%w: %d beyond 32 bits", ErrRange, v)
		}
		dst[j] = uint32(v)
		i = r.i
	}
	r.i = i
	return nil
}

// Uint64s reads non-negative integers into dst, the elements of an array
// whose header was read, until dst is full or a value is not one. It
// returns how many it read; on an error the reader stands at the value
// refused, so a caller that takes other types too can read it and carry
// on. uint64 encodings, which Python gives integers of 2^56 and above
// (hashes), are decoded inline.
func (r *Reader) Uint64s(dst []uint64) (int, error) {
	for j := range dst {
		if r.i+9 <= len(r.b) && r.b[r.i] == Uint64 {
			dst[j] = binary.BigEndian.Uint64(r.b[r.i+1:])
			r.i += 9
			continue
		}
		v, err := r.Uint()
		if err != nil {
			return j, err
		}
		dst[j] = v
	}
	return len(dst), nil
}

// Words is Uint64s for integers of either sign, each read as Word reads
// it: the block hashes of signed producers, half of them negative, in one
// pass without an error per value. int64 and uint64 encodings are decoded
// inline.
func (r *Reader) Words(dst []uint64) (int, error) {
	for j := range dst {
		if r.i+9 <= len(r.b) {
			if c := r.b[r.i]; c == Uint64 || c == Int64 {
				dst[j] = binary.BigEndian.Uint64(r.b[r.i+1:])
				r.i += 9
				continue
			}
		}
		v, err := r.Word()
		if err != nil {
			return j, err
		}
		dst[j] = v
	}
	return len(dst), nil
}

// Skip reads one value of any type, in place. maxDepth bounds the arrays
// and maps the value may nest, so that a hostile input cannot recurse
// deeply: Skip(0) takes scalars only, Skip(1) also an array or a map of
// scalars.
func (r *Reader) Skip(maxDepth int) error {
	if r.i >= len(r.b) {
		return truncated("value")
	}
	c := r.b[r.i]
	switch KindOf(c) {
	case KindArray, KindMap:
		if maxDepth <= 0 {
			return fmt.Errorf("%w: a container beyond the nesting allowed", ErrDepth)
		}
		var n int
		var err error
		if KindOf(c) == KindArray {
			n, err = r.ArrayLen()
		} else {
			n, err = r.MapLen()
			n *= 2
		}
		if err != nil {
			return err
		}
		for range n {
			if err := r.Skip(maxDepth - 1); err != nil {
				return err
			}
		}
		return nil
	case KindStr, KindBin:
		_, err := r.Bytes()
		return err
	case KindExt:
		return r.skipExt(c)
	case KindInvalid:
		return fmt.Errorf("%w: code 0x%02x is never used", ErrType, c)
	case KindNil, KindBool:
		r.i++
		return nil
	case KindFloat:
		n := 4
		if c == Float64 {
			n = 8
		}
		if r.Len() < 1+n {
			return truncated("float")
		}
		r.i += 1 + n
		return nil
	}
	// KindInt.
	n, _ := intSize(c)
	n = max(n, 0)
	if r.Len() < 1+n {
		return truncated("integer")
	}
	r.i += 1 + n
	return nil
}

// skipExt skips an extension value: code, length, type byte, body.
func (r *Reader) skipExt(c byte) error {
	var n uint64
	hdr := 0
	switch c {
	case 0xd4:
		n = 1
	case 0xd5:
		n = 2
	case 0xd6:
		n = 4
	case 0xd7:
		n = 8
	case 0xd8:
		n = 16
	case 0xc7:
		hdr = 1
	case 0xc8:
		hdr = 2
	case 0xc9:
		hdr = 4
	}
	if r.Len() < 1+hdr {
		return truncated("extension header")
	}
	if hdr > 0 {
		n = r.be(hdr)
	}
	left := r.Len() - 2 - hdr // after the code, the length and the type byte
	if left < 0 || n > uint64(left) {
		return fmt.Errorf("msgpack: extension of %d bytes declared, %d left: %w", n, max(left, 0), io.ErrUnexpectedEOF)
	}
	r.i += 2 + hdr + int(n)
	return nil
}
