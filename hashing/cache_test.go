package hashing

import (
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// traceConv is one conversation of a random trace: its request so far.
type traceConv struct {
	h   int // index of its Hasher
	req Request
}

// traceGen makes random multi-turn conversations, forks and repeats over
// several Hasher configurations, with LoRA names, salts, multimodal items
// (empty ones included) and explicit extra keys.
type traceGen struct {
	r      *rand.Rand
	convs  []traceConv
	hs     []*Hasher
	shared []uint32 // a system prompt many conversations start with
}

func newTraceGen(t *testing.T, seed uint64) *traceGen {
	g := &traceGen{r: rand.New(rand.NewPCG(seed, seed+1))}
	for _, cfg := range []Config{
		{},
		{BlockSize: 4},
		{Algo: SHA256CBOR, BlockSize: 4},
		{Algo: SHA256CBOR, Seed: "other", BlockSize: 4},
		{Algo: XXHash, Seed: "7", BlockSize: 3},
		{Algo: Content, BlockSize: 4},
		{Algo: SHA256CBOR64, BlockSize: 1},
	} {
		h, err := New(cfg)
		require.NoError(t, err)
		g.hs = append(g.hs, h)
	}
	g.shared = g.tokens(200)
	return g
}

func (g *traceGen) tokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(g.r.IntN(50)) // a small vocabulary makes lookalike blocks
	}
	return out
}

// grow appends tokens, and sometimes multimodal items inside them, to req.
func (g *traceGen) grow(req *Request, n int) {
	start := len(req.Tokens)
	req.Tokens = append(req.Tokens, g.tokens(n)...)
	if req.Extra != nil {
		for len(req.Extra) < len(req.Tokens) { // at least one tuple per block of any size
			var tup []ExtraKey
			if g.r.IntN(3) == 0 {
				tup = []ExtraKey{Str("e" + strconv.Itoa(g.r.IntN(2))), Int(int64(g.r.IntN(3)))}
			}
			req.Extra = append(req.Extra, tup)
		}
		return
	}
	for g.r.IntN(3) == 0 && n > 0 {
		off := start + g.r.IntN(n)
		length := g.r.IntN(20) // 0 makes an item of no extra key that still moves the cursor
		req.MM = append(req.MM, MMItem{ID: "img-" + strconv.Itoa(g.r.IntN(4)), Offset: off, Length: length})
		slices.SortStableFunc(req.MM, func(a, b MMItem) int { return a.Offset - b.Offset })
	}
}

func (g *traceGen) newConv() traceConv {
	c := traceConv{h: g.r.IntN(len(g.hs))}
	switch g.r.IntN(6) {
	case 0:
		c.req.LoRAName = "lora-" + strconv.Itoa(g.r.IntN(2))
	case 1:
		c.req.CacheSalt = "salt-" + strconv.Itoa(g.r.IntN(2))
	case 2:
		c.req.Extra = [][]ExtraKey{}
	}
	if g.r.IntN(2) == 0 {
		c.req.Tokens = slices.Clone(g.shared[:g.r.IntN(len(g.shared))])
		if c.req.Extra != nil {
			g.grow(&c.req, 0)
		}
	}
	g.grow(&c.req, g.r.IntN(100))
	return c
}

// next returns the next request of the trace and its Hasher.
func (g *traceGen) next() (*Hasher, Request) {
	var c traceConv
	switch k := g.r.IntN(10); {
	case len(g.convs) == 0 || k < 2:
		c = g.newConv()
	case k < 6: // the next turn
		i := g.r.IntN(len(g.convs))
		c = g.convs[i]
		c.req = cloneRequest(c.req)
		g.grow(&c.req, g.r.IntN(80))
	case k < 8: // a fork from a random point of a conversation
		c = g.convs[g.r.IntN(len(g.convs))]
		c.req = cloneRequest(c.req)
		cut := g.r.IntN(len(c.req.Tokens) + 1)
		c.req.Tokens = c.req.Tokens[:cut]
		c.req.MM = slices.DeleteFunc(c.req.MM, func(it MMItem) bool { return it.Offset >= cut })
		g.grow(&c.req, g.r.IntN(80))
	case k < 9: // the same request again
		c = g.convs[g.r.IntN(len(g.convs))]
	default: // the same tokens through another Hasher
		c = g.convs[g.r.IntN(len(g.convs))]
		c.h = g.r.IntN(len(g.hs))
	}
	if len(g.convs) < 64 {
		g.convs = append(g.convs, c)
	} else {
		g.convs[g.r.IntN(len(g.convs))] = c
	}
	return g.hs[c.h], c.req
}

func cloneRequest(r Request) Request {
	r.Tokens = slices.Clone(r.Tokens)
	r.MM = slices.Clone(r.MM)
	if r.Extra != nil {
		r.Extra = slices.Clone(r.Extra)
	}
	return r
}

func TestCacheBlockKeysEqualBlockKeysOnRandomTraces(t *testing.T) {
	for _, maxBytes := range []int64{16 << 10, 128 << 10, DefaultCacheBytes} {
		t.Run(strconv.FormatInt(maxBytes, 10), func(t *testing.T) {
			c := NewCache(CacheConfig{MaxBytes: maxBytes})
			g := newTraceGen(t, uint64(maxBytes))
			var got []uint64
			for step := range 3000 {
				h, req := g.next()
				want, wantErr := h.BlockKeys(nil, req)
				var err error
				got, err = c.BlockKeys(h, got, req)
				require.Equal(t, wantErr, err, "step %d", step)
				require.True(t, slices.Equal(want, got), "step %d: %+v: got %v, want %v", step, h.Config(), got, want)
			}
			st := c.Stats()
			t.Logf("%+v", st)
			require.Positive(t, st.HitBlocks, "the trace's turns and forks should hit")
			require.Positive(t, st.MissBlocks)
			require.LessOrEqual(t, st.Bytes, maxBytes)
			if maxBytes < DefaultCacheBytes {
				require.Positive(t, st.Evictions)
			}
		})
	}
}

func TestCacheBlockKeysEqualBlockKeysConcurrently(t *testing.T) {
	c := NewCache(CacheConfig{MaxBytes: 32 << 10})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			g := newTraceGen(t, 100+uint64(w))
			var got []uint64
			for range 500 {
				h, req := g.next()
				want, wantErr := h.BlockKeys(nil, req)
				var err error
				got, err = c.BlockKeys(h, got, req)
				if !slices.Equal(want, got) || err != wantErr {
					t.Errorf("cached keys differ for %+v", h.Config())
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestCacheHashesOnlyTheNewBlocksOfTheNextTurn(t *testing.T) {
	h, err := New(Config{BlockSize: 4})
	require.NoError(t, err)
	var c Cache
	turn1 := Request{Tokens: make([]uint32, 4*70+2), LoRAName: "l", MM: []MMItem{{ID: "a", Offset: 9, Length: 30}}}
	for i := range turn1.Tokens {
		turn1.Tokens[i] = uint32(i)
	}
	_, err = c.BlockKeys(h, nil, turn1)
	require.NoError(t, err)
	require.Equal(t, CacheStats{Requests: 1, MissBlocks: 70, Chains: 1, Bytes: c.Stats().Bytes}, c.Stats())

	turn2 := cloneRequest(turn1)
	turn2.Tokens = append(turn2.Tokens, make([]uint32, 4*10)...)
	keys, err := c.BlockKeys(h, nil, turn2)
	require.NoError(t, err)
	want, err := h.BlockKeys(nil, turn2)
	require.NoError(t, err)
	require.Equal(t, want, keys)
	st := c.Stats()
	require.Equal(t, int64(70), st.HitBlocks, "the first turn's blocks")
	require.Equal(t, int64(70+10), st.MissBlocks)

	// A fork inside the chain rehashes from the checkpoint before it.
	fork := cloneRequest(turn1)
	fork.Tokens = append(fork.Tokens[:4*40], 99, 99, 99, 99)
	_, err = c.BlockKeys(h, nil, fork)
	require.NoError(t, err)
	require.Equal(t, int64(70+32), c.Stats().HitBlocks)
}

func TestCacheKeepsHasherConfigurationsApart(t *testing.T) {
	var c Cache
	tokens := make([]uint32, 64)
	for _, cfg := range []Config{{}, {Seed: "x"}, {Algo: SHA256CBOR}, {BlockSize: 8}, {BlockSize: 8, Algo: Content}} {
		h, err := New(cfg)
		require.NoError(t, err)
		_, err = c.BlockKeys(h, nil, Request{Tokens: tokens})
		require.NoError(t, err)
	}
	require.Zero(t, c.Stats().HitBlocks)
}

func TestNilCacheHashesWithoutCaching(t *testing.T) {
	var c *Cache
	h, err := New(Config{BlockSize: 2})
	require.NoError(t, err)
	req := Request{Tokens: []uint32{1, 2, 3, 4, 5}}
	got, err := c.BlockKeys(h, nil, req)
	require.NoError(t, err)
	want, err := h.BlockKeys(nil, req)
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.Equal(t, CacheStats{}, c.Stats())
}

func TestCacheBlockKeysRejectsWhatBlockKeysRejects(t *testing.T) {
	var c Cache
	h, err := New(Config{BlockSize: 2})
	require.NoError(t, err)
	_, err = c.BlockKeys(h, make([]uint64, 3), Request{Tokens: []uint32{1, 2, 3, 4}, Extra: [][]ExtraKey{nil}})
	require.ErrorIs(t, err, ErrExtraKeys)
	_, err = c.BlockKeys(h, nil, Request{Tokens: []uint32{1, 2}, MM: []MMItem{{Offset: -1}}})
	require.ErrorIs(t, err, ErrMMItem)
	require.Zero(t, c.Stats().Requests)
}

// A warm call allocates only the chain it remembers: its keys, digests,
// table entries and their high halves, and the chain itself; the content
// pass's memory comes from the pool.
func TestCacheWarmCallAllocatesOnlyTheChainItRemembers(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items")
	}
	h, err := New(Config{})
	require.NoError(t, err)
	c := NewCache(CacheConfig{})
	req := Request{Tokens: make([]uint32, 4096)}
	for i := range req.Tokens {
		req.Tokens[i] = uint32(i)
	}
	dst, err := c.BlockKeys(h, nil, req)
	require.NoError(t, err)
	turn := uint32(0)
	allocs := testing.AllocsPerRun(50, func() {
		turn++
		req.Tokens[len(req.Tokens)-100] = 1<<31 | turn // a new last turn
		dst, _ = c.BlockKeys(h, dst, req)
	})
	require.LessOrEqual(t, allocs, 5.0)
}

// On a big-endian machine the plain content pass converts the tokens
// before hashing them: the same keys as the hasher's, and the same hits.
func TestCachePlainPassAgreesWhenTokensAreConverted(t *testing.T) {
	defer func(le bool) { littleEndian = le }(littleEndian)
	littleEndian = false
	h, err := New(Config{})
	require.NoError(t, err)
	c := NewCache(CacheConfig{})
	r := rand.New(rand.NewPCG(21, 22))
	base := make([]uint32, 128*16)
	for i := range base {
		base[i] = r.Uint32N(150000)
	}
	// The base, then copies of it each with one token changed anywhere: a
	// content key that missed any token's bytes would take a copy for
	// the base past the change.
	for turn := range 50 {
		toks := slices.Clone(base)
		if turn > 0 {
			toks[r.IntN(len(toks))] ^= 1 << 20
		}
		req := Request{Tokens: toks}
		want, err := h.BlockKeys(nil, req)
		require.NoError(t, err)
		got, err := c.BlockKeys(h, nil, req)
		require.NoError(t, err)
		require.Equal(t, want, got, "turn %d", turn)
	}
	require.Positive(t, c.Stats().HitBlocks, "the converted content keys match one another")
}
