package tokjson

import (
	"encoding/binary"
	"math/bits"
)

// The run scanner decodes the bulk of a tokens array, runs of tokens of 1
// to 8 digits separated by "," or ", ", 64 bytes at a time in two stages,
// as simdjson does: first a bitmask of the block's commas, then a walk of
// its bits. A token's offset and length come from the commas around it, so
// that the only dependency from one token to the next is the walk's
// clearing of a bit, and each token's load and conversion overlap the
// next ones'; in the per-token scanner the next token's offset waits for
// the load and digit mask of this one. It is bound by its instructions
// per token instead, about 50 (BENCHMARKS.md has the gain: the run takes
// about 0.7 of the per-token scanner's time).
//
// Whatever the run scanner does not take (white space other than one
// space after a comma, null, a leading zero, an empty element, 9 or more
// digits, the array's end) ends the run at the start of that token, which
// the per-token scanner then reads, with all its errors.

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080

	// runBlock is the block the comma mask covers; runSlack is how far
	// past a block's end a token's 8-byte load may read.
	runBlock = 64
	runSlack = 8
)

// commaBits returns a bit for each ',' byte in u, eight bytes read
// little-endian (bit k for byte k), and for each '-' byte that follows
// such a byte or another such '-': the classic zero-byte test, whose
// borrow from a zero byte also marks a 1 after it (',' xor '-' is 1). A
// '-' so marked ends an empty token, which runTokens refuses, so that the
// per-token scanner reads the '-' and refuses it as it always did.
func commaBits(u uint64) uint64 {
	x := u ^ ','*lsb
	z := (x - lsb) &^ x & msb
	// Gather the eight high bits into the top byte: bit 8k+7 lands on
	// 56+k, and no two partial products overlap, so none carries.
	return (z * 0x0002040810204081) >> 56
}

// runWindow is the bytes scanRun views for a block: runSlack before it
// (where the block's first token may have begun) and enough after it that
// an offset masked to 7 bits can index an 8-byte load without a bounds
// check. Offsets in a window are at most runSlack+runBlock, so the mask
// changes none.
const runWindow = 128 + runSlack

// scanRun decodes the tokens from data[i], the start of a token, to the
// last comma of the run (see above) into out's spare capacity, and returns
// out and the offset after that comma: i when it took no token. It stops
// when out has no room for a block's tokens, so that a dst of the
// prompt's length is never reallocated; the per-token scanner's append
// then grows it.
func scanRun(data []byte, i int, out []uint32) ([]uint32, int) {
	// Offsets are relative to the window, which starts runSlack bytes
	// before the block.
	p := runSlack - 1 // the comma before the current token
	b := i
	for ; b >= runSlack && b-runSlack+runWindow <= len(data) && cap(out)-len(out) >= runBlock/2; b += runBlock {
		w := (*[runWindow]byte)(data[b-runSlack : b-runSlack+runWindow])
		commas := commaBits(binary.LittleEndian.Uint64(w[runSlack+0:])) |
			commaBits(binary.LittleEndian.Uint64(w[runSlack+8:]))<<8 |
			commaBits(binary.LittleEndian.Uint64(w[runSlack+16:]))<<16 |
			commaBits(binary.LittleEndian.Uint64(w[runSlack+24:]))<<24 |
			commaBits(binary.LittleEndian.Uint64(w[runSlack+32:]))<<32 |
			commaBits(binary.LittleEndian.Uint64(w[runSlack+40:]))<<40 |
			commaBits(binary.LittleEndian.Uint64(w[runSlack+48:]))<<48 |
			commaBits(binary.LittleEndian.Uint64(w[runSlack+56:]))<<56
		if commas == 0 {
			// 64 bytes without a comma: no token of the run is so
			// long, and past the array's end no more work is owed.
			break
		}
		k, q, whole := runTokens(w, commas, p, (*[runBlock / 2]uint32)(out[len(out):len(out)+runBlock/2]))
		out, p = out[:len(out)+k], q
		if !whole {
			break
		}
		if p -= runBlock; p < -1 {
			// The current token began before the next window: too
			// long for the run.
			return out, b + runBlock - runSlack + p + 1
		}
	}
	return out, b - runSlack + p + 1
}

// runTokens decodes the tokens of a block whose commas are the bits of
// commas (bit k: window offset runSlack+k) into dst. p is the offset of
// the comma before the first. It returns how many it decoded, the offset
// of the comma after the last, and whether it reached the last comma.
//
// A block holds at most runBlock/2 tokens: every one the run takes ends
// with a comma and has a digit before it.
func runTokens(w *[runWindow]byte, commas uint64, p int, dst *[runBlock / 2]uint32) (int, int, bool) {
	k := 0
	for commas != 0 {
		c := runSlack + bits.TrailingZeros64(commas)
		commas &= commas - 1
		s := p + 1
		u := binary.LittleEndian.Uint64(w[s&127:])
		if uint8(u) == ' ' {
			// ", " is how Python's json.dumps separates. (A reload,
			// not a shift: the compiler would make the latter a
			// conditional move, which waits for the load.)
			s++
			u = binary.LittleEndian.Uint64(w[s&127:])
		}
		l := c - s
		if uint(l-1) >= 8 || uint8(u) == '0' && l > 1 {
			return k, p, false // empty, 9 digits or more, or a leading zero
		}
		// The digits' values, moved to the top bytes; the bytes after
		// the token are shifted out, zeros shifted in as leading zeros.
		x := (u ^ '0'*lsb) << ((64 - 8*l) & 63)
		// Every byte a digit: at most 9, so neither the byte nor the
		// byte plus 6 reaches 0x10. A byte of 0xFA or more carries into
		// the next one, but is caught itself.
		if (x|(x+6*lsb))&(0xF0*lsb) != 0 {
			return k, p, false
		}
		// As in swarDigits: join neighbouring groups, 2 digits, 4, 8.
		x = (x * (10<<8 + 1)) >> 8
		x = ((x & 0x00FF00FF00FF00FF) * (100<<16 + 1)) >> 16
		x = ((x & 0x0000FFFF0000FFFF) * (10000<<32 + 1)) >> 32
		// k < runBlock/2 (see above); the mask tells the compiler.
		dst[k&(runBlock/2-1)] = uint32(x)
		k++
		p = c
	}
	return k, p, true
}
