package events

import (
	"encoding/binary"
	"math"
)

// Layout is the wire layout of events in a batch.
type Layout uint8

const (
	// LayoutMap is vLLM >= 0.26: each event a map with a "type" key, fields
	// equal to their default omitted.
	LayoutMap Layout = iota
	// LayoutArray is vLLM <= 0.25: each event a positional array led by its
	// type tag.
	LayoutArray
)

func (l Layout) String() string {
	if l == LayoutArray {
		return "array"
	}
	return "map"
}

// AppendBatch appends the msgpack encoding of b in the given layout to dst.
// trim, when positive, keeps only the first trim fields of each array-layout
// event, as older vLLM releases sent (5 for v0.9). Unknown events are not
// encoded.
func AppendBatch(dst []byte, b *Batch, layout Layout, trim int) []byte {
	n := 0
	for i := range b.Events {
		if b.Events[i].Type != EventUnknown {
			n++
		}
	}
	if b.DPRank.ok {
		dst = append(dst, 0x93)
	} else {
		dst = append(dst, 0x92)
	}
	dst = append(dst, 0xcb)
	dst = binary.BigEndian.AppendUint64(dst, math.Float64bits(b.TS))
	dst = appendArrayLen(dst, n)
	for i := range b.Events {
		e := &b.Events[i]
		if e.Type == EventUnknown {
			continue
		}
		if layout == LayoutArray {
			dst = appendArrayEvent(dst, e, trim)
		} else {
			dst = appendMapEvent(dst, e)
		}
	}
	if rank, ok := b.DPRank.Get(); ok {
		dst = appendInt(dst, int64(rank))
	}
	return dst
}

func appendArrayEvent(dst []byte, e *Event, trim int) []byte {
	var nf int
	switch e.Type {
	case EventBlockStored:
		nf = 11
	case EventBlockRemoved:
		nf = 3
	}
	if trim > 0 && trim < nf {
		nf = trim
	}
	dst = appendArrayLen(dst, nf+1)
	dst = appendStr(dst, e.Type.String())
	if e.Type == EventBlockRemoved {
		for f := range nf {
			switch f {
			case 0:
				dst = appendHashes(dst, e.BlockHashes)
			case 1:
				dst = appendStr(dst, medium(e))
			case 2:
				dst = appendOptInt(dst, e.GroupIdx)
			}
		}
		return dst
	}
	for f := range nf {
		switch f {
		case fHashes:
			dst = appendHashes(dst, e.BlockHashes)
		case fParent:
			dst = appendOptUint(dst, e.Parent)
		case fTokens:
			dst = appendTokens(dst, e.TokenIDs)
		case fBlockSize:
			dst = appendInt(dst, int64(e.BlockSize))
		case fLoRAID:
			dst = appendOptInt(dst, e.LoRAID)
		case fMedium:
			dst = appendStr(dst, medium(e))
		case fLoRAName:
			dst = appendOptStr(dst, e.LoRAName)
		case fExtraKeys:
			dst = appendExtraKeys(dst, e)
		case fGroupIdx:
			dst = appendOptInt(dst, e.GroupIdx)
		default: // kv_cache_spec_kind, kv_cache_spec_sliding_window
			dst = append(dst, 0xc0)
		}
	}
	return dst
}

func appendMapEvent(dst []byte, e *Event) []byte {
	switch e.Type {
	case EventAllBlocksCleared:
		dst = append(dst, 0x81)
		return appendStr(appendStr(dst, "type"), e.Type.String())
	case EventBlockRemoved:
		n := 3
		if e.GroupIdx.ok {
			n++
		}
		dst = appendStr(appendStr(append(dst, 0x80|byte(n)), "type"), e.Type.String())
		dst = appendHashes(appendStr(dst, "block_hashes"), e.BlockHashes)
		dst = appendStr(appendStr(dst, "medium"), medium(e))
		if e.GroupIdx.ok {
			dst = appendInt(appendStr(dst, "group_idx"), int64(e.GroupIdx.v))
		}
		return dst
	}
	n := 8
	if e.ExtraKeys.ok {
		n++
	}
	if e.GroupIdx.ok {
		n++
	}
	dst = appendStr(appendStr(append(dst, 0x80|byte(n)), "type"), e.Type.String())
	dst = appendHashes(appendStr(dst, "block_hashes"), e.BlockHashes)
	dst = appendOptUint(appendStr(dst, "parent_block_hash"), e.Parent)
	dst = appendTokens(appendStr(dst, "token_ids"), e.TokenIDs)
	dst = appendInt(appendStr(dst, "block_size"), int64(e.BlockSize))
	dst = appendOptInt(appendStr(dst, "lora_id"), e.LoRAID)
	dst = appendStr(appendStr(dst, "medium"), medium(e))
	dst = appendOptStr(appendStr(dst, "lora_name"), e.LoRAName)
	if e.ExtraKeys.ok {
		dst = appendExtraKeys(appendStr(dst, "extra_keys"), e)
	}
	if e.GroupIdx.ok {
		dst = appendInt(appendStr(dst, "group_idx"), int64(e.GroupIdx.v))
	}
	return dst
}

func medium(e *Event) string {
	if e.Medium == "" {
		return mediumGPU
	}
	return e.Medium
}

func appendExtraKeys(dst []byte, e *Event) []byte {
	if !e.ExtraKeys.ok {
		return append(dst, 0xc0)
	}
	dst = appendArrayLen(dst, len(e.ExtraKeys.v))
	for _, k := range e.ExtraKeys.v {
		if k == nil {
			dst = append(dst, 0xc0)
		} else {
			dst = append(dst, k...)
		}
	}
	return dst
}

func appendHashes(dst []byte, hs []uint64) []byte {
	dst = appendArrayLen(dst, len(hs))
	for _, h := range hs {
		dst = appendUint(dst, h)
	}
	return dst
}

func appendTokens(dst []byte, ts []uint32) []byte {
	dst = appendArrayLen(dst, len(ts))
	for _, t := range ts {
		dst = appendUint(dst, uint64(t))
	}
	return dst
}

func appendArrayLen(dst []byte, n int) []byte {
	switch {
	case n < 16:
		return append(dst, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(dst, 0xdd), uint32(n))
}

func appendStr(dst []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		dst = append(dst, 0xa0|byte(n))
	case n <= math.MaxUint8:
		dst = append(dst, 0xd9, byte(n))
	case n <= math.MaxUint16:
		dst = binary.BigEndian.AppendUint16(append(dst, 0xda), uint16(n))
	default:
		dst = binary.BigEndian.AppendUint32(append(dst, 0xdb), uint32(n))
	}
	return append(dst, s...)
}

func appendOptStr(dst []byte, s string) []byte {
	if s == "" {
		return append(dst, 0xc0)
	}
	return appendStr(dst, s)
}

// appendUint uses the smallest encoding, as Python's msgpack does.
func appendUint(dst []byte, v uint64) []byte {
	switch {
	case v <= 0x7f:
		return append(dst, byte(v))
	case v <= math.MaxUint8:
		return append(dst, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(dst, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(dst, 0xcf), v)
}

func appendInt(dst []byte, v int64) []byte {
	if v >= 0 {
		return appendUint(dst, uint64(v))
	}
	switch {
	case v >= -32:
		return append(dst, byte(v))
	case v >= math.MinInt8:
		return append(dst, 0xd0, byte(v))
	case v >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(dst, 0xd1), uint16(v))
	case v >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(dst, 0xd2), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(dst, 0xd3), uint64(v))
}

func appendOptUint(dst []byte, o Opt[uint64]) []byte {
	if !o.ok {
		return append(dst, 0xc0)
	}
	return appendUint(dst, o.v)
}

func appendOptInt(dst []byte, o Opt[int]) []byte {
	if !o.ok {
		return append(dst, 0xc0)
	}
	return appendInt(dst, int64(o.v))
}
