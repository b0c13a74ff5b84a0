package mooncake

import (
	"encoding/binary"
	"math/bits"
	"testing"

	"github.com/stretchr/testify/require"
)

// The expected values below are the published test vectors of rand 0.9.2
// (rand_chacha/src/chacha.rs, src/rngs/std.rs, rand_core/src/lib.rs,
// rand_pcg/tests/lcg64xsh32.rs, src/distr/uniform_int.rs), so a port that
// is off by one bit anywhere fails them.

// chachaWords is a ChaCha generator of any round count read word by word,
// as rand_chacha's ChaCha20Rng is for the IETF draft's vectors.
type chachaWords struct {
	c   chacha
	buf [chachaBufWords]uint32
	pos int
}

func newChaChaWords(seed [32]byte, doubleRounds int) *chachaWords {
	return &chachaWords{c: newChaCha(seed, doubleRounds), pos: chachaBufWords}
}

func (g *chachaWords) Uint32() uint32 {
	if g.pos == len(g.buf) {
		g.c.refill(&g.buf)
		g.pos = 0
	}
	g.pos++
	return g.buf[g.pos-1]
}

func take(src uint32Source, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = src.Uint32()
	}
	return out
}

// nextU64 and fromRng are RngCore::next_u64 and SeedableRng::from_rng over
// a word source: low word first, and 32 bytes of little-endian words.
func nextU64(src uint32Source) uint64 {
	lo := src.Uint32()
	return uint64(src.Uint32())<<32 | uint64(lo)
}

func fromRng(src uint32Source) (seed [32]byte) {
	for i := 0; i < 32; i += 4 {
		binary.LittleEndian.PutUint32(seed[i:], src.Uint32())
	}
	return seed
}

func TestChaCha20MatchesRandChachasVectors(t *testing.T) {
	t.Run("true values a", func(t *testing.T) {
		g := newChaChaWords([32]byte{}, 10)
		require.Equal(t, []uint32{
			0xade0b876, 0x903df1a0, 0xe56a5d40, 0x28bd8653, 0xb819d2bd, 0x1aed8da0, 0xccef36a8, 0xc70d778b,
			0x7c5941da, 0x8d485751, 0x3fe02477, 0x374ad8b8, 0xf4b8436a, 0x1ca11815, 0x69b687c3, 0x8665eeb2,
		}, take(g, 16))
		require.Equal(t, []uint32{
			0xbee7079f, 0x7a385155, 0x7c97ba98, 0x0d082d73, 0xa0290fcb, 0x6965e348, 0x3e53c612, 0xed7aee32,
			0x7621b729, 0x434ee69c, 0xb03371d5, 0xd539d874, 0x281fed31, 0x45fb0a51, 0x1f0ae1ac, 0x6f4d794b,
		}, take(g, 16))
	})
	t.Run("true values b", func(t *testing.T) {
		var seed [32]byte
		seed[31] = 1
		g := newChaChaWords(seed, 10)
		take(g, 16)
		require.Equal(t, []uint32{
			0x2452eb3a, 0x9249f8ec, 0x8d829d9b, 0xddd4ceb1, 0xe8252083, 0x60818b01, 0xf38422b8, 0x5aaa49c9,
			0xbb00ca8e, 0xda3ba7b4, 0xc4b592d1, 0xfdf2732f, 0x4436274e, 0x2561b3c8, 0xebdd4aa6, 0xa0136c00,
		}, take(g, 16))
	})
	t.Run("true values c", func(t *testing.T) {
		var seed [32]byte
		seed[1] = 0xff
		g := newChaChaWords(seed, 10)
		take(g, 32)
		require.Equal(t, []uint32{
			0xfb4dd572, 0x4bc42ef1, 0xdf922636, 0x327f1394, 0xa78dea8f, 0x5e269039, 0xa1bebbc1, 0xcaf09aae,
			0xa25ab213, 0x48a6b46c, 0x1b9d9bcb, 0x092c5be6, 0x546ca624, 0x1bec45d5, 0x87f47473, 0x96f0992e,
		}, take(g, 16))
	})
	t.Run("multiple blocks", func(t *testing.T) {
		var seed [32]byte
		for i := range 8 {
			seed[4*i] = byte(i)
		}
		g := newChaChaWords(seed, 10)
		got := make([]uint32, 16)
		for i := range got {
			got[i] = g.Uint32()
			take(g, 16)
		}
		require.Equal(t, []uint32{
			0xf225c81a, 0x6ab1be57, 0x04d42951, 0x70858036, 0x49884684, 0x64efec72, 0x4be2d186, 0x3615b384,
			0x11cfa18e, 0xd3c50049, 0x75c775f6, 0x434c6530, 0x2c5bad8f, 0x898881dc, 0x5f1c86d9, 0xc1f8e7f4,
		}, got)
	})
	t.Run("true bytes", func(t *testing.T) {
		seed := fromRng(newChaChaWords([32]byte{}, 10))
		require.Equal(t, [32]byte{
			118, 184, 224, 173, 160, 241, 61, 144, 64, 93, 106, 229, 83, 134, 189, 40,
			189, 210, 25, 184, 160, 141, 237, 26, 168, 54, 239, 204, 139, 119, 13, 199,
		}, seed)
	})
	t.Run("construction", func(t *testing.T) {
		var seed [32]byte
		seed[8], seed[16], seed[24] = 1, 2, 3
		g := newChaChaWords(seed, 10)
		require.Equal(t, uint32(137206642), g.Uint32())
		require.Equal(t, uint32(1325750369), newChaChaWords(fromRng(g), 10).Uint32())
	})
}

func TestStdRngIsChaCha12AsRandBuildsIt(t *testing.T) {
	seed := [32]byte{1, 0, 0, 0, 23, 0, 0, 0, 200, 1, 0, 0, 210, 30}
	rng0 := NewStdRng(seed)
	x0 := nextU64(rng0)
	rng1 := NewStdRng(fromRng(rng0))
	require.Equal(t, [2]uint64{10719222850664546238, 14064965282130556830}, [2]uint64{x0, nextU64(rng1)})
}

// pcg32 is rand_pcg's Lcg64Xsh32, to check the seed expansion and Canon's
// method against the vectors rand publishes for them.
type pcg32 struct{ state, inc uint64 }

func newPcg32(state, inc uint64) *pcg32 {
	p := &pcg32{state: state, inc: inc}
	p.state += p.inc
	p.step()
	return p
}

func (p *pcg32) step() { p.state = p.state*6364136223846793005 + p.inc }

func (p *pcg32) Uint32() uint32 {
	s := p.state
	p.step()
	return bits.RotateLeft32(uint32(((s>>18)^s)>>27), -int(s>>59))
}

func TestSeedExpansionMatchesRandCore(t *testing.T) {
	var seed8 [8]byte
	pcg32Fill(0, seed8[:])
	require.Equal(t, uint64(5029875928683246316), binary.LittleEndian.Uint64(seed8[:]))

	// Lcg64Xsh32::seed_from_u64(0): the 16-byte seed is state and stream.
	var seed16 [16]byte
	pcg32Fill(0, seed16[:])
	p := newPcg32(binary.LittleEndian.Uint64(seed16[:]), binary.LittleEndian.Uint64(seed16[8:])|1)
	require.Equal(t, uint64(18195738587432868099), nextU64(p))

	// A seed not a multiple of 4 bytes takes the first bytes of the last word.
	var seed6, seed8b [8]byte
	pcg32Fill(9, seed6[:6])
	pcg32Fill(9, seed8b[:])
	require.Equal(t, seed8b[:6], seed6[:6])
	require.Equal(t, []byte{0, 0}, seed6[6:])
}

func TestCanonRangeMatchesRandsValueStability(t *testing.T) {
	// The reference of the PCG the vectors use: Lcg64Xsh32::new(42, 54).
	ref := newPcg32(42, 54<<1|1)
	require.Equal(t, []uint32{0xa15c02b7, 0x7b47f409, 0xba1d3330, 0x83d2f293, 0xbfa4784b, 0xcbed606e}, take(ref, 6))

	// rand's crate::test::rng(897): Pcg32::new(897, 11634580027462260723);
	// sample_single(11, 219) on u32 and usize gives 17, 66, 214.
	inc := uint64(11634580027462260723)
	src := newPcg32(897, inc<<1|1) // the stream's top bit is dropped
	var got []uint32
	for range 3 {
		v, err := canonRange(src, 11, 219)
		require.NoError(t, err)
		got = append(got, v)
	}
	require.Equal(t, []uint32{17, 66, 214}, got)

	_, err := canonRange(src, 5, 5)
	require.ErrorIs(t, err, ErrEmptyRange)
}

type fixedWords []uint32

func (f *fixedWords) Uint32() uint32 {
	x := (*f)[0]
	*f = (*f)[1:]
	return x
}

func TestCanonRangeDrawsAgainWhenTheLowHalfCouldCarry(t *testing.T) {
	// 4294967 × 1000 = 2^32 − 296: high half 0, low half past 2^32 − 1000,
	// so a second draw decides whether it carries into 1.
	for _, tc := range []struct {
		second uint32
		want   uint32
	}{
		{0, 0},          // 0 × 1000 >> 32 = 0: no carry
		{1271310319, 0}, // × 1000 >> 32 = 295: 2^32 − 296 + 295 does not carry
		{1271310320, 1}, // × 1000 >> 32 = 296: it carries
		{0xffffffff, 1}, // 999
	} {
		words := fixedWords{4294967, tc.second}
		v, err := canonRange(&words, 0, 1000)
		require.NoError(t, err)
		require.Equal(t, tc.want, v, "second draw %d", tc.second)
		require.Empty(t, words)
	}
	// A low half that cannot carry takes one draw.
	words := fixedWords{0xffffffff, 7}
	v, err := canonRange(&words, 0, 1000)
	require.NoError(t, err)
	require.Equal(t, uint32(999), v)
	require.Len(t, words, 1)
}

func TestStdRngSpreadsOverWorkersFromTheSeed(t *testing.T) {
	// seed_from_u64 feeds ChaCha12 the PCG32 expansion of the seed: the same
	// numbers as NewStdRng of that expansion, different ones for another seed.
	var seed [32]byte
	pcg32Fill(42, seed[:])
	a, b, c := SeedStdRng(42), NewStdRng(seed), SeedStdRng(43)
	for range 100 {
		x, err := a.RandomRange(1000)
		require.NoError(t, err)
		y, err := canonRange(b, 0, 1000)
		require.NoError(t, err)
		require.Equal(t, x, y)
		require.Less(t, x, uint32(1000))
	}
	require.NotEqual(t, take(SeedStdRng(42), 8), take(c, 8))
}
