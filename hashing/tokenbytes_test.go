package hashing

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPutTokensWritesLittleEndianUint32sOnEveryPath(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for n := range 40 {
		tokens := make([]uint32, n)
		want := make([]byte, 4*n)
		for i := range tokens {
			tokens[i] = r.Uint32()
			binary.LittleEndian.PutUint32(want[4*i:], tokens[i])
		}
		for name, put := range map[string]func([]byte, []uint32){"putTokens": putTokens, "putTokensStores": putTokensStores} {
			got := make([]byte, 4*n)
			put(got, tokens)
			require.Equal(t, want, got, "%s, %d tokens", name, n)
		}
	}
}
