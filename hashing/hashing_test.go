package hashing

import (
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"
)

func TestNewFillsDefaultsAndRejectsBadConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want Config
		err  error
	}{
		{name: "zero value is vLLM's default", cfg: Config{}, want: Config{Algo: SHA256, Seed: DefaultSeed, BlockSize: 16}},
		{name: "cbor keeps default seed", cfg: Config{Algo: SHA256CBOR, BlockSize: 32}, want: Config{Algo: SHA256CBOR, Seed: DefaultSeed, BlockSize: 32}},
		{name: "content keeps default seed", cfg: Config{Algo: Content}, want: Config{Algo: Content, Seed: DefaultSeed, BlockSize: 16}},
		{name: "xxhash with seed", cfg: Config{Algo: XXHash, Seed: "7", BlockSize: 1}, want: Config{Algo: XXHash, Seed: "7", BlockSize: 1}},
		{name: "a non-empty seed needs no SeedSet", cfg: Config{Seed: "7", SeedSet: true}, want: Config{Algo: SHA256, Seed: "7", BlockSize: 16}},
		{name: "set empty seed stays empty", cfg: Config{SeedSet: true}, want: Config{Algo: SHA256, Seed: "", SeedSet: true, BlockSize: 16}},
		{name: "xxhash accepts a set empty seed", cfg: Config{Algo: XXHash, SeedSet: true}, want: Config{Algo: XXHash, Seed: "", SeedSet: true, BlockSize: 16}},
		{name: "xxhash without seed", cfg: Config{Algo: XXHash}, err: ErrSeedRequired},
		{name: "xxhash_cbor without seed", cfg: Config{Algo: XXHashCBOR}, err: ErrSeedRequired},
		{name: "unknown algorithm", cfg: Config{Algo: "md5"}, err: ErrUnknownAlgo},
		{name: "algorithm names are case-sensitive", cfg: Config{Algo: "SHA256"}, err: ErrUnknownAlgo},
		{name: "negative block size", cfg: Config{BlockSize: -1}, err: ErrBlockSize},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, err := New(tt.cfg)
			if tt.err != nil {
				require.ErrorIs(t, err, tt.err)
				require.Nil(t, h)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, h.Config())
		})
	}
}

// The digests below are CPython's: hashlib.sha256 over pickle.dumps(x,
// protocol=5) and over the CBOR text string "" (0x60), as vLLM's
// init_none_hash computes NONE_HASH for PYTHONHASHSEED="" and
// hash_block_tokens chains blocks 1..16 and 17..32 on it.
func TestEmptySeedHashesTheEmptyStringAsVLLMDoes(t *testing.T) {
	h, err := New(Config{SeedSet: true})
	require.NoError(t, err)
	require.Equal(t, "3279c4b947f331d055c47442171c9ea17712596bd7fe094c31d4a5d432b42d68", h.Root().String())
	tokens := make([]uint32, 32)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	blocks, err := h.Blocks(nil, Request{Tokens: tokens})
	require.NoError(t, err)
	require.Len(t, blocks, 2)
	require.Equal(t, "f2fc3e5a419b0b01356d6038570bcb3e853f2e1d0bc00a43e395e2413d9ea970", blocks[0].Digest.String())
	require.Equal(t, uint64(16399262387974089072), blocks[0].Key)
	require.Equal(t, uint64(11753778797769314332), blocks[1].Key)

	cbor, err := New(Config{Algo: SHA256CBOR, SeedSet: true})
	require.NoError(t, err)
	require.Equal(t, "8d33f520a3c4cef80d2453aef81b612bfe1cb44c8b2025630ad38662763f13d3", cbor.Root().String())

	var unset Hasher
	require.NotEqual(t, unset.Root(), h.Root(), "an unset seed is DefaultSeed, not the empty string")
	explicit, err := New(Config{Seed: DefaultSeed})
	require.NoError(t, err)
	require.Equal(t, unset.Root(), explicit.Root())
}

func TestRequestErrors(t *testing.T) {
	h, err := New(Config{BlockSize: 2})
	require.NoError(t, err)
	tokens := []uint32{1, 2, 3, 4, 5}
	tests := []struct {
		name string
		req  Request
		err  error
	}{
		{name: "extra shorter than the full blocks", req: Request{Tokens: tokens, Extra: [][]ExtraKey{nil}}, err: ErrExtraKeys},
		{name: "extra with a LoRA name", req: Request{Tokens: tokens, LoRAName: "a", Extra: [][]ExtraKey{nil, nil}}, err: ErrExtraMode},
		{name: "extra with a salt", req: Request{Tokens: tokens, CacheSalt: "s", Extra: [][]ExtraKey{nil, nil}}, err: ErrExtraMode},
		{name: "extra with mm items", req: Request{Tokens: tokens, MM: []MMItem{{ID: "x"}}, Extra: [][]ExtraKey{nil, nil}}, err: ErrExtraMode},
		{name: "negative mm offset", req: Request{Tokens: tokens, MM: []MMItem{{ID: "x", Offset: -1, Length: 2}}}, err: ErrMMItem},
		{name: "negative mm length", req: Request{Tokens: tokens, MM: []MMItem{{ID: "x", Offset: 1, Length: -2}}}, err: ErrMMItem},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			keys, err := h.BlockKeys(make([]uint64, 3), tt.req)
			require.ErrorIs(t, err, tt.err)
			require.Empty(t, keys)
			blocks, err := h.Blocks(nil, tt.req)
			require.ErrorIs(t, err, tt.err)
			require.Empty(t, blocks)
			_, err = h.NewPrefix(tt.req)
			require.ErrorIs(t, err, tt.err)
		})
	}
}

func TestExtraLongerThanBlocksIsAccepted(t *testing.T) {
	h, err := New(Config{BlockSize: 2})
	require.NoError(t, err)
	short, err := h.BlockKeys(nil, Request{Tokens: []uint32{1, 2}, Extra: [][]ExtraKey{{Str("a")}}})
	require.NoError(t, err)
	long, err := h.BlockKeys(nil, Request{Tokens: []uint32{1, 2, 3}, Extra: [][]ExtraKey{{Str("a")}, {Str("b")}}})
	require.NoError(t, err)
	require.Equal(t, short, long)
}

func TestEmptyExtraTupleHashesAsNone(t *testing.T) {
	h, err := New(Config{BlockSize: 2})
	require.NoError(t, err)
	tokens := []uint32{1, 2, 3, 4}
	none, err := h.BlockKeys(nil, Request{Tokens: tokens})
	require.NoError(t, err)
	empty, err := h.BlockKeys(nil, Request{Tokens: tokens, Extra: [][]ExtraKey{{}, nil}})
	require.NoError(t, err)
	require.Equal(t, none, empty)
}

// randomRequest draws a request with non-overlapping multimodal items, and
// sometimes a LoRA name and a cache salt.
func randomRequest(r *rand.Rand, bs int) Request {
	req := Request{Tokens: make([]uint32, r.IntN(12*bs))}
	for i := range req.Tokens {
		req.Tokens[i] = r.Uint32() >> r.IntN(32)
	}
	if r.IntN(2) == 0 {
		req.LoRAName = "lora-" + strconv.Itoa(r.IntN(3))
	}
	if r.IntN(2) == 0 {
		req.CacheSalt = "salt-" + strconv.Itoa(r.IntN(3))
	}
	pos := r.IntN(2 * bs)
	for pos < len(req.Tokens)+bs && r.IntN(4) != 0 {
		n := 1 + r.IntN(3*bs)
		req.MM = append(req.MM, MMItem{ID: "mm-" + strconv.Itoa(pos), Offset: pos, Length: n})
		pos += n + r.IntN(2*bs)
	}
	return req
}

// bruteExtra is an independent model of a block's extra keys for
// non-overlapping items: the LoRA name, every item that overlaps the block,
// the salt on block 0.
func bruteExtra(req Request, start, end int) []ExtraKey {
	var out []ExtraKey
	if req.LoRAName != "" {
		out = append(out, Str(req.LoRAName))
	}
	for _, it := range req.MM {
		if it.Offset < end && it.Offset+it.Length > start {
			out = append(out, Tuple(Str(it.ID), Int(int64(it.Offset-start))))
		}
	}
	if start == 0 && req.CacheSalt != "" {
		out = append(out, Str(req.CacheSalt))
	}
	return out
}

func TestDerivedExtraKeysMatchBruteForce(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for range 300 {
		bs := 1 + r.IntN(8)
		h, err := New(Config{Algo: SHA256CBOR, BlockSize: bs})
		require.NoError(t, err)
		req := randomRequest(r, bs)
		blocks, err := h.Blocks(nil, req)
		require.NoError(t, err)
		require.Len(t, blocks, len(req.Tokens)/bs)
		for i, b := range blocks {
			want := bruteExtra(req, i*bs, i*bs+bs)
			require.True(t, EqualKeys(want, b.Extra), "block %d of %+v: want %v, got %v", i, req, want, b.Extra)
		}
	}
}

func TestUnsortedMMIsSortedInACopy(t *testing.T) {
	h, err := New(Config{BlockSize: 4})
	require.NoError(t, err)
	tokens := make([]uint32, 32)
	sorted := []MMItem{{ID: "a", Offset: 2, Length: 3}, {ID: "b", Offset: 9, Length: 9}, {ID: "c", Offset: 20, Length: 1}}
	unsorted := []MMItem{sorted[2], sorted[0], sorted[1]}
	orig := slices.Clone(unsorted)
	want, err := h.BlockKeys(nil, Request{Tokens: tokens, MM: sorted})
	require.NoError(t, err)
	got, err := h.BlockKeys(nil, Request{Tokens: tokens, MM: unsorted})
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.Equal(t, orig, unsorted)
}

// TestMMCursorFollowsVLLMForNestedItems pins vLLM's cursor walk where it
// differs from plain overlap: an item nested in an open item is not reported
// until the outer item ends, and it never is if it ends first.
func TestMMCursorFollowsVLLMForNestedItems(t *testing.T) {
	items := []MMItem{{ID: "outer", Offset: 0, Length: 20}, {ID: "inner", Offset: 5, Length: 3}, {ID: "next", Offset: 22, Length: 4}}
	var c mmCursor
	var got [][]string
	for start := 0; start < 32; start += 8 {
		var ids []string
		for _, k := range c.advance(nil, items, start, start+8) {
			ids = append(ids, items[k].ID)
		}
		got = append(got, ids)
	}
	require.Equal(t, [][]string{{"outer"}, {"outer"}, {"outer", "next"}, {"next"}}, got)
}

func TestBlockKeysAllocatesNothingWithRoomInDst(t *testing.T) {
	// The race detector makes sync.Pool drop items on purpose, so there a
	// call may allocate its scratch memory; still nothing per block (a
	// call hashes 256), which make test, running only under -race, checks.
	var limit float64
	if raceEnabled {
		limit = 8
	}
	req := Request{Tokens: benchTokens()[:4096], LoRAName: "lora", CacheSalt: "salt",
		MM: []MMItem{{ID: "img", Offset: 100, Length: 300}, {ID: "img2", Offset: 1000, Length: 30}}}
	for _, algo := range Algos {
		t.Run(string(algo), func(t *testing.T) {
			h, err := New(Config{Algo: algo, Seed: "1"})
			require.NoError(t, err)
			dst, err := h.BlockKeys(nil, req)
			require.NoError(t, err)
			plain := Request{Tokens: req.Tokens}
			allocs := testing.AllocsPerRun(20, func() {
				dst, _ = h.BlockKeys(dst, req)
				dst, _ = h.BlockKeys(dst, plain)
			})
			require.LessOrEqual(t, allocs, limit)
		})
	}
}

func TestHasherIsSafeForConcurrentUse(t *testing.T) {
	h, err := New(Config{Algo: XXHashCBOR, Seed: "9"})
	require.NoError(t, err)
	req := Request{Tokens: benchTokens()[:1024], LoRAName: "x"}
	want, err := h.BlockKeys(nil, req)
	require.NoError(t, err)
	errs := make(chan error, 4)
	for range 4 {
		go func() {
			var dst []uint64
			for range 50 {
				dst, _ = h.BlockKeys(dst, req)
				if !slices.Equal(want, dst) {
					errs <- strconv.ErrRange
					return
				}
			}
			errs <- nil
		}()
	}
	for range 4 {
		require.NoError(t, <-errs)
	}
}

// contentReference encodes a Content block independently of content.go, from
// the layout documented in doc.go.
func contentReference(parent uint64, tokens []uint32, extra []ExtraKey) uint64 {
	var enc func(b []byte, k ExtraKey) []byte
	enc = func(b []byte, k ExtraKey) []byte {
		switch k.Kind() {
		case KindStr, KindBytes:
			tag, v := byte(1), k.StrValue()
			if k.Kind() == KindBytes {
				tag, v = 3, string(k.BytesValue())
			}
			b = append(b, tag)
			b = binary.LittleEndian.AppendUint32(b, uint32(len(v)))
			return append(b, v...)
		case KindInt:
			return binary.LittleEndian.AppendUint64(append(b, 2), uint64(k.IntValue()))
		}
		b = binary.LittleEndian.AppendUint32(append(b, 4), uint32(len(k.Elems())))
		for _, e := range k.Elems() {
			b = enc(b, e)
		}
		return b
	}
	b := binary.LittleEndian.AppendUint64(nil, parent)
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	if len(extra) == 0 {
		b = append(b, 0)
	} else {
		b = enc(b, Tuple(extra...))
	}
	return xxhash.Sum64(b)
}

func TestContentKeysFollowTheDocumentedEncoding(t *testing.T) {
	h, err := New(Config{Algo: Content, Seed: "s", BlockSize: 3})
	require.NoError(t, err)
	require.Equal(t, xxhash.Sum64String("s"), h.Root().Key())
	req := Request{Tokens: []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, LoRAName: "l", CacheSalt: "c",
		MM: []MMItem{{ID: "m", Offset: 2, Length: 3}}}
	blocks, err := h.Blocks(nil, req)
	require.NoError(t, err)
	require.Len(t, blocks, 3)
	parent := h.Root().Key()
	for i, b := range blocks {
		want := contentReference(parent, req.Tokens[3*i:3*i+3], b.Extra)
		require.Equal(t, want, b.Key, "block %d", i)
		require.Equal(t, want, b.Digest.Key())
		require.Equal(t, 8, b.Digest.Len())
		parent = want
	}
	explicit := Request{Tokens: req.Tokens, Extra: [][]ExtraKey{{Bytes([]byte{0, 1}), Int(-7), Tuple()}, nil, {Tuple(Str("x"), Tuple(Int(1)))}}}
	keys, err := h.BlockKeys(nil, explicit)
	require.NoError(t, err)
	parent = h.Root().Key()
	for i, k := range keys {
		want := contentReference(parent, req.Tokens[3*i:3*i+3], explicit.Extra[i])
		require.Equal(t, want, k, "explicit block %d", i)
		parent = want
	}
}

func TestBlockKeysFromContinuesIntegerChains(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, algo := range []Algo{Content, SHA256CBOR64} {
		t.Run(string(algo), func(t *testing.T) {
			for range 50 {
				bs := 1 + r.IntN(6)
				h, err := New(Config{Algo: algo, BlockSize: bs})
				require.NoError(t, err)
				req := randomRequest(r, bs)
				keys, err := h.BlockKeys(nil, req)
				require.NoError(t, err)
				if len(keys) < 2 {
					continue
				}
				k := 1 + r.IntN(len(keys)-1)
				rest := Request{Tokens: req.Tokens[k*bs:], LoRAName: req.LoRAName, CacheSalt: req.CacheSalt}
				for _, it := range req.MM {
					if it.Offset+it.Length > k*bs {
						it.Offset -= k * bs
						rest.MM = append(rest.MM, it)
					}
				}
				got, err := h.BlockKeysFrom(nil, keys[k-1], rest)
				require.NoError(t, err)
				require.Equal(t, keys[k:], got)
			}
		})
	}
}

func TestBlockKeysFromNeedsDigestForByteChains(t *testing.T) {
	for _, algo := range []Algo{SHA256, SHA256CBOR, XXHash, XXHashCBOR} {
		h, err := New(Config{Algo: algo, Seed: "1"})
		require.NoError(t, err)
		_, err = h.BlockKeysFrom(nil, 42, Request{Tokens: make([]uint32, 32)})
		require.ErrorIs(t, err, ErrNeedDigest, algo)
	}
}

func TestBlocksFromContinuesEveryAlgorithm(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	for _, algo := range Algos {
		h, err := New(Config{Algo: algo, Seed: "x", BlockSize: 4})
		require.NoError(t, err)
		tokens := make([]uint32, 40)
		for i := range tokens {
			tokens[i] = r.Uint32()
		}
		extra := make([][]ExtraKey, 10)
		for i := range extra {
			extra[i] = []ExtraKey{Str("lora"), Int(int64(i))}
		}
		all, err := h.Blocks(nil, Request{Tokens: tokens, Extra: extra})
		require.NoError(t, err)
		rest, err := h.BlocksFrom(nil, all[3].Digest, Request{Tokens: tokens[16:], Extra: extra[4:]})
		require.NoError(t, err)
		require.Equal(t, all[4:], rest, algo)
		_, err = h.BlocksFrom(nil, digest64(1), Request{Tokens: tokens})
		if h.Root().Len() != 8 {
			require.Error(t, err, algo)
		}
	}
}

func TestDigestKeyAndParse(t *testing.T) {
	d, err := ParseDigest("00112233445566778899aabbccddeeff")
	require.NoError(t, err)
	require.Equal(t, uint64(0x8899aabbccddeeff), d.Key())
	require.Equal(t, "00112233445566778899aabbccddeeff", d.String())
	require.Equal(t, 16, d.Len())
	short, err := DigestOf([]byte{1, 2})
	require.NoError(t, err)
	require.Equal(t, uint64(0x0102), short.Key())
	for _, bad := range []string{"", "zz", "0", string(make([]byte, 66))} {
		_, err := ParseDigest(bad)
		require.Error(t, err, "%q", bad)
	}
}

func TestExtraKeyStringAndJSON(t *testing.T) {
	k := Tuple(Str("a\"b"), Int(-3), Bytes([]byte{0xab}), Tuple(Str("x")), Tuple())
	require.Equal(t, `("a\"b", -3, b'\xab', ("x",), ())`, k.String())
	js, err := k.MarshalJSON()
	require.NoError(t, err)
	require.JSONEq(t, `["a\"b", -3, {"hex": "ab"}, ["x"], []]`, string(js))
	require.True(t, k.Equal(Tuple(Str("a\"b"), Int(-3), Bytes([]byte{0xab}), Tuple(Str("x")), Tuple())))
	require.False(t, k.Equal(Tuple(Str("a\"b"))))
	require.False(t, Str("1").Equal(Bytes([]byte("1"))))
}
