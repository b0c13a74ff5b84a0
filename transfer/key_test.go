package transfer_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
)

func TestNewKeyAppendsTheGroupBigEndian(t *testing.T) {
	d := sha256.Sum256([]byte("block"))
	k := transfer.NewKey(d[:], 0x01020304)
	require.Len(t, k, 36)
	require.Equal(t, d[:], []byte(k.Digest()))
	require.Equal(t, []byte{1, 2, 3, 4}, []byte(k[32:]))
	require.Equal(t, uint32(0x01020304), k.Group())
	require.True(t, k.Valid())
	d[0] ^= 0xff
	require.NotEqual(t, d[0], k[0], "the key owns its bytes")
}

func TestUint64IsTheEventFormOfTheDigest(t *testing.T) {
	d := sha256.Sum256([]byte("block"))
	k := transfer.NewKey(d[:], 7)
	require.Equal(t, binary.BigEndian.Uint64(d[24:]), k.Uint64(), "last 8 digest bytes, big endian")

	e := transfer.KeyFromUint64(0xdeadbeefcafef00d, 2)
	require.Equal(t, []byte{0xde, 0xad, 0xbe, 0xef, 0xca, 0xfe, 0xf0, 0x0d, 0, 0, 0, 2}, []byte(e))
	require.Equal(t, uint64(0xdeadbeefcafef00d), e.Uint64())
	require.Equal(t, "deadbeefcafef00d/2", e.String())
}

func TestMalformedKeys(t *testing.T) {
	tests := []struct {
		name string
		k    transfer.Key
	}{{"nil", nil}, {"short", transfer.Key{1, 2}}, {"group only", transfer.Key{0, 0, 0, 1}}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.False(t, tt.k.Valid())
			require.Empty(t, tt.k.Digest())
			require.Zero(t, tt.k.Uint64())
		})
	}
	require.Equal(t, "invalid:0102", transfer.Key{1, 2}.String())
}

func TestOffloadKeysNameEachChunkByItsLastBlock(t *testing.T) {
	digests := make([][]byte, 7)
	for i := range digests {
		digests[i] = bytes.Repeat([]byte{byte(i)}, 32)
	}
	tests := []struct {
		perChunk int
		want     []int // digest index of each key
	}{
		{1, []int{0, 1, 2, 3, 4, 5, 6}},
		{0, []int{0, 1, 2, 3, 4, 5, 6}},
		{2, []int{1, 3, 5}},
		{3, []int{2, 5}},
		{8, nil},
	}
	for _, tt := range tests {
		keys := transfer.OffloadKeys(digests, tt.perChunk, 1)
		require.Len(t, keys, len(tt.want), "blocks per chunk %d", tt.perChunk)
		for i, di := range tt.want {
			require.Equal(t, transfer.NewKey(digests[di], 1), keys[i])
		}
	}
}

func TestStatsAdd(t *testing.T) {
	a := transfer.Stats{Blocks: 1, Bytes: 10, Duration: 3}
	require.Equal(t, transfer.Stats{Blocks: 3, Bytes: 30, Duration: 9}, a.Add(a).Add(a))
}
