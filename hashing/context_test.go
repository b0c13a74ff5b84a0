package hashing

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBlockKeysContextEqualsBlockKeysWhenNotStopped(t *testing.T) {
	h, err := New(Config{})
	require.NoError(t, err)
	for _, req := range []Request{
		{Tokens: seqTokens(100 * 16)},
		{Tokens: seqTokens(100 * 16), LoRAName: "adapter", CacheSalt: "salt", MM: []MMItem{{ID: "img", Offset: 20, Length: 40}}},
	} {
		want, err := h.BlockKeys(nil, req)
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		got, err := h.BlockKeysContext(ctx, nil, req)
		cancel()
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
}

func TestBlockKeysContextStopsBeforeHashingWhenDone(t *testing.T) {
	h, err := New(Config{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	keys, err := h.BlockKeysContext(ctx, nil, Request{Tokens: seqTokens(64 * 16)})
	require.ErrorIs(t, err, ErrStopped)
	require.ErrorIs(t, err, context.Canceled)
	require.Empty(t, keys)
}

// A prompt whose every block hashes a 4 MiB LoRA name takes about a
// minute to hash; a deadline stops it between blocks, with the keys so far
// a prefix of the whole prompt's.
func TestBlockKeysContextStopsCostlyPromptsAtTheDeadline(t *testing.T) {
	h, err := New(Config{})
	require.NoError(t, err)
	req := Request{Tokens: seqTokens(4096 * 16), LoRAName: strings.Repeat("x", 4<<20)}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	keys, err := h.BlockKeysContext(ctx, nil, req)
	elapsed := time.Since(start)
	require.ErrorIs(t, err, ErrStopped)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, len(keys), 4096)
	// Each block costs a few ms of SHA-256 here; a check per block bounds
	// the overrun to one, the rest is the machine's noise.
	require.Less(t, elapsed, 2*time.Second)
	prefix := req
	prefix.Tokens = req.Tokens[:len(keys)*16]
	want, err := h.BlockKeys(nil, prefix)
	require.NoError(t, err)
	require.Equal(t, want, keys)
}

func seqTokens(n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(i)
	}
	return t
}

// Through a cache, a done context stops the blocks the cache must hash and
// leaves nothing remembered; remembered blocks are returned all the same.
func TestCacheBlockKeysContextStopsAndRemembersNothing(t *testing.T) {
	h, err := New(Config{})
	require.NoError(t, err)
	c := NewCache(CacheConfig{})
	turn1 := Request{Tokens: seqTokens(64 * 16)}
	turn2 := Request{Tokens: seqTokens(128 * 16)}
	want2, err := h.BlockKeys(nil, turn2)
	require.NoError(t, err)

	_, err = c.BlockKeys(h, nil, turn1)
	require.NoError(t, err)
	done, cancel := context.WithCancel(context.Background())
	cancel()
	keys, err := c.BlockKeysContext(done, h, nil, turn2)
	require.ErrorIs(t, err, ErrStopped)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, want2[:len(keys)], keys, "the keys so far are a prefix of the prompt's")
	require.GreaterOrEqual(t, len(keys), 64, "the remembered turn is returned")
	require.Less(t, len(keys), 128)

	before := c.Stats().Chains
	got, err := c.BlockKeysContext(context.Background(), h, nil, turn2)
	require.NoError(t, err)
	require.Equal(t, want2, got)
	require.Equal(t, before+1, c.Stats().Chains, "only the finished call is remembered")
}

// A prompt whose blocks carry kilobytes of extra keys is hashed uncached:
// the content pass would copy them into every block.
func TestCacheHashesPromptsWithLongExtraKeysUncached(t *testing.T) {
	h, err := New(Config{})
	require.NoError(t, err)
	c := NewCache(CacheConfig{})
	for _, req := range []Request{
		{Tokens: seqTokens(256 * 16), LoRAName: strings.Repeat("l", 4096)},
		{Tokens: seqTokens(256 * 16), MM: []MMItem{{ID: strings.Repeat("i", 300), Offset: 0, Length: 256 * 16}}},
		{Tokens: seqTokens(4 * 16), Extra: [][]ExtraKey{{Str(strings.Repeat("x", 300))}, nil, nil, nil}},
	} {
		want, err := h.BlockKeys(nil, req)
		require.NoError(t, err)
		got, err := c.BlockKeys(h, nil, req)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	require.Zero(t, c.Stats().Chains)
	short := Request{Tokens: seqTokens(4 * 16), LoRAName: "adapter-7", CacheSalt: "tenant"}
	_, err = c.BlockKeys(h, nil, short)
	require.NoError(t, err)
	require.Equal(t, 1, int(c.Stats().Chains), "short names are cached")
}
