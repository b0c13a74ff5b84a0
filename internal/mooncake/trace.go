package mooncake

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
)

// Record is one request of a Mooncake trace.
type Record struct {
	// Timestamp is the request's arrival, in milliseconds since the trace's
	// start.
	Timestamp int64
	// InputLength and OutputLength are the prompt's and the answer's
	// lengths in tokens.
	InputLength  int
	OutputLength int
	// HashIDs are the prompt's block ids: equal ids at equal positions are
	// the same KV blocks (a shared prefix). How many tokens an id stands for
	// is the trace's convention (512 in the FAST'25 release), not the
	// record's.
	HashIDs []uint64
}

// Limits of one line: a trace is input, and a line or an id list without a
// bound would let one line take all memory. The FAST'25 traces' longest
// line is about 2 KB.
const (
	MaxLineBytes = 1 << 20
	MaxHashIDs   = 1 << 16
	// MaxLength bounds InputLength and OutputLength (tokens).
	MaxLength = math.MaxInt32
)

// Errors of Read, wrapped in a *LineError naming the line.
var (
	ErrMalformed      = errors.New("mooncake: not a JSON object")
	ErrMissingField   = errors.New("mooncake: missing field")
	ErrBadValue       = errors.New("mooncake: bad value")
	ErrLineTooLong    = errors.New("mooncake: line too long")
	ErrTooManyHashIDs = errors.New("mooncake: too many hash_ids")
)

// LineError is an error of one line of a trace (1-based), and of one field
// when Field is set.
type LineError struct {
	Line   int
	Field  string
	Detail string
	Err    error
}

func (e *LineError) Error() string {
	msg := fmt.Sprintf("mooncake: line %d", e.Line)
	if e.Field != "" {
		msg += ": " + e.Field
	}
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	return msg + ": " + e.Err.Error()
}

func (e *LineError) Unwrap() error { return e.Err }

// rawRecord keeps each field's JSON text, so that a wrong type, a fraction
// or a negative number is reported as such rather than as what
// encoding/json makes of it (it takes a quoted number for a json.Number).
type rawRecord struct {
	Timestamp    json.RawMessage `json:"timestamp"`
	InputLength  json.RawMessage `json:"input_length"`
	OutputLength json.RawMessage `json:"output_length"`
	HashIDs      json.RawMessage `json:"hash_ids"`
}

// Read reads a trace: one JSON object a line with timestamp, input_length,
// output_length (non-negative integers) and hash_ids (a non-empty array of
// non-negative integers); other fields are ignored, blank lines skipped.
// The first bad line ends the read with a *LineError.
func Read(r io.Reader) ([]Record, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), MaxLineBytes)
	var recs []Record
	line := 0
	for sc.Scan() {
		line++
		text := sc.Bytes()
		if len(bytes.TrimSpace(text)) == 0 {
			continue
		}
		rec, err := parseLine(text)
		if err != nil {
			err.Line = line
			return nil, err
		}
		recs = append(recs, rec)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, &LineError{Line: line + 1, Detail: fmt.Sprintf("longer than %d bytes", MaxLineBytes), Err: ErrLineTooLong}
		}
		return nil, fmt.Errorf("mooncake: after line %d: %w", line, err)
	}
	return recs, nil
}

func parseLine(text []byte) (Record, *LineError) {
	var raw rawRecord
	if err := json.Unmarshal(text, &raw); err != nil {
		return Record{}, &LineError{Detail: err.Error(), Err: ErrMalformed}
	}
	var rec Record
	var err *LineError
	if rec.Timestamp, err = parseInt(raw.Timestamp, "timestamp", math.MaxInt64); err != nil {
		return Record{}, err
	}
	in, err := parseInt(raw.InputLength, "input_length", MaxLength)
	if err != nil {
		return Record{}, err
	}
	out, err := parseInt(raw.OutputLength, "output_length", MaxLength)
	if err != nil {
		return Record{}, err
	}
	rec.InputLength, rec.OutputLength = int(in), int(out)
	if rec.HashIDs, err = parseIDs(raw.HashIDs); err != nil {
		return Record{}, err
	}
	return rec, nil
}

func isNull(raw json.RawMessage) bool { return len(raw) == 0 || string(raw) == "null" }

// parseInt parses a field that must be an integer in [0, max].
func parseInt(raw json.RawMessage, field string, max int64) (int64, *LineError) {
	if isNull(raw) {
		return 0, &LineError{Field: field, Err: ErrMissingField}
	}
	if err := checkInteger(raw); err != "" {
		return 0, &LineError{Field: field, Detail: err, Err: ErrBadValue}
	}
	v, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil || v > max {
		return 0, &LineError{Field: field, Detail: fmt.Sprintf("%s is out of range [0, %d]", raw, max), Err: ErrBadValue}
	}
	if v < 0 {
		return 0, &LineError{Field: field, Detail: fmt.Sprintf("%s is negative", raw), Err: ErrBadValue}
	}
	return v, nil
}

// checkInteger says what is wrong with a JSON value that should be an
// integer, "" when nothing: a JSON number without fraction or exponent.
func checkInteger(raw []byte) string {
	if len(raw) == 0 || (raw[0] != '-' && (raw[0] < '0' || raw[0] > '9')) {
		return fmt.Sprintf("%.40s is not a number", raw)
	}
	if bytes.ContainsAny(raw, ".eE") {
		return fmt.Sprintf("%s is not an integer", raw)
	}
	return ""
}

// parseIDs parses hash_ids. encoding/json has checked the syntax, so each
// element is one JSON value; a number has no comma or bracket in it.
func parseIDs(raw json.RawMessage) ([]uint64, *LineError) {
	const field = "hash_ids"
	if isNull(raw) {
		return nil, &LineError{Field: field, Err: ErrMissingField}
	}
	if raw[0] != '[' {
		return nil, &LineError{Field: field, Detail: fmt.Sprintf("%.40s is not an array", raw), Err: ErrBadValue}
	}
	var ids []uint64
	i := skipSpace(raw, 1)
	for i < len(raw) && raw[i] != ']' {
		j := i
		for j < len(raw) && strings.IndexByte("0123456789+-.eE", raw[j]) >= 0 {
			j++
		}
		elem := fmt.Sprintf("%s[%d]", field, len(ids))
		tok := raw[i:j]
		if j == i {
			tok = raw[i:]
		}
		if msg := checkInteger(tok); msg != "" {
			return nil, &LineError{Field: elem, Detail: msg, Err: ErrBadValue}
		}
		if tok[0] == '-' && string(tok) != "-0" {
			return nil, &LineError{Field: elem, Detail: fmt.Sprintf("%s is negative", tok), Err: ErrBadValue}
		}
		v, err := strconv.ParseUint(string(bytes.TrimPrefix(tok, []byte("-"))), 10, 64)
		if err != nil {
			return nil, &LineError{Field: elem, Detail: fmt.Sprintf("%s is out of range [0, %d]", tok, uint64(math.MaxUint64)), Err: ErrBadValue}
		}
		if len(ids) == MaxHashIDs {
			return nil, &LineError{Field: field, Detail: fmt.Sprintf("more than %d", MaxHashIDs), Err: ErrTooManyHashIDs}
		}
		ids = append(ids, v)
		i = skipSpace(raw, j)
		if i < len(raw) && raw[i] == ',' {
			i = skipSpace(raw, i+1)
		}
	}
	if len(ids) == 0 {
		return nil, &LineError{Field: field, Detail: "empty", Err: ErrBadValue}
	}
	return ids, nil
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}
