package fake

import (
	"hash/maphash"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
)

// The set agrees with a map on random keys, including keys forced into
// one hash bucket.
func TestKeySetAgreesWithAMap(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	s := newKeySet()
	for round := range 5 {
		model := map[string]bool{}
		for range 300 {
			k := transfer.KeyFromUint64(r.Uint64N(200), uint32(r.IntN(2)))
			s.add(k)
			model[string(k)] = true
		}
		for i := range 200 {
			for g := range uint32(2) {
				k := transfer.KeyFromUint64(uint64(i), g)
				require.Equal(t, model[string(k)], s.has(k), "round %d key %v", round, k)
			}
		}
		s.reset()
		require.False(t, s.has(transfer.KeyFromUint64(0, 0)))
	}
}

func TestKeySetResolvesHashCollisions(t *testing.T) {
	s := newKeySet()
	a, b := transfer.KeyFromUint64(1, 0), transfer.KeyFromUint64(2, 0)
	s.add(a)
	// Make b's hash point at a's bytes, as a collision would.
	ha, hb := maphash.Bytes(s.seed, a), maphash.Bytes(s.seed, b)
	s.first[hb] = s.first[ha]
	require.False(t, s.has(b), "equal hashes are not equal keys")
	s.add(b)
	require.True(t, s.has(b))
	require.True(t, s.has(a))
	require.Len(t, s.more, 1)
}
