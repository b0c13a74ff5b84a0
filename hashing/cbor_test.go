package hashing

import (
	"encoding/binary"
	"encoding/hex"
	"strconv"
	"testing"

	"github.com/fxamacker/cbor/v2"
	"github.com/stretchr/testify/require"
)

// fuzzKeys decodes extra keys from fuzz bytes: 's' len payload (str),
// 'b' len payload (bytes), 'i' 8 bytes (int), 't' count elems... (tuple).
// Running out of input ends the current tuple.
func fuzzKeys(data []byte, depth int) (keys []ExtraKey, rest []byte) {
	for len(data) > 0 {
		op := data[0]
		data = data[1:]
		switch op % 4 {
		case 0, 2:
			if len(data) == 0 {
				return keys, nil
			}
			n := min(int(data[0]), len(data)-1)
			payload := data[1 : 1+n]
			data = data[1+n:]
			if op%4 == 0 {
				keys = append(keys, Str(string(payload)))
			} else {
				keys = append(keys, Bytes(payload))
			}
		case 1:
			var v [8]byte
			n := copy(v[:], data)
			data = data[n:]
			keys = append(keys, Int(int64(binary.LittleEndian.Uint64(v[:]))))
		case 3:
			if depth > 4 || len(data) == 0 {
				return keys, data
			}
			count := int(data[0] % 6)
			var elems []ExtraKey
			elems, data = fuzzKeys(data[1:], depth+1)
			elems = elems[:min(count, len(elems))]
			keys = append(keys, Tuple(elems...))
		}
	}
	return keys, nil
}

// encodeFuzzKeys is the inverse of fuzzKeys for keys whose strings are
// shorter than 256 bytes and tuples shorter than 6, for seeding the corpus.
func encodeFuzzKeys(keys []ExtraKey) []byte {
	var b []byte
	for _, k := range keys {
		switch k.kind {
		case KindStr:
			b = append(b, 0, byte(len(k.s)))
			b = append(b, k.s...)
		case KindBytes:
			b = append(b, 2, byte(len(k.s)))
			b = append(b, k.s...)
		case KindInt:
			b = append(b, 1)
			b = binary.LittleEndian.AppendUint64(b, uint64(k.i))
		case KindTuple:
			b = append(b, 3, byte(len(k.elems)))
			b = append(b, encodeFuzzKeys(k.elems)...)
		}
	}
	return b
}

// reference builds the value vLLM hashes from plain Go values, for an
// independent CBOR encoder.
func reference(k ExtraKey) any {
	switch k.kind {
	case KindStr:
		return k.s
	case KindInt:
		return k.i
	case KindBytes:
		return []byte(k.s)
	default:
		out := make([]any, len(k.elems))
		for i, e := range k.elems {
			out[i] = reference(e)
		}
		return out
	}
}

// canonical is fxamacker/cbor's canonical mode: shortest heads, definite
// lengths, the deterministic encoding cbor2 produces with canonical=True.
var canonical = func() cbor.EncMode {
	em, err := cbor.CanonicalEncOptions().EncMode()
	if err != nil {
		panic(err)
	}
	return em
}()

func referenceCBOR(t testing.TB, parent Digest, intParent bool, tokens []uint32, keys []ExtraKey) []byte {
	var p any = parent.Bytes()
	if intParent {
		p = parent.Key()
	}
	var extra any
	if len(keys) > 0 {
		extra = reference(Tuple(keys...))
	}
	b, err := canonical.Marshal([]any{p, tokens, extra})
	require.NoError(t, err)
	return b
}

func fuzzTokens(raw []byte) []uint32 {
	tokens := make([]uint32, 0, len(raw)/4+1)
	for len(raw) >= 4 {
		tokens = append(tokens, binary.LittleEndian.Uint32(raw))
		raw = raw[4:]
	}
	if len(tokens) == 0 {
		tokens = append(tokens, 0)
	}
	return tokens
}

func FuzzCBOR(f *testing.F) {
	for i, v := range loadVectors(f) {
		if i%7 != 0 || len(v.Blocks) == 0 {
			continue
		}
		raw := make([]byte, 0, 4*v.BlockSize)
		for _, tok := range v.Tokens[:v.BlockSize] {
			raw = binary.LittleEndian.AppendUint32(raw, tok)
		}
		f.Add(raw, encodeFuzzKeys(parseExtraJSON(f, v.Blocks[0].ExtraKeys)), v.Algo == SHA256CBOR64)
	}
	edgeTokens := []byte{23, 0, 0, 0, 24, 0, 0, 0, 0xff, 0xff, 0, 0, 0, 0, 1, 0, 0xff, 0xff, 0xff, 0xff}
	edgeKeys := encodeFuzzKeys([]ExtraKey{Int(-1), Int(-24), Int(-25), Int(-1 << 63), Tuple(), Bytes(nil), Str("")})
	f.Add(edgeTokens, edgeKeys, false)
	f.Add(append(edgeTokens, 0), edgeKeys, false) // odd length: a 16-byte parent
	f.Fuzz(func(t *testing.T, rawTokens, rawKeys []byte, intParent bool) {
		tokens := fuzzTokens(rawTokens)
		keys, _ := fuzzKeys(rawKeys, 0)
		parent := digest64(uint64(len(rawKeys))*0x9e3779b97f4a7c15 + 1)
		if !intParent {
			// XXH3-128 chains 16-byte digests, the SHA-256 algorithms 32.
			parent = Digest{n: 32}
			if len(rawTokens)%2 == 1 {
				parent.n = 16
			}
			copy(parent.b[:parent.n], rawKeys)
		}
		ex := &extraSource{explicit: true, keys: keys}
		got := appendCBORBlock(nil, &parent, intParent, tokens, ex)
		require.Equal(t, hex.EncodeToString(referenceCBOR(t, parent, intParent, tokens, keys)), hex.EncodeToString(got))
	})
}

func TestCBORSeedIsTextString(t *testing.T) {
	for _, s := range []string{"", "42", "seed-with-üñî", string(make([]byte, 300))} {
		want, err := canonical.Marshal(s)
		require.NoError(t, err)
		require.Equal(t, want, appendCBORString(nil, s), strconv.Quote(s))
	}
}
