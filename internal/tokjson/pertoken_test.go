package tokjson

import (
	"bytes"
	"encoding/binary"
	"math"
)

// scanTokensPerToken is scanTokens as it was before the run scanner, one
// token per step: the baseline of BenchmarkScan and the reference of the
// run scanner's tests, which require the same tokens, offsets and errors.
func scanTokensPerToken(data []byte, i int, dst, prev []uint32) ([]uint32, int, error) {
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
	for {
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
