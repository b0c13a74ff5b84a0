package mooncake

import (
	"encoding/binary"
	"errors"
	"math/bits"
)

// StdRng is rand 0.9.2's StdRng (rand_chacha's ChaCha12Rng), bit for bit:
// Dynamo spreads the trace's requests over its mock engines with it, so
// the port must draw the same numbers to give every engine the same
// requests. The generator is the ChaCha stream cipher with 12 rounds, key =
// the 32-byte seed, a 64-bit block counter from 0 and stream 0; its words
// are read in order, four blocks (64 words) at a time as rand_chacha
// buffers them.
type StdRng struct {
	c   chacha
	buf [chachaBufWords]uint32
	pos int // next word of buf; len(buf) when it is used up
}

// NewStdRng is StdRng::from_seed(seed).
func NewStdRng(seed [32]byte) *StdRng {
	return &StdRng{c: newChaCha(seed, 6), pos: chachaBufWords}
}

// SeedStdRng is StdRng::seed_from_u64(state): rand_core's default, which
// expands the u64 into the seed with PCG32.
func SeedStdRng(state uint64) *StdRng {
	var seed [32]byte
	pcg32Fill(state, seed[:])
	return NewStdRng(seed)
}

// pcg32Fill fills seed as rand_core's SeedableRng::seed_from_u64 does: PCG32
// outputs, little-endian, 4 bytes each, the last one cut to fit.
func pcg32Fill(state uint64, seed []byte) {
	const mul, inc = 6364136223846793005, 11634580027462260723
	for i := 0; i < len(seed); i += 4 {
		state = state*mul + inc
		x := bits.RotateLeft32(uint32(((state>>18)^state)>>27), -int(state>>59))
		var w [4]byte
		binary.LittleEndian.PutUint32(w[:], x)
		copy(seed[i:], w[:])
	}
}

// Uint32 is RngCore::next_u32.
func (r *StdRng) Uint32() uint32 {
	if r.pos == len(r.buf) {
		r.c.refill(&r.buf)
		r.pos = 0
	}
	x := r.buf[r.pos]
	r.pos++
	return x
}

// ErrEmptyRange is random_range's panic on an empty range.
var ErrEmptyRange = errors.New("mooncake: empty range")

// uint32Source is what RandomRange draws from.
type uint32Source interface{ Uint32() uint32 }

// RandomRange is Rng::random_range(0..n) for a usize n < 2^32 on a 64-bit
// target: rand samples such a range as u32 with Canon's method (one draw,
// a second only when the first's low half could carry).
func (r *StdRng) RandomRange(n uint32) (uint32, error) { return canonRange(r, 0, n) }

// canonRange is UniformInt::<u32>::sample_single(low, high): the
// inclusive sampler over [low, high-1] of rand 0.9 without the "unbiased"
// feature.
func canonRange(src uint32Source, low, high uint32) (uint32, error) {
	if low >= high {
		return 0, ErrEmptyRange
	}
	rng := high - 1 - low + 1 // never 0: high-1 < MaxUint32
	hi, lo := bits.Mul32(src.Uint32(), rng)
	if lo > -rng {
		newHi, _ := bits.Mul32(src.Uint32(), rng)
		if _, carry := bits.Add32(lo, newHi, 0); carry != 0 {
			hi++
		}
	}
	return low + hi, nil
}

const (
	chachaBlockWords = 16
	chachaBufWords   = 4 * chachaBlockWords
)

// chacha is the ChaCha block function's state: key, counter, stream.
type chacha struct {
	key     [8]uint32
	counter uint64
	rounds  int // double rounds: 6 for ChaCha12, 10 for ChaCha20
}

func newChaCha(seed [32]byte, doubleRounds int) chacha {
	c := chacha{rounds: doubleRounds}
	for i := range c.key {
		c.key[i] = binary.LittleEndian.Uint32(seed[4*i:])
	}
	return c
}

// refill writes the next four blocks, in counter order.
func (c *chacha) refill(out *[chachaBufWords]uint32) {
	for b := range 4 {
		c.block((*[chachaBlockWords]uint32)(out[b*chachaBlockWords:]))
		c.counter++
	}
}

func (c *chacha) block(out *[chachaBlockWords]uint32) {
	in := [chachaBlockWords]uint32{
		0x61707865, 0x3320646e, 0x79622d32, 0x6b206574,
		c.key[0], c.key[1], c.key[2], c.key[3],
		c.key[4], c.key[5], c.key[6], c.key[7],
		uint32(c.counter), uint32(c.counter >> 32), 0, 0,
	}
	x := in
	for range c.rounds {
		quarter(&x, 0, 4, 8, 12)
		quarter(&x, 1, 5, 9, 13)
		quarter(&x, 2, 6, 10, 14)
		quarter(&x, 3, 7, 11, 15)
		quarter(&x, 0, 5, 10, 15)
		quarter(&x, 1, 6, 11, 12)
		quarter(&x, 2, 7, 8, 13)
		quarter(&x, 3, 4, 9, 14)
	}
	for i := range out {
		out[i] = x[i] + in[i]
	}
}

func quarter(x *[chachaBlockWords]uint32, a, b, c, d int) {
	x[a] += x[b]
	x[d] = bits.RotateLeft32(x[d]^x[a], 16)
	x[c] += x[d]
	x[b] = bits.RotateLeft32(x[b]^x[c], 12)
	x[a] += x[b]
	x[d] = bits.RotateLeft32(x[d]^x[a], 8)
	x[c] += x[d]
	x[b] = bits.RotateLeft32(x[b]^x[c], 7)
}
