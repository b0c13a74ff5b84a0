package hashing

import "encoding/binary"

// Tags of Content's encoding of extra keys.
const (
	ctNone  = 0
	ctStr   = 1
	ctInt   = 2
	ctBytes = 3
	ctTuple = 4
)

func appendContentData(b []byte, tag byte, s string) []byte {
	b = append(b, tag)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

func appendContentInt(b []byte, v int64) []byte {
	b = append(b, ctInt)
	return binary.LittleEndian.AppendUint64(b, uint64(v))
}

func appendContentKey(b []byte, k ExtraKey) []byte {
	switch k.kind {
	case KindStr:
		return appendContentData(b, ctStr, k.s)
	case KindInt:
		return appendContentInt(b, k.i)
	case KindBytes:
		return appendContentData(b, ctBytes, k.s)
	default:
		b = append(b, ctTuple)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(k.elems)))
		for _, e := range k.elems {
			b = appendContentKey(b, e)
		}
		return b
	}
}

// appendContentBlock appends Content's encoding of a block: the parent key
// (uint64 LE), each token (uint32 LE), then the extra keys: a None tag, or a
// tuple tag, a uint32 LE count and the tagged elements (str and bytes: tag,
// uint32 LE length, payload; int: tag, int64 LE).
func appendContentBlock(b []byte, parent uint64, tokens []uint32, ex *extraSource) []byte {
	b = binary.LittleEndian.AppendUint64(b, parent)
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	if ex.count() == 0 {
		return append(b, ctNone)
	}
	return appendContentExtra(b, ex)
}

// appendContentExtra appends Content's encoding of a block's extra keys,
// which are not None: the tuple tag, the count and the tagged elements.
func appendContentExtra(b []byte, ex *extraSource) []byte {
	n := ex.count()
	b = append(b, ctTuple)
	b = binary.LittleEndian.AppendUint32(b, uint32(n))
	if ex.explicit {
		for _, k := range ex.keys {
			b = appendContentKey(b, k)
		}
		return b
	}
	if ex.lora != "" {
		b = appendContentData(b, ctStr, ex.lora)
	}
	for _, k := range ex.mmIdx {
		it := ex.mm[k]
		b = append(b, ctTuple)
		b = binary.LittleEndian.AppendUint32(b, 2)
		b = appendContentData(b, ctStr, it.ID)
		b = appendContentInt(b, int64(it.Offset-ex.start))
	}
	if ex.salt != "" {
		b = appendContentData(b, ctStr, ex.salt)
	}
	return b
}
