package events

import (
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/internal/msgpackr"
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
	d.r.Reset(raw)
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
	if d.r.Len() != 0 {
		return nil, d.errorf("trailing bytes after extra keys")
	}
	return keys, nil
}

func (d *Decoder) extraKey(depth int) (hashing.ExtraKey, error) {
	if depth > maxDepth {
		return hashing.ExtraKey{}, d.errorf("extra key nesting deeper than %d", maxDepth)
	}
	k, err := d.peek("extra key")
	if err != nil {
		return hashing.ExtraKey{}, err
	}
	switch k {
	case msgpackr.KindStr:
		s, err := d.str("extra key")
		return hashing.Str(string(s)), err
	case msgpackr.KindBin:
		b, err := d.str("extra key")
		return hashing.Bytes(b), err
	case msgpackr.KindInt:
		v, err := d.r.Int()
		if err != nil {
			return hashing.ExtraKey{}, d.wrap("extra key", err)
		}
		return hashing.Int(v), nil
	case msgpackr.KindArray:
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
	return hashing.ExtraKey{}, d.errorf("extra key of unsupported type %s", k)
}
