package events

import (
	"fmt"

	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/kvsource/kvsource/hashing"
)

// ExtraKeys converts one block's extra-keys tuple, as an Event's ExtraKeys
// entry holds it (raw msgpack), into the elements hashing.Request.Extra
// takes. A nil entry (None) gives nil.
func ExtraKeys(raw []byte) ([]hashing.ExtraKey, error) {
	if raw == nil {
		return nil, nil
	}
	return NewDecoder().extraKeyTuple(raw)
}

// extraKeyTuple is ExtraKeys reusing d, for a caller that converts tuples on
// every event.
func (d *Decoder) extraKeyTuple(raw []byte) ([]hashing.ExtraKey, error) {
	d.init()
	d.r = payloadReader{b: raw}
	d.md.ResetReader(&d.r)
	n, err := d.arrayLen("extra keys", false, maxBlocks)
	if err != nil {
		return nil, err
	}
	keys := make([]hashing.ExtraKey, n)
	for i := range keys {
		if keys[i], err = d.extraKey(1); err != nil {
			return nil, err
		}
	}
	if d.r.remaining() != 0 {
		return nil, d.errorf("trailing bytes after extra keys")
	}
	return keys, nil
}

func (d *Decoder) extraKey(depth int) (hashing.ExtraKey, error) {
	if depth > maxDepth {
		return hashing.ExtraKey{}, d.errorf("extra key nesting deeper than %d", maxDepth)
	}
	c, err := d.peek("extra key")
	if err != nil {
		return hashing.ExtraKey{}, err
	}
	switch {
	case msgpcode.IsString(c):
		s, err := d.str("extra key")
		return hashing.Str(string(s)), err
	case msgpcode.IsBin(c):
		b, err := d.str("extra key")
		return hashing.Bytes(b), err
	case isInt(c):
		v, err := d.md.DecodeInt64()
		if err != nil {
			return hashing.ExtraKey{}, d.wrap("extra key", err)
		}
		if c == msgpcode.Uint64 && v < 0 {
			return hashing.ExtraKey{}, d.errorf("extra key integer beyond int64")
		}
		return hashing.Int(v), nil
	case isArray(c):
		n, err := d.arrayLen("extra key", false, maxBlocks)
		if err != nil {
			return hashing.ExtraKey{}, err
		}
		elems := make([]hashing.ExtraKey, n)
		for i := range elems {
			if elems[i], err = d.extraKey(depth + 1); err != nil {
				return hashing.ExtraKey{}, err
			}
		}
		return hashing.Tuple(elems...), nil
	}
	return hashing.ExtraKey{}, fmt.Errorf("%w: extra key of unsupported type (code 0x%02x)", ErrMalformed, c)
}
