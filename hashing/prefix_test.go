package hashing

import (
	"math/rand/v2"
	"slices"
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

// forkState is a Prefix and, independently, everything appended to it.
type forkState struct {
	p      *Prefix
	tokens []uint32
	extra  [][]ExtraKey
	keys   []uint64 // Keys() when the fork was made
	frozen []uint64 // a copy of keys
}

// TestPrefixForksAndParentExtendIndependently interleaves Append, AddExtra
// and Clone over a prefix and its forks, whose slices often have spare
// capacity a fork could write into, and checks each against its own whole
// request hashed from scratch.
func TestPrefixForksAndParentExtendIndependently(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 14))
	for _, explicit := range []bool{false, true} {
		for range 150 {
			bs := 1 + r.IntN(5)
			h, err := New(Config{Algo: SHA256CBOR, BlockSize: bs})
			require.NoError(t, err)
			base := randomRequest(r, bs)
			req := base
			if explicit {
				req = Request{Tokens: base.Tokens, Extra: make([][]ExtraKey, len(base.Tokens)/bs)}
				for i := range req.Extra {
					req.Extra[i] = []ExtraKey{Int(r.Int64())}
				}
			}
			p, err := h.NewPrefix(req)
			require.NoError(t, err)
			forks := []*forkState{{p: p, tokens: slices.Clone(req.Tokens), extra: slices.Clone(req.Extra)}}
			for range 40 {
				f := forks[r.IntN(len(forks))]
				if r.IntN(4) == 0 {
					keys := f.p.Keys()
					forks = append(forks, &forkState{p: f.p.Clone(), tokens: slices.Clone(f.tokens),
						extra: slices.Clone(f.extra), keys: keys, frozen: slices.Clone(keys)})
					continue
				}
				add := make([]uint32, r.IntN(2*bs+1))
				for i := range add {
					add[i] = r.Uint32()
				}
				if explicit {
					var more [][]ExtraKey
					// Sometimes ahead of need: keys of blocks not hashed yet
					// must not be overwritten by another fork's AddExtra.
					for len(f.extra)+len(more) < (len(f.tokens)+len(add))/bs+r.IntN(3) {
						more = append(more, []ExtraKey{Int(r.Int64())})
					}
					require.NoError(t, f.p.AddExtra(more...))
					f.extra = append(f.extra, more...)
				}
				require.NoError(t, f.p.Append(add...))
				f.tokens = append(f.tokens, add...)
			}
			for i, f := range forks {
				whole := Request{Tokens: f.tokens, LoRAName: base.LoRAName, CacheSalt: base.CacheSalt, MM: base.MM}
				if explicit {
					whole = Request{Tokens: f.tokens, Extra: f.extra}
				}
				want, err := h.BlockKeys(nil, whole)
				require.NoError(t, err)
				require.Equal(t, want, f.p.Keys(), "fork %d", i)
				require.Equal(t, f.tokens[len(want)*bs:], append([]uint32{}, f.p.Pending()...), "fork %d pending", i)
				require.Equal(t, f.frozen, f.keys, "fork %d: Keys() taken at the fork changed", i)
			}
		}
	}
}
