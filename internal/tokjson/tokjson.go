// Package tokjson decodes a JSON request object whose "tokens" member is a
// prompt's token ids, fast: the tokens array, which is nearly all of a
// request's bytes (a 20,000-token prompt is about 140 KiB of JSON), is read
// by a hand-written scanner into a reused []uint32, without reflection or
// per-token allocation; every other member goes to encoding/json, whose
// results are the reference.
//
// Unmarshal(data, v, dst) gives what encoding/json.Decoder with
// DisallowUnknownFields gives for a body holding one JSON object (trailing
// white space allowed) decoded into a fresh v whose field tagged "tokens"
// is a []uint32, with the tokens returned instead of stored in v. In
// particular, as encoding/json does for a uint32, it accepts a token only
// as an integer literal from 0 to 4294967295 without fraction or exponent
// (1.0, 1e3, -0 and 4294967296 are errors), decodes a null element as 0, a
// null or absent member as nil, and [] as an empty, non-nil slice; member
// names match case-insensitively (Unicode simple folding, as
// bytes.EqualFold); a later duplicate member replaces an earlier one.
//
// # Compact encoding
//
// Instead of "tokens", a client may send "tokens_b64": the tokens as
// little-endian uint32s, base64-encoded (RFC 4648 standard alphabet, with
// padding): 5.3 bytes per token instead of about 7 for JSON digits, and a
// decode that is a copy rather than a parse. A request with both members is
// an error. In Python:
//
//	base64.b64encode(struct.pack(f"<{len(ids)}I", *ids)).decode()
//
// or with NumPy, base64.b64encode(np.asarray(ids, "<u4").tobytes()).
package tokjson

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sync"
	"unsafe"
)

// littleEndian reports whether a []uint32's memory holds little-endian
// uint32s, which tokens_b64's bytes then are.
var littleEndian = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// The member names this package decodes itself.
const (
	TokensMember    = "tokens"
	TokensB64Member = "tokens_b64"
)

// ErrSyntax is wrapped by the errors of malformed JSON and of token values
// a uint32 cannot hold; errors from decoding the other members into v are
// encoding/json's.
var ErrSyntax = errors.New("tokjson: invalid request JSON")

// restPool holds the buffers the other members are copied into.
// restPoolKeep is the largest buffer restPool keeps.
const restPoolKeep = 64 << 10

var restPool = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

// Unmarshal decodes the JSON object data into v as described in the package
// comment and returns its tokens appended to dst[:0], or nil when the body
// has neither a tokens nor a tokens_b64 member (or it is null). v must have
// a []uint32 field tagged "tokens" for the oracle's semantics (it is left
// untouched).
func Unmarshal(data []byte, v any, dst []uint32) ([]uint32, error) {
	i := skipWS(data, 0)
	if i == len(data) {
		return nil, syntaxErr(i, "unexpected end of JSON input")
	}
	switch data[i] {
	case '{':
	case 'n':
		// encoding/json decodes a null body into a struct as a no-op.
		if !bytes.HasPrefix(data[i:], []byte("null")) {
			return nil, syntaxErr(i, "invalid literal")
		}
		if j := skipWS(data, i+4); j != len(data) {
			return nil, syntaxErr(j, "trailing data after the JSON value")
		}
		return nil, nil
	default:
		return nil, syntaxErr(i, "request body is not a JSON object")
	}
	bp := restPool.Get().(*[]byte)
	defer func() {
		// A body with long other members grows its buffer: keep only
		// ordinary ones, or every pooled buffer ends up the largest seen.
		if cap(*bp) <= restPoolKeep {
			restPool.Put(bp)
		}
	}()
	rest := append((*bp)[:0], '{')
	var tokens []uint32
	var plain, b64 bool
	i = skipWS(data, i+1)
	if i < len(data) && data[i] == '}' {
		i++
	} else {
		for {
			if i >= len(data) || data[i] != '"' {
				return nil, syntaxErr(i, "expected a member name")
			}
			ks := i
			end, err := skipString(data, i)
			if err != nil {
				return nil, err
			}
			name, err := memberName(data[ks:end])
			if err != nil {
				return nil, err
			}
			i = skipWS(data, end)
			if i >= len(data) || data[i] != ':' {
				return nil, syntaxErr(i, "expected ':' after a member name")
			}
			i = skipWS(data, i+1)
			switch {
			case bytes.EqualFold(name, tokensName):
				plain = true
				tokens, i, err = scanTokens(data, i, dst, tokens)
			case bytes.EqualFold(name, tokensB64Name):
				b64 = true
				tokens, i, err = scanB64(data, i, dst)
			default:
				var ve int
				ve, err = skipValue(data, i)
				if err == nil {
					if len(rest) > 1 {
						rest = append(rest, ',')
					}
					rest = append(rest, data[ks:end]...)
					rest = append(rest, ':')
					rest = append(rest, data[i:ve]...)
					i = ve
				}
			}
			if err != nil {
				return nil, err
			}
			i = skipWS(data, i)
			if i >= len(data) {
				return nil, syntaxErr(i, "unexpected end of JSON input")
			}
			if data[i] == '}' {
				i++
				break
			}
			if data[i] != ',' {
				return nil, syntaxErr(i, "expected ',' or '}' after a member")
			}
			i = skipWS(data, i+1)
		}
	}
	if j := skipWS(data, i); j != len(data) {
		return nil, syntaxErr(j, "trailing data after the JSON object")
	}
	if plain && b64 {
		return nil, fmt.Errorf("%w: both %q and %q", ErrSyntax, TokensMember, TokensB64Member)
	}
	*bp = rest
	if len(rest) > 1 {
		rest = append(rest, '}')
		*bp = rest
		dec := json.NewDecoder(bytes.NewReader(rest))
		dec.DisallowUnknownFields()
		if err := dec.Decode(v); err != nil {
			return nil, err
		}
	}
	return tokens, nil
}

func syntaxErr(off int, msg string) error {
	return fmt.Errorf("%w: offset %d: %s", ErrSyntax, off, msg)
}

func isWS(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func skipWS(data []byte, i int) int {
	for i < len(data) && isWS(data[i]) {
		i++
	}
	return i
}

// skipString returns the offset after the string starting at data[i].
func skipString(data []byte, i int) (int, error) {
	for j := i + 1; j < len(data); j++ {
		switch data[j] {
		case '"':
			return j + 1, nil
		case '\\':
			j++
		}
	}
	return 0, syntaxErr(i, "unterminated string")
}

var tokensName, tokensB64Name = []byte(TokensMember), []byte(TokensB64Member)

// memberName returns the name of the quoted member name q, unquoted as
// encoding/json unquotes it.
func memberName(q []byte) ([]byte, error) {
	inner := q[1 : len(q)-1]
	simple := true
	for _, c := range inner {
		if c < 0x20 || c == '\\' || c >= 0x80 {
			simple = false
			break
		}
	}
	if simple {
		return inner, nil
	}
	var s string
	if err := json.Unmarshal(q, &s); err != nil {
		return nil, fmt.Errorf("%w: member name: %w", ErrSyntax, err)
	}
	return []byte(s), nil
}

// skipValue returns the offset after the JSON value starting at data[i].
// It only finds the value's end; encoding/json validates it.
func skipValue(data []byte, i int) (int, error) {
	if i >= len(data) {
		return 0, syntaxErr(i, "unexpected end of JSON input")
	}
	switch data[i] {
	case '"':
		return skipString(data, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(data); j++ {
			switch data[j] {
			case '"':
				e, err := skipString(data, j)
				if err != nil {
					return 0, err
				}
				j = e - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, syntaxErr(i, "unterminated value")
	default:
		j := i
		for j < len(data) && !isWS(data[j]) && data[j] != ',' && data[j] != '}' && data[j] != ']' {
			j++
		}
		if j == i {
			return 0, syntaxErr(i, "expected a value")
		}
		return j, nil
	}
}

// empty is the non-nil, empty token slice of "tokens": [] into a nil dst.
var empty = make([]uint32, 0)

// scanTokens scans the tokens value at data[i] into dst[:0] and returns the
// tokens and the offset after the value. prev is an earlier tokens member's
// result, whose elements a null element keeps, as encoding/json decodes a
// duplicate member into the slice already there.
func scanTokens(data []byte, i int, dst, prev []uint32) ([]uint32, int, error) {
	if i >= len(data) {
		return nil, i, syntaxErr(i, "unexpected end of JSON input")
	}
	if data[i] == 'n' {
		if !bytes.HasPrefix(data[i:], []byte("null")) {
			return nil, i, syntaxErr(i, "invalid literal")
		}
		return nil, i + 4, nil
	}
	if data[i] != '[' {
		return nil, i, syntaxErr(i, "tokens must be an array of integers")
	}
	out := dst[:0]
	if prev != nil {
		out = prev[:0]
	}
	if out == nil {
		out = empty
	}
	keep := len(prev)
	i = skipWS(data, i+1)
	if i < len(data) && data[i] == ']' {
		return out, i + 1, nil
	}
	n := len(data)
	// cool counts the tokens left to read one at a time before the run
	// scanner is tried again. After a run, the next token is one it
	// refused; after a short run (a body spaced another way, an array of
	// long tokens) it waits for runCoolTokens, so that such bodies scan
	// about as fast as without it.
	cool := 0
	for {
		if cool > 0 {
			cool--
		} else if i+runWindow-runSlack <= n {
			k, j := len(out), i
			if out, j = scanRun(data, i, out); j > i {
				i = skipWS(data, j)
			}
			if len(out)-k < runShort {
				cool = runCoolTokens
			}
		}
		if i >= n {
			return nil, i, syntaxErr(i, "unterminated tokens array")
		}
		c := data[i]
		// Most tokens are 1 to 7 digits followed by a separator: read
		// them 8 bytes at a time. A leading 0, 8 digits or more, and the
		// last bytes of the body go the byte-wise way below.
		if i+8 <= n && c > '0' && c <= '9' {
			if v, l := swarDigits(binary.LittleEndian.Uint64(data[i:])); l > 0 {
				out = append(out, v)
				i += l
				goto separator
			}
		}
		switch {
		case c >= '0' && c <= '9':
			start := i
			v := uint64(c - '0')
			i++
			if c != '0' {
				for i < n {
					d := data[i] - '0'
					if d > 9 {
						break
					}
					v = v*10 + uint64(d)
					i++
					if i-start > 10 {
						return nil, i, syntaxErr(start, "token out of uint32 range")
					}
				}
			}
			if v > math.MaxUint32 {
				return nil, i, syntaxErr(start, "token out of uint32 range")
			}
			out = append(out, uint32(v))
		case c == 'n':
			if !bytes.HasPrefix(data[i:], []byte("null")) {
				return nil, i, syntaxErr(i, "invalid literal")
			}
			i += 4
			if k := len(out); k < keep {
				out = out[:k+1]
			} else {
				out = append(out, 0)
			}
		default:
			return nil, i, syntaxErr(i, "tokens must be integers from 0 to 4294967295")
		}
	separator:
		// The common separator, ",", comes straight after the number.
		if i < n && data[i] == ',' {
			i++
		} else {
			i = skipWS(data, i)
			if i >= n {
				return nil, i, syntaxErr(i, "unterminated tokens array")
			}
			if data[i] == ']' {
				return out, i + 1, nil
			}
			if data[i] != ',' {
				if c := data[i]; c == '.' || c == 'e' || c == 'E' {
					return nil, i, syntaxErr(i, "tokens must be integers from 0 to 4294967295, without a fraction or exponent")
				}
				return nil, i, syntaxErr(i, "expected ',' or ']' in tokens")
			}
			i++
		}
		if i < n && data[i] == ' ' {
			i++
		}
		if i < n && isWS(data[i]) {
			i = skipWS(data, i)
		}
	}
}

// A run of fewer than runShort tokens makes scanTokens read the next
// runCoolTokens one at a time.
const (
	runShort      = 8
	runCoolTokens = 64
)

// swarDigits returns the value of the run of 1 to 7 ASCII digits at the
// start of u, eight bytes of the body read little-endian, and its length;
// 0, 0 when the run is empty or all eight bytes are digits.
func swarDigits(u uint64) (uint32, int) {
	const (
		ones   = 0x0101010101010101
		high   = 0xF0F0F0F0F0F0F0F0
		zeroes = 0x3030303030303030 // '0' in every byte
	)
	// A byte is a digit when its high nibble is 3 both as it is and with 6
	// added ('9'+6 = 0x3F, ':'+6 = 0x40). An add's carry only ever reaches
	// bytes after the first non-digit, which are not looked at.
	nd := (u&high ^ zeroes) | ((u+6*ones)&high ^ zeroes)
	l := bits.TrailingZeros64(nd) / 8
	if l == 0 || l == 8 {
		return 0, 0
	}
	// The digits' values, moved to the top bytes so that the bytes
	// shifted in are leading zeros; a subtraction's borrow, like the
	// add's carry, only reaches bytes shifted out.
	// Then each step joins neighbouring groups, the first (lower) byte
	// the more significant: 2 digits, 4, 8.
	x := (u - zeroes) << (64 - 8*l)
	x = (x * (10<<8 + 1)) >> 8
	x = ((x & 0x00FF00FF00FF00FF) * (100<<16 + 1)) >> 16
	x = ((x & 0x0000FFFF0000FFFF) * (10000<<32 + 1)) >> 32
	return uint32(x), l
}

func errB64Escape(i int) error {
	return syntaxErr(i, "tokens_b64 holds a JSON escape or control character")
}

// b64Err is the error of tokens_b64 value s at offset i that base64
// refused with err.
func b64Err(i int, s []byte, err error) error {
	for _, c := range s {
		if c < 0x20 || c == '\\' {
			return errB64Escape(i)
		}
	}
	return fmt.Errorf("%w: tokens_b64: %w", ErrSyntax, err)
}

// scanB64 decodes the tokens_b64 string at data[i] into dst[:0].
func scanB64(data []byte, i int, dst []uint32) ([]uint32, int, error) {
	if i < len(data) && data[i] == 'n' {
		if !bytes.HasPrefix(data[i:], []byte("null")) {
			return nil, i, syntaxErr(i, "invalid literal")
		}
		return nil, i + 4, nil
	}
	if i >= len(data) || data[i] != '"' {
		return nil, i, syntaxErr(i, "tokens_b64 must be a base64 string")
	}
	end := bytes.IndexByte(data[i+1:], '"')
	if end < 0 {
		return nil, i, syntaxErr(i, "unterminated string")
	}
	s := data[i+1 : i+1+end]
	// Base64 needs no JSON escapes, and base64's decoder would skip the
	// raw newlines a JSON string must not hold. It refuses every other
	// control character and '\\', so only the newlines need a look before
	// decoding; escapes named as such in its error.
	if bytes.IndexByte(s, '\n') >= 0 || bytes.IndexByte(s, '\r') >= 0 {
		return nil, i, errB64Escape(i)
	}
	enc := base64.StdEncoding
	if len(s)%4 != 0 {
		return nil, i, syntaxErr(i, "tokens_b64 is not padded base64")
	}
	out := dst[:0]
	if out == nil {
		out = empty
	}
	if littleEndian {
		// The decoded bytes are the tokens' memory: decode into it.
		if p := bytes.IndexByte(s, '='); p >= 0 && p < len(s)-2 {
			return nil, i, syntaxErr(i, "tokens_b64 has padding before its end")
		}
		nb := enc.DecodedLen(len(s))
		if len(s) > 0 && s[len(s)-1] == '=' {
			nb--
			if s[len(s)-2] == '=' {
				nb--
			}
		}
		out = slices.Grow(out, (nb+3)/4)
		full := out[:cap(out)]
		n, err := enc.Decode(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(full))), 4*len(full)), s)
		if err != nil {
			return nil, i, b64Err(i, s, err)
		}
		if n%4 != 0 {
			return nil, i, syntaxErr(i, "tokens_b64 is not a whole number of uint32s")
		}
		return out[:n/4], i + 1 + end + 1, nil
	}
	// Decode in chunks through a stack buffer: no byte copy of the prompt.
	var buf [3 * 256]byte
	var carry [4]byte
	nc := 0
	for off := 0; off < len(s); {
		chunk := s[off:min(off+4*256, len(s))]
		if off+len(chunk) < len(s) && bytes.IndexByte(chunk, '=') >= 0 {
			return nil, i, syntaxErr(i, "tokens_b64 has padding before its end")
		}
		n, err := enc.Decode(buf[:], chunk)
		if err != nil {
			return nil, i, b64Err(i, s, err)
		}
		off += len(chunk)
		b := buf[:n]
		for nc > 0 && len(b) > 0 {
			carry[nc] = b[0]
			nc++
			b = b[1:]
			if nc == 4 {
				out = append(out, uint32(carry[0])|uint32(carry[1])<<8|uint32(carry[2])<<16|uint32(carry[3])<<24)
				nc = 0
			}
		}
		for len(b) >= 4 {
			out = append(out, uint32(b[0])|uint32(b[1])<<8|uint32(b[2])<<16|uint32(b[3])<<24)
			b = b[4:]
		}
		nc += copy(carry[nc:], b)
	}
	if nc != 0 {
		return nil, i, syntaxErr(i, "tokens_b64 is not a whole number of uint32s")
	}
	return out, i + 1 + end + 1, nil
}
