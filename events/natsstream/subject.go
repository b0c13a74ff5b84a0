package natsstream

import (
	"strings"
)

// Subjects are <prefix>.<model>.<pod>, each name escaped into one subject
// token: pod names hold ':' and '.', model names '/' and '.', and a NATS
// token may hold none of '.', '*', '>' or white space. Bytes outside
// [A-Za-z0-9_-] become '~' and two upper-case hex digits, so that a token
// stays readable ("meta-llama~2FLlama-3~2E1-8B"); the empty name is "~".

const hexDigits = "0123456789ABCDEF"

func safeByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-'
}

// EscapeToken returns name as one subject token that no other name maps to.
func EscapeToken(name string) string {
	if name == "" {
		return "~"
	}
	clean := true
	for i := 0; i < len(name); i++ {
		if !safeByte(name[i]) {
			clean = false
			break
		}
	}
	if clean {
		return name
	}
	var b strings.Builder
	b.Grow(len(name) + 8)
	for i := 0; i < len(name); i++ {
		c := name[i]
		if safeByte(c) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('~')
		b.WriteByte(hexDigits[c>>4])
		b.WriteByte(hexDigits[c&15])
	}
	return b.String()
}

// UnescapeToken reverses EscapeToken; ok is false for a token EscapeToken
// cannot have produced.
func UnescapeToken(tok string) (name string, ok bool) {
	if tok == "~" {
		return "", true
	}
	if tok == "" {
		return "", false
	}
	if !strings.Contains(tok, "~") {
		return tok, true
	}
	b := make([]byte, 0, len(tok))
	for i := 0; i < len(tok); i++ {
		c := tok[i]
		if c != '~' {
			b = append(b, c)
			continue
		}
		if i+2 >= len(tok) {
			return "", false
		}
		hi, lo := unhex(tok[i+1]), unhex(tok[i+2])
		if hi < 0 || lo < 0 {
			return "", false
		}
		b = append(b, byte(hi<<4|lo))
		i += 2
	}
	return string(b), true
}

func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}
