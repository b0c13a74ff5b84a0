package hashing

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// appendInChunks feeds tokens to p in random chunks.
func appendInChunks(t *testing.T, r *rand.Rand, p *Prefix, tokens []uint32) {
	for len(tokens) > 0 {
		n := min(len(tokens), r.IntN(40))
		require.NoError(t, p.Append(tokens[:n]...))
		tokens = tokens[n:]
	}
}

func TestPrefixAppendInChunksEqualsBlockKeys(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	for _, algo := range Algos {
		t.Run(string(algo), func(t *testing.T) {
			for range 40 {
				bs := 1 + r.IntN(8)
				h, err := New(Config{Algo: algo, Seed: "s", BlockSize: bs})
				require.NoError(t, err)
				req := randomRequest(r, bs)
				want, err := h.BlockKeys(nil, req)
				require.NoError(t, err)
				split := r.IntN(len(req.Tokens) + 1)
				first := req
				first.Tokens = req.Tokens[:split]
				p, err := h.NewPrefix(first)
				require.NoError(t, err)
				appendInChunks(t, r, p, req.Tokens[split:])
				require.Equal(t, want, p.Keys())
				require.Equal(t, len(req.Tokens), p.Tokens())
				require.Equal(t, append([]uint32{}, req.Tokens[len(want)*bs:]...), append([]uint32{}, p.Pending()...))
				if len(want) > 0 {
					require.Equal(t, want[len(want)-1], p.Last().Key())
				} else {
					require.Equal(t, h.Root(), p.Last())
				}
			}
		})
	}
}

func TestPrefixClonesExtendIndependently(t *testing.T) {
	h, err := New(Config{BlockSize: 4})
	require.NoError(t, err)
	system := []uint32{1, 2, 3, 4, 5, 6}
	p, err := h.NewPrefix(Request{Tokens: system, LoRAName: "l"})
	require.NoError(t, err)
	a, b := p.Clone(), p.Clone()
	require.NoError(t, a.Append(10, 11, 12, 13, 14, 15))
	require.NoError(t, b.Append(20, 21))
	require.NoError(t, p.Append(30, 31, 32, 33, 34, 35, 36))

	for _, c := range []struct {
		p    *Prefix
		tail []uint32
	}{{a, []uint32{10, 11, 12, 13, 14, 15}}, {b, []uint32{20, 21}}, {p, []uint32{30, 31, 32, 33, 34, 35, 36}}} {
		want, err := h.BlockKeys(nil, Request{Tokens: append(append([]uint32{}, system...), c.tail...), LoRAName: "l"})
		require.NoError(t, err)
		require.Equal(t, want, c.p.Keys())
	}
	require.Equal(t, a.Keys()[0], b.Keys()[0], "the shared block")
}

func TestPrefixKeysAreStableAcrossAppends(t *testing.T) {
	h, err := New(Config{BlockSize: 2})
	require.NoError(t, err)
	p, err := h.NewPrefix(Request{Tokens: []uint32{1, 2, 3, 4}})
	require.NoError(t, err)
	keys := p.Keys()
	snapshot := append([]uint64(nil), keys...)
	clone := p.Clone()
	require.NoError(t, clone.Append(9, 9, 9, 9))
	require.NoError(t, p.Append(5, 6, 7, 8))
	require.Equal(t, snapshot, keys)
	require.NotEqual(t, clone.Keys()[2], p.Keys()[2])
}

func TestPrefixAddMMForLaterTokensMatchesWholeRequest(t *testing.T) {
	h, err := New(Config{BlockSize: 4})
	require.NoError(t, err)
	tokens := make([]uint32, 40)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	first := []MMItem{{ID: "img1", Offset: 2, Length: 5}}
	later := []MMItem{{ID: "img2", Offset: 22, Length: 9}, {ID: "img3", Offset: 18, Length: 2}}
	p, err := h.NewPrefix(Request{Tokens: tokens[:17], MM: first, CacheSalt: "s"})
	require.NoError(t, err)
	require.NoError(t, p.AddMM(later...))
	require.NoError(t, p.Append(tokens[17:]...))
	want, err := h.BlockKeys(nil, Request{Tokens: tokens, MM: append(append([]MMItem{}, first...), later...), CacheSalt: "s"})
	require.NoError(t, err)
	require.Equal(t, want, p.Keys())
}

func TestPrefixAddMMRejectsItemsInHashedBlocks(t *testing.T) {
	h, err := New(Config{BlockSize: 4})
	require.NoError(t, err)
	p, err := h.NewPrefix(Request{Tokens: make([]uint32, 10)})
	require.NoError(t, err)
	before := p.Clone()
	require.ErrorIs(t, p.AddMM(MMItem{ID: "late", Offset: 6, Length: 4}), ErrMMItem)
	require.ErrorIs(t, p.AddMM(MMItem{ID: "bad", Offset: -1, Length: 1}), ErrMMItem)
	require.NoError(t, p.Append(make([]uint32, 6)...))
	require.NoError(t, before.Append(make([]uint32, 6)...))
	require.Equal(t, before.Keys(), p.Keys(), "a rejected AddMM leaves the prefix unchanged")
	// An item in the pending partial block is accepted: no hashed block
	// covers it.
	q, err := h.NewPrefix(Request{Tokens: make([]uint32, 10)})
	require.NoError(t, err)
	require.NoError(t, q.AddMM(MMItem{ID: "pending", Offset: 9, Length: 2}))
}

func TestPrefixExplicitExtraNeedsKeysForEveryBlock(t *testing.T) {
	h, err := New(Config{Algo: SHA256CBOR, BlockSize: 2})
	require.NoError(t, err)
	extra := [][]ExtraKey{{Bytes([]byte{1})}, {Bytes([]byte{2})}, {Bytes([]byte{3})}}
	tokens := []uint32{1, 2, 3, 4, 5, 6}
	want, err := h.BlockKeys(nil, Request{Tokens: tokens, Extra: extra})
	require.NoError(t, err)

	p, err := h.NewPrefix(Request{Tokens: tokens[:3], Extra: extra[:1]})
	require.NoError(t, err)
	require.ErrorIs(t, p.Append(tokens[3:]...), ErrExtraKeys)
	require.Equal(t, want[:1], p.Keys(), "failed Append changes nothing")
	require.Equal(t, []uint32{3}, p.Pending())
	require.NoError(t, p.AddExtra(extra[1:]...))
	require.NoError(t, p.Append(tokens[3:]...))
	require.Equal(t, want, p.Keys())
	require.ErrorIs(t, p.AddMM(MMItem{ID: "x", Offset: 8, Length: 1}), ErrExtraMode)

	derived, err := h.NewPrefix(Request{Tokens: tokens})
	require.NoError(t, err)
	require.ErrorIs(t, derived.AddExtra(nil), ErrExtraMode)
}
