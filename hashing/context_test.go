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
