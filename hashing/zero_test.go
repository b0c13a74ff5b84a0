package hashing

import (
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// zeroCase calls one exported method on a Hasher and a Prefix and returns
// what the caller observes.
type zeroCase struct {
	name string
	call func(h *Hasher, p *Prefix) (any, error)
}

// zeroRequest has every derived extra key and a partial last block.
var zeroRequest = Request{
	Tokens:    benchTokens()[:40],
	LoRAName:  "sql",
	CacheSalt: "tenant",
	MM:        []MMItem{{ID: "img", Offset: 10, Length: 12}},
}

var zeroCases = []zeroCase{
	{"Hasher.Config", func(h *Hasher, _ *Prefix) (any, error) { return h.Config(), nil }},
	{"Hasher.Root", func(h *Hasher, _ *Prefix) (any, error) { return h.Root(), nil }},
	{"Hasher.BlockKeys", func(h *Hasher, _ *Prefix) (any, error) { return h.BlockKeys(nil, zeroRequest) }},
	{"Hasher.Blocks", func(h *Hasher, _ *Prefix) (any, error) { return h.Blocks(nil, zeroRequest) }},
	{"Hasher.BlockKeysFrom", func(h *Hasher, _ *Prefix) (any, error) {
		return h.BlockKeysFrom(nil, 7, Request{Tokens: zeroRequest.Tokens})
	}},
	{"Hasher.BlocksFrom", func(h *Hasher, _ *Prefix) (any, error) {
		var parent Digest
		parent.n = sha256Size
		return h.BlocksFrom(nil, parent, Request{Tokens: zeroRequest.Tokens, LoRAName: "sql"})
	}},
	{"Hasher.BlocksFrom wrong parent size", func(h *Hasher, _ *Prefix) (any, error) {
		return h.BlocksFrom(nil, digest64(7), Request{Tokens: zeroRequest.Tokens})
	}},
	{"Hasher.NewPrefix", func(h *Hasher, _ *Prefix) (any, error) {
		p, err := h.NewPrefix(zeroRequest)
		if err != nil {
			return nil, err
		}
		return prefixState(p), nil
	}},
	{"Prefix.Append", func(_ *Hasher, p *Prefix) (any, error) {
		err := p.Append(zeroRequest.Tokens...)
		return prefixState(p), err
	}},
	{"Prefix.AddExtra", func(_ *Hasher, p *Prefix) (any, error) {
		err := p.AddExtra([]ExtraKey{Str("x")})
		return prefixState(p), err
	}},
	{"Prefix.AddMM", func(_ *Hasher, p *Prefix) (any, error) {
		err := p.AddMM(zeroRequest.MM...)
		if err != nil {
			return nil, err
		}
		err = p.Append(zeroRequest.Tokens...)
		return prefixState(p), err
	}},
	{"Prefix.AddMM invalid item", func(_ *Hasher, p *Prefix) (any, error) {
		err := p.AddMM(MMItem{ID: "bad", Offset: -1, Length: 1})
		return prefixState(p), err
	}},
	{"Prefix.Keys", func(_ *Hasher, p *Prefix) (any, error) { return p.Keys(), nil }},
	{"Prefix.Len", func(_ *Hasher, p *Prefix) (any, error) { return p.Len(), nil }},
	{"Prefix.Tokens", func(_ *Hasher, p *Prefix) (any, error) { return p.Tokens(), nil }},
	{"Prefix.Pending", func(_ *Hasher, p *Prefix) (any, error) { return p.Pending(), nil }},
	{"Prefix.Last", func(_ *Hasher, p *Prefix) (any, error) { return p.Last(), nil }},
	{"Prefix.Clone", func(_ *Hasher, p *Prefix) (any, error) {
		c := p.Clone()
		err := c.Append(zeroRequest.Tokens...)
		return []any{prefixState(c), prefixState(p)}, err
	}},
}

// prefixState is everything a caller can read from p.
func prefixState(p *Prefix) []any {
	return []any{p.Keys(), p.Len(), p.Tokens(), p.Pending(), p.Last()}
}

func TestZeroValuesBehaveAsDefaultHasherAndEmptyPrefix(t *testing.T) {
	for _, tc := range zeroCases {
		t.Run(tc.name, func(t *testing.T) {
			// Each case is the first use of fresh zero values, so every
			// method is checked as the one that initialises them.
			var zh Hasher
			var zp Prefix
			var got any
			var gotErr error
			require.NotPanics(t, func() { got, gotErr = tc.call(&zh, &zp) })

			h, err := New(Config{})
			require.NoError(t, err)
			p, err := h.NewPrefix(Request{})
			require.NoError(t, err)
			want, wantErr := tc.call(h, p)
			require.Equal(t, want, got)
			if wantErr == nil {
				require.NoError(t, gotErr)
			} else {
				require.EqualError(t, gotErr, wantErr.Error())
			}
		})
	}
}

func TestZeroValueErrorsAreTheSentinels(t *testing.T) {
	var h Hasher
	_, err := h.BlockKeysFrom(nil, 7, Request{Tokens: zeroRequest.Tokens})
	require.ErrorIs(t, err, ErrNeedDigest)
	var p Prefix
	require.ErrorIs(t, p.AddExtra([]ExtraKey{Str("x")}), ErrExtraMode)
	require.ErrorIs(t, p.AddMM(MMItem{Offset: -1}), ErrMMItem)
}

func TestZeroHasherMatchesDefaultConformanceVectors(t *testing.T) {
	n := 0
	for i, v := range loadVectors(t) {
		if v.Algo != SHA256 || v.Seed != DefaultSeed || v.BlockSize != DefaultBlockSize {
			continue
		}
		n++
		t.Run(v.name(i), func(t *testing.T) {
			var h Hasher
			require.Equal(t, v.NoneHash, h.Root().String())
			blocks, err := h.Blocks(nil, v.request())
			require.NoError(t, err)
			require.Len(t, blocks, len(v.Blocks))
			for j, want := range v.Blocks {
				require.Equal(t, want.Event, strconv.FormatUint(blocks[j].Key, 10), "block %d", j)
			}
			req := v.request()
			if req.LoRAName != "" || req.CacheSalt != "" {
				// A zero Prefix has neither; only requests without them extend one.
				return
			}
			var p Prefix
			require.NoError(t, p.AddMM(req.MM...))
			require.NoError(t, p.Append(v.Tokens...))
			require.Equal(t, p.Len(), len(blocks))
			for j, b := range blocks {
				require.Equal(t, b.Key, p.Keys()[j], "Prefix block %d", j)
			}
		})
	}
	require.Positive(t, n, "no vector of vLLM's default configuration")
}

func TestZeroHasherFirstUseIsSafeForConcurrentCallers(t *testing.T) {
	h, err := New(Config{})
	require.NoError(t, err)
	want, err := h.BlockKeys(nil, zeroRequest)
	require.NoError(t, err)
	var zero Hasher
	got := make([][]uint64, 4)
	errs := make([]error, 4)
	var wg sync.WaitGroup
	for i := range got {
		wg.Go(func() { got[i], errs[i] = zero.BlockKeys(nil, zeroRequest) })
	}
	wg.Wait()
	for i := range got {
		require.NoError(t, errs[i])
		require.Equal(t, want, got[i])
	}
}

func TestZeroHasherAllocatesNothingWithRoomInDst(t *testing.T) {
	// Under the race detector sync.Pool drops items on purpose, so a call
	// may allocate its scratch memory, but still nothing per block.
	var limit float64
	if raceEnabled {
		limit = 4
	}
	var h Hasher
	req := Request{Tokens: benchTokens()[:4096]}
	dst, err := h.BlockKeys(nil, req)
	require.NoError(t, err)
	allocs := testing.AllocsPerRun(20, func() { dst, _ = h.BlockKeys(dst, req) })
	require.LessOrEqual(t, allocs, limit)
}
