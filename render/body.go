package render

import (
	"encoding/json"
	"fmt"
	"strconv"
)

// maxDepth bounds the nesting of a body the scanner walks, so that a
// hostile body of a million '[' costs a clear error, not a deep recursion.
// vLLM's chat bodies nest a handful of levels (messages, parts, tool
// schemas); JSON schemas of tools rarely pass 30.
const maxDepth = 512

// bodyInfo is what the client reads from a request body without decoding
// it: the member spans it rewrites and the few values it needs.
type bodyInfo struct {
	// model is the body's own "model" string, "" when absent or null.
	model string
	// modelSpans are the value spans [start, end) of every top-level
	// "model" member: vLLM's parser keeps the last of duplicates, the
	// client overwrites them all.
	modelSpans [][2]int
	// salt is the body's "cache_salt" string, "" when absent or null.
	salt string
	// messages and prompt tell a chat body from a completions body;
	// system, Anthropic's top-level system prompt, which no OpenAI chat
	// body has, an Anthropic Messages body from a chat body.
	messages, prompt, system bool
	// parts reports a message whose content is an array of parts (text,
	// image_url, input_audio, ...): a multimodal render, which downloads
	// and processes media and so gets the longer timeout.
	parts bool
	// open and close are the offsets of the object's braces; members
	// reports whether it has any.
	open, close int
	members     bool
}

// bodyErr is a scanner's error: the client reports a body's as
// ErrBadRequest, an answer's as ErrBadResponse.
func bodyErr(i int, format string, args ...any) error {
	return fmt.Errorf("offset %d: %s", i, fmt.Sprintf(format, args...))
}

// scanBody checks that b is one JSON object (white space around it
// allowed) and returns what the client needs from it. Only the members
// "model", "cache_salt", "messages", "prompt" and "system" are looked
// into; every
// other member is validated and skipped, so the body's unknown fields,
// megabytes of base64 images included, reach vLLM untouched.
func scanBody(b []byte) (bodyInfo, error) {
	var info bodyInfo
	i := skipWS(b, 0)
	if i >= len(b) {
		return info, bodyErr(i, "empty body, want a JSON object")
	}
	if b[i] != '{' {
		return info, bodyErr(i, "want a JSON object, got %s", describe(b[i]))
	}
	info.open = i
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == '}' {
		info.close = i
		return info, trailing(b, i+1)
	}
	for {
		name, vs, err := member(b, i)
		if err != nil {
			return info, err
		}
		info.members = true
		var ve int
		switch name {
		case "model":
			info.model, ve, err = optString(b, vs, "model")
			info.modelSpans = append(info.modelSpans, [2]int{vs, ve})
		case "cache_salt":
			info.salt, ve, err = optString(b, vs, "cache_salt")
		case "messages":
			info.messages = true
			ve, err = scanMessages(b, vs, &info)
		case "prompt":
			info.prompt = true
			ve, err = skipValue(b, vs, 1)
		case "system":
			info.system = true
			ve, err = skipValue(b, vs, 1)
		default:
			ve, err = skipValue(b, vs, 1)
		}
		if err != nil {
			return info, err
		}
		i = skipWS(b, ve)
		if i >= len(b) {
			return info, bodyErr(i, "unterminated object")
		}
		switch b[i] {
		case ',':
			i = skipWS(b, i+1)
		case '}':
			info.close = i
			return info, trailing(b, i+1)
		default:
			return info, bodyErr(i, "want ',' or '}' after a member, got %s", describe(b[i]))
		}
	}
}

// member reads a member name and its ':' at i and returns the name
// (unescaped) and the offset of its value.
func member(b []byte, i int) (string, int, error) {
	if i >= len(b) || b[i] != '"' {
		if i >= len(b) {
			return "", i, bodyErr(i, "unterminated object")
		}
		return "", i, bodyErr(i, "want a member name, got %s", describe(b[i]))
	}
	end, escaped, err := skipString(b, i)
	if err != nil {
		return "", i, err
	}
	name := string(b[i+1 : end-1])
	if escaped {
		if err := json.Unmarshal(b[i:end], &name); err != nil {
			return "", i, bodyErr(i, "member name: %v", err)
		}
	}
	i = skipWS(b, end)
	if i >= len(b) || b[i] != ':' {
		return "", i, bodyErr(i, "want ':' after member %q", name)
	}
	return name, skipWS(b, i+1), nil
}

// optString reads a string or null value at i.
func optString(b []byte, i int, what string) (string, int, error) {
	if i < len(b) && b[i] == 'n' {
		end, err := skipValue(b, i, 1)
		return "", end, err
	}
	if i >= len(b) || b[i] != '"' {
		if i >= len(b) {
			return "", i, bodyErr(i, "%s: unexpected end", what)
		}
		return "", i, bodyErr(i, "%s: want a string, got %s", what, describe(b[i]))
	}
	end, escaped, err := skipString(b, i)
	if err != nil {
		return "", i, err
	}
	if !escaped {
		return string(b[i+1 : end-1]), end, nil
	}
	var s string
	if err := json.Unmarshal(b[i:end], &s); err != nil {
		return "", i, bodyErr(i, "%s: %v", what, err)
	}
	return s, end, nil
}

// scanMessages walks a chat body's "messages" value and notes whether a
// message's "content" is an array of parts. A value that is not an array of
// objects is skipped as it is: vLLM says what is wrong with it.
func scanMessages(b []byte, i int, info *bodyInfo) (int, error) {
	if i >= len(b) || b[i] != '[' {
		return skipValue(b, i, 1)
	}
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == ']' {
		return i + 1, nil
	}
	for {
		var err error
		if i < len(b) && b[i] == '{' {
			i, err = scanMessage(b, i, info)
		} else {
			i, err = skipValue(b, i, 2)
		}
		if err != nil {
			return i, err
		}
		i = skipWS(b, i)
		if i >= len(b) {
			return i, bodyErr(i, "unterminated messages array")
		}
		switch b[i] {
		case ',':
			i = skipWS(b, i+1)
		case ']':
			return i + 1, nil
		default:
			return i, bodyErr(i, "want ',' or ']' in messages, got %s", describe(b[i]))
		}
	}
}

func scanMessage(b []byte, i int, info *bodyInfo) (int, error) {
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == '}' {
		return i + 1, nil
	}
	for {
		name, vs, err := member(b, i)
		if err != nil {
			return i, err
		}
		if name == "content" && vs < len(b) && b[vs] == '[' {
			info.parts = true
		}
		ve, err := skipValue(b, vs, 3)
		if err != nil {
			return ve, err
		}
		i = skipWS(b, ve)
		if i >= len(b) {
			return i, bodyErr(i, "unterminated message")
		}
		switch b[i] {
		case ',':
			i = skipWS(b, i+1)
		case '}':
			return i + 1, nil
		default:
			return i, bodyErr(i, "want ',' or '}' in a message, got %s", describe(b[i]))
		}
	}
}

// skipValue validates the JSON value at i and returns the offset past it.
// depth is the nesting of the value itself.
func skipValue(b []byte, i, depth int) (int, error) {
	if i >= len(b) {
		return i, bodyErr(i, "unexpected end, want a value")
	}
	switch c := b[i]; {
	case c == '"':
		end, _, err := skipString(b, i)
		return end, err
	case c == '{' || c == '[':
		if depth > maxDepth {
			return i, bodyErr(i, "nested deeper than %d", maxDepth)
		}
		return skipContainer(b, i, depth)
	case c == '-' || (c >= '0' && c <= '9'):
		return skipNumber(b, i)
	case c == 't':
		return literal(b, i, "true")
	case c == 'f':
		return literal(b, i, "false")
	case c == 'n':
		return literal(b, i, "null")
	default:
		return i, bodyErr(i, "want a value, got %s", describe(c))
	}
}

func skipContainer(b []byte, i, depth int) (int, error) {
	obj := b[i] == '{'
	closer := byte(']')
	if obj {
		closer = '}'
	}
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == closer {
		return i + 1, nil
	}
	for {
		var err error
		if obj {
			if i >= len(b) || b[i] != '"' {
				if i >= len(b) {
					return i, bodyErr(i, "unterminated object")
				}
				return i, bodyErr(i, "want a member name, got %s", describe(b[i]))
			}
			if i, _, err = skipString(b, i); err != nil {
				return i, err
			}
			i = skipWS(b, i)
			if i >= len(b) || b[i] != ':' {
				return i, bodyErr(i, "want ':' after a member name")
			}
			i = skipWS(b, i+1)
		}
		if i, err = skipValue(b, i, depth+1); err != nil {
			return i, err
		}
		i = skipWS(b, i)
		if i >= len(b) {
			return i, bodyErr(i, "unterminated %s", map[bool]string{true: "object", false: "array"}[obj])
		}
		switch b[i] {
		case ',':
			i = skipWS(b, i+1)
		case closer:
			return i + 1, nil
		default:
			return i, bodyErr(i, "want ',' or %q, got %s", closer, describe(b[i]))
		}
	}
}

// skipString validates the string at b[i] == '"' and returns the offset
// past its closing quote and whether it has escapes.
func skipString(b []byte, i int) (int, bool, error) {
	start := i
	escaped := false
	for i++; i < len(b); i++ {
		switch c := b[i]; {
		case c == '"':
			return i + 1, escaped, nil
		case c == '\\':
			escaped = true
			i++
			if i >= len(b) {
				return i, escaped, bodyErr(start, "unterminated string")
			}
			switch b[i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			case 'u':
				if i+4 >= len(b) {
					return i, escaped, bodyErr(start, "unterminated string")
				}
				for _, h := range b[i+1 : i+5] {
					if !isHex(h) {
						return i, escaped, bodyErr(i, `invalid \u escape`)
					}
				}
				i += 4
			default:
				return i, escaped, bodyErr(i, "invalid escape %s", describe(b[i]))
			}
		case c < 0x20:
			return i, escaped, bodyErr(i, "control character %#02x in a string", c)
		}
	}
	return i, escaped, bodyErr(start, "unterminated string")
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// skipNumber validates a JSON number (RFC 8259's grammar) at i.
func skipNumber(b []byte, i int) (int, error) {
	start := i
	if b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	default:
		return i, bodyErr(start, "invalid number")
	}
	if i < len(b) && b[i] == '.' {
		i++
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == d {
			return i, bodyErr(start, "invalid number")
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == d {
			return i, bodyErr(start, "invalid number")
		}
	}
	return i, nil
}

func literal(b []byte, i int, lit string) (int, error) {
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return i, bodyErr(i, "invalid literal, want %s", lit)
	}
	return i + len(lit), nil
}

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

func trailing(b []byte, i int) error {
	if j := skipWS(b, i); j != len(b) {
		return bodyErr(j, "data after the JSON object")
	}
	return nil
}

// describe names a byte for an error message.
func describe(c byte) string {
	switch {
	case c == '[':
		return "an array"
	case c == '"':
		return "a string"
	case c == '-' || (c >= '0' && c <= '9'):
		return "a number"
	case c == 't' || c == 'f':
		return "a boolean"
	case c == 'n':
		return "null"
	case c >= 0x20 && c < 0x7f:
		return strconv.QuoteRune(rune(c))
	default:
		return fmt.Sprintf("byte %#02x", c)
	}
}

// omitKwargs is spliced into every body unless Config.KeepMMKwargs: it asks
// vLLM to leave the processed multimodal tensors (features.kwargs_data,
// tens of megabytes for an image) out of the answer, as llm-d's token
// producer does. vLLM's render requests have no such field (Aug 2026) and
// ignore it, so answers carry the tensors anyway: the client skips them as
// they stream past (see readAnswer). It goes last, since vLLM's parser
// keeps the last of duplicate members, so a client's own value does not
// win.
const omitKwargs = `"return_mm_kwargs":false`

// rewrite returns the body to send: b with every top-level "model" value
// replaced by model (or a "model" member added first when b has none),
// unless model is "", and omitKwargs added last when omit is set.
func rewrite(b []byte, info *bodyInfo, model string, omit bool) []byte {
	var quoted []byte
	if model != "" {
		quoted, _ = json.Marshal(model) // a string always marshals
	}
	out := make([]byte, 0, len(b)+len(quoted)*max(1, len(info.modelSpans))+len(omitKwargs)+12)
	prev := 0
	if quoted != nil && len(info.modelSpans) == 0 {
		out = append(out, b[:info.open+1]...)
		out = append(out, `"model":`...)
		out = append(out, quoted...)
		if info.members {
			out = append(out, ',')
		}
		prev = info.open + 1
	}
	if quoted != nil {
		for _, sp := range info.modelSpans {
			out = append(out, b[prev:sp[0]]...)
			out = append(out, quoted...)
			prev = sp[1]
		}
	}
	if !omit {
		return append(out, b[prev:]...)
	}
	out = append(out, b[prev:info.close]...)
	if info.members || (quoted != nil && len(info.modelSpans) == 0) {
		out = append(out, ',')
	}
	out = append(out, omitKwargs...)
	return append(out, b[info.close:]...)
}
