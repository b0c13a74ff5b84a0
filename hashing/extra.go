package hashing

import (
	"encoding/hex"
	"encoding/json"
	"slices"
	"strconv"
)

// ExtraKey is one element of a block's extra-keys tuple: a str, an int, a
// bytes or a tuple of ExtraKeys, the Python types vLLM puts there. The zero
// ExtraKey is the empty str.
type ExtraKey struct {
	kind  ExtraKind
	i     int64
	s     string // str, or bytes' content
	elems []ExtraKey
}

// ExtraKind is the Python type of an ExtraKey.
type ExtraKind uint8

// The kinds of ExtraKey.
const (
	KindStr ExtraKind = iota
	KindInt
	KindBytes
	KindTuple
)

// Str returns a str extra key, such as a LoRA name or a cache salt.
func Str(s string) ExtraKey { return ExtraKey{kind: KindStr, s: s} }

// Int returns an int extra key, such as a multimodal item's offset.
func Int(v int64) ExtraKey { return ExtraKey{kind: KindInt, i: v} }

// Bytes returns a bytes extra key, such as a prompt-embedding digest. It
// copies b.
func Bytes(b []byte) ExtraKey { return ExtraKey{kind: KindBytes, s: string(b)} }

// Tuple returns a tuple extra key, such as a multimodal (identifier, offset)
// pair. It copies elems.
func Tuple(elems ...ExtraKey) ExtraKey {
	return ExtraKey{kind: KindTuple, elems: slices.Clone(elems)}
}

// Kind returns the key's type.
func (k ExtraKey) Kind() ExtraKind { return k.kind }

// StrValue returns the value of a str key, "" for other kinds.
func (k ExtraKey) StrValue() string {
	if k.kind != KindStr {
		return ""
	}
	return k.s
}

// IntValue returns the value of an int key, 0 for other kinds.
func (k ExtraKey) IntValue() int64 { return k.i }

// BytesValue returns a copy of a bytes key's value, nil for other kinds.
func (k ExtraKey) BytesValue() []byte {
	if k.kind != KindBytes {
		return nil
	}
	return []byte(k.s)
}

// Elems returns a tuple key's elements, nil for other kinds. The caller must
// not modify them.
func (k ExtraKey) Elems() []ExtraKey { return k.elems }

// Equal reports whether k and o are the same value.
func (k ExtraKey) Equal(o ExtraKey) bool {
	if k.kind != o.kind || k.i != o.i || k.s != o.s {
		return false
	}
	return EqualKeys(k.elems, o.elems)
}

// EqualKeys reports whether two extra-keys tuples are the same value. Nil and
// empty are both None.
func EqualKeys(a, b []ExtraKey) bool {
	return slices.EqualFunc(a, b, ExtraKey.Equal)
}

// String returns the key as a Python literal, strs double-quoted.
func (k ExtraKey) String() string { return string(k.appendRepr(nil)) }

func (k ExtraKey) appendRepr(b []byte) []byte {
	switch k.kind {
	case KindStr:
		return strconv.AppendQuote(b, k.s)
	case KindInt:
		return strconv.AppendInt(b, k.i, 10)
	case KindBytes:
		b = append(b, "b'"...)
		for i := 0; i < len(k.s); i++ {
			b = append(b, `\x`...)
			b = hex.AppendEncode(b, []byte{k.s[i]})
		}
		return append(b, '\'')
	default:
		b = append(b, '(')
		for i, e := range k.elems {
			if i > 0 {
				b = append(b, ", "...)
			}
			b = e.appendRepr(b)
		}
		if len(k.elems) == 1 {
			b = append(b, ',')
		}
		return append(b, ')')
	}
}

// MarshalJSON encodes a str as a JSON string, an int as a number, a tuple as
// an array and a bytes as {"hex": "<lowercase hex>"}.
func (k ExtraKey) MarshalJSON() ([]byte, error) {
	return k.appendJSON(nil), nil
}

func (k ExtraKey) appendJSON(b []byte) []byte {
	switch k.kind {
	case KindStr:
		s, _ := json.Marshal(k.s) // a string always marshals
		return append(b, s...)
	case KindInt:
		return strconv.AppendInt(b, k.i, 10)
	case KindBytes:
		b = append(b, `{"hex":"`...)
		b = hex.AppendEncode(b, []byte(k.s))
		return append(b, `"}`...)
	default:
		b = append(b, '[')
		for i, e := range k.elems {
			if i > 0 {
				b = append(b, ',')
			}
			b = e.appendJSON(b)
		}
		return append(b, ']')
	}
}

func cloneKeys(keys []ExtraKey) []ExtraKey {
	if len(keys) == 0 {
		return nil
	}
	return slices.Clone(keys)
}

// size is the bytes of k's strings, elements included, plus one a key.
func (k ExtraKey) size() int {
	n := 1 + len(k.s)
	for _, e := range k.elems {
		n += e.size()
	}
	return n
}
