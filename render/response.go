package render

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"

	"github.com/kvsource/kvsource/hashing"
)

// wireFeatures is the part of vLLM's GenerateRequest.features (the render
// answer, vllm/entrypoints/scale_out/token_in_token_out/protocol.py) the
// client reads; the multimodal tensors (kwargs_data, mm_metadata) are
// skipped as they stream past.
type wireFeatures struct {
	MMHashes       map[string][]string          `json:"mm_hashes"`
	MMPlaceholders map[string][]wirePlaceholder `json:"mm_placeholders"`
}

type wirePlaceholder struct {
	Offset *int64 `json:"offset"`
	Length *int64 `json:"length"`
}

// errAnswer is wrapped by the parser's errors; the client reports them as
// ErrBadResponse.
var errAnswer = errors.New("answer")

func answerErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errAnswer, fmt.Sprintf(format, args...))
}

// An answer streams through a window of answerWindow bytes: only the token
// ids, model, cache salt, mm_hashes and mm_placeholders are kept, so the
// processed multimodal tensors vLLM sends in features.kwargs_data (tens of
// megabytes an image, whatever the body asks) and sampling_params cost a
// pass over their bytes and no memory.
const answerWindow = 32 << 10

// maxAnswerString bounds the model and cache_salt an answer echoes; a
// member name longer than it is none the client reads.
const maxAnswerString = 64 << 10

// maxFeatureBytes bounds the JSON of a rendered prompt's mm_hashes and of
// its mm_placeholders, each: about 10,000 items, as many as a kvsource
// request body may carry itself.
const maxFeatureBytes = 1 << 20

// errAnswerTooLarge is an answer longer than Config.MaxResponseBytes.
var errAnswerTooLarge = errors.New("answer exceeds Config.MaxResponseBytes")

// chargeError is a Charge's refusal, which stops the read.
type chargeError struct{ err error }

func (e chargeError) Error() string { return e.err.Error() }
func (e chargeError) Unwrap() error { return e.err }

// answerReader parses a render answer as it arrives, through buf.
type answerReader struct {
	r    io.Reader
	buf  []byte
	i, n int   // buf[i:n] is read and not parsed
	base int64 // the answer's offset of buf[0]
	rerr error // the reader's error once it gave one; io.EOF at the end
	// limit bounds the bytes read, 0 none.
	limit int64
	// maxTokens bounds the token ids of a prompt, 0 none.
	maxTokens int
	// charge is told of memory before it is allocated; nil for none.
	charge func(int64) error

	// A capture copies the bytes parsed from buf[capStart:] on into capt,
	// up to captMax; captOver reports that it had more.
	capturing bool
	captOver  bool
	capStart  int
	captMax   int
	capt      []byte
}

// parseAnswer decodes a render answer held in data: a JSON array of
// GenerateRequests for the completions endpoint (one per prompt), one
// GenerateRequest object for the chat and messages endpoints.
func parseAnswer(data []byte, array bool) ([]Rendered, error) {
	return readAnswer(bytes.NewReader(data), array, make([]byte, 4096), 0, 0, nil)
}

// readAnswer decodes a render answer read from r through buf (see
// parseAnswer), at most limit bytes of it (0: no bound) and maxTokens
// token ids a prompt (0: no bound), telling charge (when not nil) of the
// memory it keeps before it allocates it. It validates the whole answer
// as JSON and skips what the client does not read (sampling_params,
// token_offsets, the tensors); token_ids, nearly all of a text answer's
// bytes, is read without reflection, and only mm_hashes and
// mm_placeholders go to encoding/json. It checks what vLLM's own
// validators promise, so that a broken or hostile backend cannot hand the
// hasher impossible items: at least one uint32 token, the same modalities
// and item counts in mm_hashes and mm_placeholders, placeholders inside
// the prompt, of positive length and not overlapping.
//
// Its errors wrap errAnswer (not vLLM's answer), errAnswerTooLarge,
// ErrTooManyTokens, a chargeError, or the reader's own error.
func readAnswer(r io.Reader, array bool, buf []byte, limit int64, maxTokens int, charge func(int64) error) ([]Rendered, error) {
	p := &answerReader{r: r, buf: buf, limit: limit, maxTokens: maxTokens, charge: charge}
	c, err := p.ws()
	if err != nil {
		return nil, err
	}
	var out []Rendered
	switch {
	case c < 0:
		return nil, answerErr("empty body")
	case !array:
		if c != '{' {
			return nil, answerErr("want a JSON object, got %s", describeAt(c))
		}
		r, err := p.rendered()
		if err != nil {
			return nil, err
		}
		out = []Rendered{r}
	default:
		if c != '[' {
			return nil, answerErr("want a JSON array of rendered prompts, got %s", describeAt(c))
		}
		p.i++
		if c, err = p.ws(); err != nil {
			return nil, err
		}
		if c == ']' {
			return nil, answerErr("no rendered prompt")
		}
		for {
			if c != '{' {
				if c < 0 {
					return nil, answerErr("offset %d: unterminated array", p.pos())
				}
				return nil, answerErr("prompt %d: want a JSON object, got %s", len(out), describeAt(c))
			}
			r, err := p.rendered()
			if err != nil {
				return nil, fmt.Errorf("prompt %d: %w", len(out), err)
			}
			out = append(out, r)
			if c, err = p.ws(); err != nil {
				return nil, err
			}
			if c == ']' {
				p.i++
				break
			}
			if c != ',' {
				if c < 0 {
					return nil, answerErr("offset %d: unterminated array", p.pos())
				}
				return nil, answerErr("offset %d: want ',' or ']' after a prompt, got %s", p.pos(), describeAt(c))
			}
			p.i++
			if c, err = p.ws(); err != nil {
				return nil, err
			}
		}
	}
	switch c, err := p.ws(); {
	case err != nil:
		return nil, err
	case c >= 0:
		return nil, answerErr("offset %d: data after the JSON value", p.pos())
	}
	return out, nil
}

func (p *answerReader) pos() int64 { return p.base + int64(p.i) }

// fill reads more of the answer once buf[i:n] is parsed: nil when buf[i]
// is readable, io.EOF at the end of the answer, or what stopped the read.
func (p *answerReader) fill() error {
	if p.i < p.n {
		return nil
	}
	if p.capturing {
		if err := p.keep(p.n); err != nil {
			return err
		}
		p.capStart = 0
	}
	p.base += int64(p.n)
	p.i, p.n = 0, 0
	for p.rerr == nil {
		n, err := p.r.Read(p.buf)
		p.n, p.rerr = n, err
		if p.limit > 0 && p.base+int64(n) > p.limit {
			p.n, p.rerr = 0, errAnswerTooLarge
			return p.rerr
		}
		if n > 0 {
			return nil
		}
	}
	return p.rerr
}

// look returns the byte to parse, without taking it: -1 at the end.
func (p *answerReader) look() (int, error) {
	if p.i < p.n {
		return int(p.buf[p.i]), nil
	}
	switch err := p.fill(); {
	case errors.Is(err, io.EOF):
		return -1, nil
	case err != nil:
		return -1, err
	}
	return int(p.buf[p.i]), nil
}

// ws skips white space and looks at the byte after it.
func (p *answerReader) ws() (int, error) {
	for {
		for p.i < p.n {
			switch c := p.buf[p.i]; c {
			case ' ', '\t', '\n', '\r':
				p.i++
			default:
				return int(c), nil
			}
		}
		if c, err := p.look(); c < 0 || err != nil {
			return c, err
		}
	}
}

// keep copies the captured bytes up to buf[end] into capt, charging the
// memory it grows by.
func (p *answerReader) keep(end int) error {
	b := p.buf[p.capStart:end]
	p.capStart = end
	if p.captOver {
		return nil
	}
	if len(p.capt)+len(b) > p.captMax {
		p.captOver = true
		return nil
	}
	if need := len(p.capt) + len(b); need > cap(p.capt) {
		grow := max(512, 2*cap(p.capt), need)
		if err := p.charged(int64(grow)); err != nil {
			return err
		}
		p.capt = append(make([]byte, 0, grow), p.capt...)
	}
	p.capt = append(p.capt, b...)
	return nil
}

func (p *answerReader) charged(n int64) error {
	if p.charge == nil {
		return nil
	}
	if err := p.charge(n); err != nil {
		return chargeError{err}
	}
	return nil
}

// capture copies the value at the read position, validated, into capt,
// and reports whether it fits in max bytes.
func (p *answerReader) capture(depth, max int) (bool, error) {
	if _, err := p.look(); err != nil {
		return false, err
	}
	p.capturing, p.captOver, p.capStart, p.captMax, p.capt = true, false, p.i, max, p.capt[:0]
	err := p.skipValue(depth)
	if err == nil {
		err = p.keep(p.i)
	}
	p.capturing = false
	return !p.captOver, err
}

// str reads the string at the read position, validated; ok is false when
// it is longer than max bytes (of JSON).
func (p *answerReader) str(max int, what string) (s string, ok bool, err error) {
	c, err := p.look()
	if err != nil {
		return "", false, err
	}
	if c != '"' {
		return "", false, answerErr("offset %d: %s: want a string, got %s", p.pos(), what, describeAt(c))
	}
	if ok, err = p.capture(1, max+2); err != nil || !ok {
		return "", ok, err
	}
	raw := p.capt[1 : len(p.capt)-1]
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw), true, nil
	}
	if err := json.Unmarshal(p.capt, &s); err != nil {
		return "", false, answerErr("%s: %v", what, err)
	}
	return s, true, nil
}

// optStr reads a string or null member value of at most maxAnswerString
// bytes: null reads as "" and not present.
func (p *answerReader) optStr(what string) (string, bool, error) {
	c, err := p.look()
	if err != nil {
		return "", false, err
	}
	if c == 'n' {
		return "", false, p.literal("null")
	}
	s, ok, err := p.str(maxAnswerString, what)
	if err == nil && !ok {
		err = answerErr("%s: longer than %d bytes", what, maxAnswerString)
	}
	return s, err == nil, err
}

// member reads a member name and its ':'; a name too long to be one the
// client reads is "".
func (p *answerReader) member() (string, error) {
	c, err := p.look()
	if err != nil {
		return "", err
	}
	if c != '"' {
		if c < 0 {
			return "", answerErr("offset %d: unterminated object", p.pos())
		}
		return "", answerErr("offset %d: want a member name, got %s", p.pos(), describeAt(c))
	}
	name, _, err := p.str(maxAnswerString, "member name")
	if err != nil {
		return "", err
	}
	if c, err = p.ws(); err != nil {
		return "", err
	}
	if c != ':' {
		return "", answerErr("offset %d: want ':' after member %q", p.pos(), name)
	}
	p.i++
	_, err = p.ws()
	return name, err
}

// next reads what follows an object member or array element: true at the
// closer, which it takes, false at ',' with the white space after it.
func (p *answerReader) next(closer byte, what string) (bool, error) {
	c, err := p.ws()
	if err != nil {
		return false, err
	}
	switch c {
	case int(closer):
		p.i++
		return true, nil
	case ',':
		p.i++
		_, err = p.ws()
		return false, err
	case -1:
		return false, answerErr("offset %d: unterminated %s", p.pos(), what)
	}
	return false, answerErr("offset %d: want ',' or %q in %s, got %s", p.pos(), closer, what, describeAt(c))
}

// rendered reads the GenerateRequest object at the read position.
func (p *answerReader) rendered() (Rendered, error) {
	var r Rendered
	var tokens []uint32
	var f wireFeatures
	seenTokens := false
	p.i++ // '{'
	c, err := p.ws()
	if err != nil {
		return r, err
	}
	if c == '}' {
		return r, answerErr("no token_ids")
	}
	for {
		name, err := p.member()
		if err != nil {
			return r, err
		}
		switch name {
		case "token_ids":
			seenTokens = true
			tokens, err = p.tokens()
		case "model":
			r.Model, _, err = p.optStr("model")
		case "cache_salt":
			r.Request.CacheSalt, r.saltEchoed, err = p.optStr("cache_salt")
		case "features":
			err = p.features(&f)
		default:
			err = p.skipValue(2)
		}
		if err != nil {
			return r, err
		}
		end, err := p.next('}', "object")
		if err != nil {
			return r, err
		}
		if end {
			break
		}
	}
	switch {
	case !seenTokens:
		return r, answerErr("no token_ids")
	case tokens == nil:
		return r, answerErr("token_ids is null")
	case len(tokens) == 0:
		return r, answerErr("token_ids is empty")
	}
	r.Request.Tokens = tokens
	r.Request.MM, err = f.items(len(tokens))
	return r, err
}

// features reads a GenerateRequest's features: null, or an object whose
// mm_hashes and mm_placeholders it keeps and whose tensors (kwargs_data,
// mm_metadata) and other members it skips.
func (p *answerReader) features(f *wireFeatures) error {
	c, err := p.look()
	if err != nil {
		return err
	}
	if c == 'n' {
		*f = wireFeatures{}
		return p.literal("null")
	}
	if c != '{' {
		return answerErr("features: want an object, got %s", describeAt(c))
	}
	// vLLM's parser keeps the last of duplicate members: so does this.
	*f = wireFeatures{}
	p.i++
	if c, err = p.ws(); err != nil {
		return err
	}
	if c == '}' {
		p.i++
		return nil
	}
	for {
		name, err := p.member()
		if err != nil {
			return err
		}
		switch name {
		case "mm_hashes", "mm_placeholders":
			ok, err := p.capture(3, maxFeatureBytes)
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("%w: features.%s of more than %d bytes", errTooManyItems, name, maxFeatureBytes)
			}
			if name == "mm_hashes" {
				f.MMHashes = nil
				err = json.Unmarshal(p.capt, &f.MMHashes)
			} else {
				f.MMPlaceholders = nil
				err = json.Unmarshal(p.capt, &f.MMPlaceholders)
			}
			if err != nil {
				return answerErr("features.%s: %v", name, err)
			}
		default:
			if err := p.skipValue(3); err != nil {
				return err
			}
		}
		if end, err := p.next('}', "features"); err != nil || end {
			return err
		}
	}
}

// skipValue validates the JSON value at the read position and reads past
// it. depth is the nesting of the value itself.
func (p *answerReader) skipValue(depth int) error {
	c, err := p.look()
	if err != nil {
		return err
	}
	switch {
	case c == '"':
		return p.skipString()
	case c == '{' || c == '[':
		if depth > maxDepth {
			return answerErr("offset %d: nested deeper than %d", p.pos(), maxDepth)
		}
		return p.skipContainer(depth)
	case c == '-' || (c >= '0' && c <= '9'):
		return p.skipNumber()
	case c == 't':
		return p.literal("true")
	case c == 'f':
		return p.literal("false")
	case c == 'n':
		return p.literal("null")
	case c < 0:
		return answerErr("offset %d: unexpected end, want a value", p.pos())
	}
	return answerErr("offset %d: want a value, got %s", p.pos(), describeAt(c))
}

func (p *answerReader) skipContainer(depth int) error {
	obj := p.buf[p.i] == '{'
	closer, what := byte(']'), "array"
	if obj {
		closer, what = '}', "object"
	}
	p.i++
	c, err := p.ws()
	if err != nil {
		return err
	}
	if c == int(closer) {
		p.i++
		return nil
	}
	for {
		if obj {
			if c != '"' {
				if c < 0 {
					return answerErr("offset %d: unterminated object", p.pos())
				}
				return answerErr("offset %d: want a member name, got %s", p.pos(), describeAt(c))
			}
			if err := p.skipString(); err != nil {
				return err
			}
			if c, err = p.ws(); err != nil {
				return err
			}
			if c != ':' {
				return answerErr("offset %d: want ':' after a member name", p.pos())
			}
			p.i++
			if _, err = p.ws(); err != nil {
				return err
			}
		}
		if err := p.skipValue(depth + 1); err != nil {
			return err
		}
		end, err := p.next(closer, what)
		if err != nil || end {
			return err
		}
		if c, err = p.look(); err != nil {
			return err
		}
	}
}

// skipString validates the string at the read position and reads past its
// closing quote.
func (p *answerReader) skipString() error {
	start := p.pos()
	p.i++ // '"'
	for {
		// Eight bytes at a time past those that need no look: a skipped
		// tensor is megabytes of base64.
		for p.n-p.i >= 8 && !special(binary.LittleEndian.Uint64(p.buf[p.i:])) {
			p.i += 8
		}
		for p.i < p.n {
			c := p.buf[p.i]
			switch {
			case c == '"':
				p.i++
				return nil
			case c == '\\':
				p.i++
				if err := p.escape(start); err != nil {
					return err
				}
				continue
			case c < 0x20:
				return answerErr("offset %d: control character %#02x in a string", p.pos(), c)
			}
			p.i++
		}
		if c, err := p.look(); err != nil {
			return err
		} else if c < 0 {
			return answerErr("offset %d: unterminated string", start)
		}
	}
}

// special reports whether any of the eight bytes of x ends a string
// run: a '"', a '\\' or a control character. (x - 0x01..01*k) &^ x has a
// byte's high bit set at every byte below k, and borrows only make it set
// above a byte that is.
func special(x uint64) bool {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	q := x ^ (ones * '"')
	b := x ^ (ones * '\\')
	return ((q-ones)&^q|(b-ones)&^b|(x-ones*0x20)&^x)&highs != 0
}

// escape validates the escape after a backslash.
func (p *answerReader) escape(start int64) error {
	c, err := p.look()
	switch {
	case err != nil:
		return err
	case c < 0:
		return answerErr("offset %d: unterminated string", start)
	}
	p.i++
	switch c {
	case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
		return nil
	case 'u':
		for range 4 {
			h, err := p.look()
			switch {
			case err != nil:
				return err
			case h < 0:
				return answerErr("offset %d: unterminated string", start)
			case !isHex(byte(h)):
				return answerErr(`offset %d: invalid \u escape`, p.pos())
			}
			p.i++
		}
		return nil
	}
	return answerErr("offset %d: invalid escape %s", p.pos()-1, describeAt(c))
}

// skipNumber validates a JSON number (RFC 8259's grammar).
func (p *answerReader) skipNumber() error {
	start := p.pos()
	bad := func() error { return answerErr("offset %d: invalid number", start) }
	digits := func() (int, error) {
		n := 0
		for {
			c, err := p.look()
			if err != nil || c < '0' || c > '9' {
				return n, err
			}
			p.i++
			n++
		}
	}
	c, err := p.look()
	if c == '-' {
		p.i++
		c, err = p.look()
	}
	switch {
	case err != nil:
		return err
	case c == '0':
		p.i++
	case c >= '1' && c <= '9':
		if _, err := digits(); err != nil {
			return err
		}
	default:
		return bad()
	}
	if c, err = p.look(); err != nil {
		return err
	}
	if c == '.' {
		p.i++
		if n, err := digits(); err != nil || n == 0 {
			return cmpErr(err, bad)
		}
		if c, err = p.look(); err != nil {
			return err
		}
	}
	if c == 'e' || c == 'E' {
		p.i++
		if c, err = p.look(); err != nil {
			return err
		}
		if c == '+' || c == '-' {
			p.i++
		}
		if n, err := digits(); err != nil || n == 0 {
			return cmpErr(err, bad)
		}
	}
	return nil
}

// cmpErr is err, or else bad's.
func cmpErr(err error, bad func() error) error {
	if err != nil {
		return err
	}
	return bad()
}

func (p *answerReader) literal(lit string) error {
	start := p.pos()
	for i := range len(lit) {
		c, err := p.look()
		if err != nil {
			return err
		}
		if c != int(lit[i]) {
			return answerErr("offset %d: invalid literal, want %s", start, lit)
		}
		p.i++
	}
	return nil
}

// describeAt names a byte, or the end (-1), for an error message.
func describeAt(c int) string {
	if c < 0 {
		return "the end of the answer"
	}
	return describe(byte(c))
}

// items flattens the per-modality hashes and placeholders into the
// prompt's multimodal items sorted by offset, as vLLM's engine sorts a
// request's mm_features before it keys blocks with them.
func (f *wireFeatures) items(tokens int) ([]hashing.MMItem, error) {
	if len(f.MMHashes) != len(f.MMPlaceholders) {
		return nil, answerErr("mm_hashes has %d modalities, mm_placeholders %d", len(f.MMHashes), len(f.MMPlaceholders))
	}
	n := 0
	for modality, hashes := range f.MMHashes {
		ph, ok := f.MMPlaceholders[modality]
		if !ok {
			return nil, answerErr("modality %q has hashes but no placeholders", modality)
		}
		if len(ph) != len(hashes) {
			return nil, answerErr("modality %q: %d hashes for %d placeholders", modality, len(hashes), len(ph))
		}
		n += len(hashes)
	}
	if n == 0 {
		return nil, nil
	}
	if n > tokens {
		return nil, answerErr("%d multimodal items in %d tokens", n, tokens)
	}
	items := make([]hashing.MMItem, 0, n)
	for modality, hashes := range f.MMHashes {
		for i, h := range hashes {
			p := f.MMPlaceholders[modality][i]
			if p.Offset == nil || p.Length == nil {
				return nil, answerErr("modality %q item %d: placeholder without offset or length", modality, i)
			}
			off, length := *p.Offset, *p.Length
			if off < 0 || length <= 0 || off > int64(tokens) || length > int64(tokens)-off {
				return nil, answerErr("modality %q item %d: placeholder [%d, +%d) outside the %d tokens", modality, i, off, length, tokens)
			}
			if h == "" {
				return nil, answerErr("modality %q item %d: empty hash", modality, i)
			}
			items = append(items, hashing.MMItem{ID: h, Offset: int(off), Length: int(length)})
		}
	}
	// Map order is random: sort by offset, and by hash only to make the
	// error below deterministic (offsets never tie in a valid answer).
	slices.SortFunc(items, func(a, b hashing.MMItem) int {
		if a.Offset != b.Offset {
			return a.Offset - b.Offset
		}
		return strings.Compare(a.ID, b.ID)
	})
	for i := 1; i < len(items); i++ {
		if prev := items[i-1]; items[i].Offset < prev.Offset+prev.Length {
			return nil, answerErr("placeholders [%d, +%d) and [%d, +%d) overlap", prev.Offset, prev.Length, items[i].Offset, items[i].Length)
		}
	}
	return items, nil
}

// tokens reads the token_ids value at the read position: null (nil), or
// an array of integers from 0 to math.MaxUint32 in JSON's grammar (no
// leading zeros, fractions or exponents), without encoding/json's
// reflection over every element, and no more of them than maxTokens.
func (p *answerReader) tokens() ([]uint32, error) {
	c, err := p.look()
	if err != nil {
		return nil, err
	}
	if c == 'n' {
		return nil, p.literal("null")
	}
	if c != '[' {
		return nil, answerErr("token_ids: want an array of integers, got %s", describeAt(c))
	}
	p.i++
	if c, err = p.ws(); err != nil {
		return nil, err
	}
	out := []uint32{}
	if c == ']' {
		p.i++
		return out, nil
	}
	for {
		// The number, c the byte after it (-1 at the end).
		var v uint64
		digits := 0
		lead := c
		for {
			i, n, buf := p.i, p.n, p.buf
			for i < n {
				d := buf[i] - '0'
				if d > 9 {
					break
				}
				v = v*10 + uint64(d)
				if v > math.MaxUint32 {
					return nil, answerErr("token_ids[%d] does not fit a uint32", len(out))
				}
				digits++
				i++
			}
			p.i = i
			if i < n {
				c = int(buf[i])
				break
			}
			if c, err = p.look(); err != nil {
				return nil, err
			}
			if c < '0' || c > '9' {
				break
			}
		}
		switch {
		case digits == 0 && c == '-':
			return nil, answerErr("token_ids[%d] is negative", len(out))
		case digits == 0, c == '.' || c == 'e' || c == 'E', digits > 1 && lead == '0':
			return nil, answerErr("token_ids[%d] is no non-negative integer", len(out))
		}
		if p.maxTokens > 0 && len(out) >= p.maxTokens {
			// Read no further: the prompt is refused whatever follows.
			return nil, fmt.Errorf("%w: more than %d", ErrTooManyTokens, p.maxTokens)
		}
		if len(out) == cap(out) {
			// Doubled as they arrive, up to maxTokens, each new array
			// charged whole: the ones it replaces are garbage still.
			grow := max(256, 2*cap(out))
			if p.maxTokens > 0 {
				grow = min(grow, p.maxTokens)
			}
			if err := p.charged(int64(grow) * 4); err != nil {
				return nil, err
			}
			// Not append's growth, which would not be the size charged.
			out = append(make([]uint32, 0, grow), out...)
		}
		out = append(out, uint32(v))
		// The common separator, a ',' and the next token's first digit,
		// without a call.
		if c == ',' && p.i+1 < p.n {
			if d := p.buf[p.i+1]; d-'0' <= 9 {
				p.i++
				c = int(d)
				continue
			}
		}
		end, err := p.next(']', "token_ids")
		if err != nil {
			return nil, err
		}
		if end {
			return out, nil
		}
		if c, err = p.look(); err != nil {
			return nil, err
		}
	}
}
