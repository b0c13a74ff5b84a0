package hashing

import (
	"bufio"
	"encoding/hex"
	"encoding/json"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

type engineVector struct {
	Algo      Algo              `json:"algo"`
	BlockSize int               `json:"block_size"`
	Tokens    []uint32          `json:"tokens"`
	CacheSalt string            `json:"cache_salt"`
	Keys      []json.RawMessage `json:"keys"`
	Hex       []string          `json:"hex"`
}

func loadEngineVectors(t testing.TB) []engineVector {
	t.Helper()
	f, err := os.Open("testdata/engines/engine_hash_vectors.jsonl")
	require.NoError(t, err)
	defer f.Close()
	var out []engineVector
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var v engineVector
		require.NoError(t, json.Unmarshal(sc.Bytes(), &v))
		out = append(out, v)
	}
	require.NoError(t, sc.Err())
	require.NotEmpty(t, out)
	return out
}

// wantKeys reads a vector's keys as events carry them: SGLang's signed
// int64 as its bit pattern, TensorRT-LLM's uint64 as decimal strings, and
// v2_sha256's hex digests by their first 8 bytes, as package events reads
// them.
func (v engineVector) wantKeys(t *testing.T) []uint64 {
	var out []uint64
	for _, raw := range v.Keys {
		var s string
		if json.Unmarshal(raw, &s) == nil {
			k, err := strconv.ParseUint(s, 10, 64)
			require.NoError(t, err)
			out = append(out, k)
			continue
		}
		k, err := strconv.ParseInt(string(raw), 10, 64)
		require.NoError(t, err)
		out = append(out, uint64(k))
	}
	for _, h := range v.Hex {
		b, err := hex.DecodeString(h)
		require.NoError(t, err)
		var k uint64
		for _, c := range b[:8] {
			k = k<<8 | uint64(c)
		}
		out = append(out, k)
	}
	return out
}

func TestEngineAlgosReproduceTheEnginesOwnKeys(t *testing.T) {
	seen := map[Algo]int{}
	for i, v := range loadEngineVectors(t) {
		h, err := New(Config{Algo: v.Algo, BlockSize: v.BlockSize})
		require.NoError(t, err)
		got, err := h.BlockKeys(nil, Request{Tokens: v.Tokens, CacheSalt: v.CacheSalt})
		require.NoError(t, err)
		require.Equal(t, v.wantKeys(t), got, "vector %d: %s, block size %d, %d tokens, salt %q", i, v.Algo, v.BlockSize, len(v.Tokens), v.CacheSalt)
		seen[v.Algo]++
		if v.Algo == SGLangEAGLE {
			continue
		}
		// Blocks and a Prefix built a token at a time agree with BlockKeys.
		blocks, err := h.Blocks(nil, Request{Tokens: v.Tokens, CacheSalt: v.CacheSalt})
		require.NoError(t, err)
		p, err := h.NewPrefix(Request{CacheSalt: v.CacheSalt})
		require.NoError(t, err)
		for _, tok := range v.Tokens {
			require.NoError(t, p.Append(tok))
		}
		require.Equal(t, got, p.Keys())
		for j, b := range blocks {
			require.Equal(t, got[j], b.Key)
			require.Equal(t, got[j], b.Digest.Key())
		}
	}
	for _, a := range EngineAlgos {
		require.Positive(t, seen[a], "no vectors for %s", a)
	}
}

func TestEngineAlgosHaveNoSeed(t *testing.T) {
	for _, a := range EngineAlgos {
		h, err := New(Config{Algo: a, Seed: "123", BlockSize: 4})
		require.NoError(t, err)
		d, err := New(Config{Algo: a, BlockSize: 4})
		require.NoError(t, err)
		tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}
		k1, err := h.BlockKeys(nil, Request{Tokens: tokens})
		require.NoError(t, err)
		k2, err := d.BlockKeys(nil, Request{Tokens: tokens})
		require.NoError(t, err)
		require.Equal(t, k2, k1, a)
		require.Empty(t, h.Config().Seed)
	}
}

func TestEngineAlgosRefuseWhatTheEngineDoesNotHashSo(t *testing.T) {
	reqs := map[string]Request{
		"lora name":  {Tokens: []uint32{1, 2}, LoRAName: "a"},
		"mm item":    {Tokens: []uint32{1, 2}, MM: []MMItem{{ID: "x", Offset: 0, Length: 1}}},
		"extra keys": {Tokens: []uint32{1, 2}, Extra: [][]ExtraKey{nil, nil}},
	}
	for _, a := range EngineAlgos {
		h, err := New(Config{Algo: a, BlockSize: 1})
		require.NoError(t, err)
		for name, req := range reqs {
			_, err := h.BlockKeys(nil, req)
			require.ErrorIs(t, err, ErrUnsupported, "%s with a %s", a, name)
			_, err = h.Blocks(nil, req)
			require.ErrorIs(t, err, ErrUnsupported, "%s with a %s", a, name)
		}
	}
	h, err := New(Config{Algo: SGLangEAGLE, BlockSize: 1})
	require.NoError(t, err)
	_, err = h.NewPrefix(Request{})
	require.ErrorIs(t, err, ErrUnsupported)
}

func TestEAGLEBlocksNeedTheTokenAfterThem(t *testing.T) {
	h, err := New(Config{Algo: SGLangEAGLE, BlockSize: 2})
	require.NoError(t, err)
	for n, want := range map[int]int{0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2} {
		keys, err := h.BlockKeys(nil, Request{Tokens: []uint32{1, 2, 3, 4, 5}[:n]})
		require.NoError(t, err)
		require.Len(t, keys, want, "%d tokens", n)
	}
	// The Cache hashes EAGLE prompts uncached, with the same keys.
	c := NewCache(CacheConfig{})
	tokens := []uint32{9, 8, 7, 6, 5, 4, 3}
	want, err := h.BlockKeys(nil, Request{Tokens: tokens})
	require.NoError(t, err)
	for range 2 {
		got, err := c.BlockKeys(h, nil, Request{Tokens: tokens})
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
}

func TestTRTV1ContinuesFromAnEventParent(t *testing.T) {
	h, err := New(Config{Algo: TRTV1, BlockSize: 2})
	require.NoError(t, err)
	tokens := []uint32{1, 2, 3, 4, 5, 6}
	all, err := h.BlockKeys(nil, Request{Tokens: tokens})
	require.NoError(t, err)
	rest, err := h.BlockKeysFrom(nil, all[0], Request{Tokens: tokens[2:]})
	require.NoError(t, err)
	require.Equal(t, all[1:], rest)
}
