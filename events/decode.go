package events

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// ErrMalformed is wrapped by every error Decode returns: the payload is not an
// EventBatch this package understands, and no part of it should be applied.
var ErrMalformed = errors.New("events: malformed payload")

// Size bounds. A length beyond the bytes left in the payload is rejected
// before anything is allocated, so these bound the work a single large (but
// well-formed) payload can cause.
const (
	maxEvents   = 1 << 16
	maxBlocks   = 1 << 20
	maxTokens   = 1 << 24
	maxDepth    = 32
	maxHashSize = 64
)

// EventType is the kind of one KV-cache event.
type EventType uint8

// Event types vLLM publishes. EventUnknown marks an event of a type this
// package does not know (a newer engine's); it is skipped, the rest of its
// batch applies.
const (
	EventUnknown EventType = iota
	EventBlockStored
	EventBlockRemoved
	EventAllBlocksCleared
)

func (t EventType) String() string {
	switch t {
	case EventBlockStored:
		return "BlockStored"
	case EventBlockRemoved:
		return "BlockRemoved"
	case EventAllBlocksCleared:
		return "AllBlocksCleared"
	}
	return "unknown"
}

// Batch is one decoded EventBatch: everything an engine published in one
// scheduler step. Reuse one Batch across Decode calls: its slices, and those
// of its events, are recycled, so steady-state decoding does not allocate.
type Batch struct {
	// TS is when the engine published the batch: seconds since the Unix
	// epoch, as Python's time.time() gives them (vLLM's EventBatch.ts).
	TS float64
	// DPRank is the engine's data-parallel rank; absent when the payload
	// had no rank or a nil one (rank 0).
	DPRank Opt[int]
	Events []Event
}

// Event is one KV-cache event. Fields that an event type does not carry, or
// that the payload left out, hold their defaults.
type Event struct {
	Type EventType
	// TypeName is the payload's tag for an EventUnknown event, "" otherwise.
	TypeName string
	// BlockHashes are the engine's block keys: the int hash, or the last 8
	// bytes (big-endian) of a raw digest.
	BlockHashes []uint64
	// Parent is the key of the block before BlockHashes[0]; a BlockStored
	// without parent starts at block 0. A parent of 0 is llm-d's empty
	// block hash, which its producers send for a chain's first block: it
	// reads as absent, with ZeroParent set.
	Parent     Opt[uint64]
	ZeroParent bool
	// TokenIDs are all blocks' tokens concatenated; empty when the engine did
	// not send them (CPU offload events before self-describing events).
	TokenIDs  []uint32
	BlockSize int
	LoRAID    Opt[int]
	// Medium is the tier, upper-case; "GPU" when the payload had none.
	Medium   string
	LoRAName string
	// ExtraKeys holds, when the payload had them, one entry per block: the
	// raw msgpack of the block's extra-keys tuple, or nil for None. The
	// bytes are owned by the Event and valid until the next Decode into its
	// Batch.
	ExtraKeys Opt[[][]byte]
	// GroupIdx is the KV cache group (hybrid models); absent is group 0.
	GroupIdx Opt[int]

	extraBuf   []byte
	extraSpans []int
}

func (e *Event) reset() {
	e.Type = EventUnknown
	e.TypeName = ""
	e.BlockHashes = e.BlockHashes[:0]
	e.Parent, e.ZeroParent = Opt[uint64]{}, false
	e.TokenIDs = e.TokenIDs[:0]
	e.BlockSize = 0
	e.LoRAID = Opt[int]{}
	e.Medium = mediumGPU
	e.LoRAName = ""
	e.ExtraKeys = Opt[[][]byte]{v: e.ExtraKeys.v[:0]}
	e.GroupIdx = Opt[int]{}
	e.extraBuf = e.extraBuf[:0]
	e.extraSpans = e.extraSpans[:0]
}

// Blocks is the number of blocks the event names.
func (e *Event) Blocks() int { return len(e.BlockHashes) }

const (
	mediumGPU = "GPU"
	mediumCPU = "CPU"
)

// payloadReader is the io.ByteScanner the msgpack decoder reads from. Being a
// ByteScanner keeps msgpack from buffering, so the decoder and the fast
// paths below share one position.
type payloadReader struct {
	b []byte
	i int
}

func (r *payloadReader) Read(p []byte) (int, error) {
	if r.i >= len(r.b) {
		return 0, io.EOF
	}
	n := copy(p, r.b[r.i:])
	r.i += n
	return n, nil
}

func (r *payloadReader) ReadByte() (byte, error) {
	if r.i >= len(r.b) {
		return 0, io.EOF
	}
	c := r.b[r.i]
	r.i++
	return c, nil
}

func (r *payloadReader) UnreadByte() error {
	if r.i == 0 {
		return errors.New("events: unread at start")
	}
	r.i--
	return nil
}

func (r *payloadReader) remaining() int { return len(r.b) - r.i }

// Decoder decodes EventBatch payloads in every layout vLLM has used. The zero
// value is ready to use. A Decoder is not safe for concurrent use; give each
// goroutine its own.
type Decoder struct {
	r    payloadReader
	md   *msgpack.Decoder
	strs map[string]string
}

// NewDecoder returns a ready Decoder.
func NewDecoder() *Decoder {
	d := &Decoder{}
	d.init()
	return d
}

func (d *Decoder) init() {
	if d.md == nil {
		d.md = msgpack.NewDecoder(&d.r)
		d.strs = make(map[string]string)
	}
}

// Decode decodes payload into b, replacing its contents. On error the batch
// is not usable and must not be applied; the error wraps ErrMalformed.
// Decode never panics, whatever the input.
func (d *Decoder) Decode(payload []byte, b *Batch) error {
	d.init()
	d.r = payloadReader{b: payload}
	d.md.ResetReader(&d.r)
	b.TS, b.DPRank = 0, Opt[int]{}
	b.Events = b.Events[:0]
	if len(payload) == 0 {
		return fmt.Errorf("%w: empty payload", ErrMalformed)
	}
	if err := d.batch(b); err != nil {
		b.Events = b.Events[:0]
		return err
	}
	if d.r.remaining() != 0 {
		b.Events = b.Events[:0]
		return d.errorf("%d trailing bytes after the batch", d.r.remaining())
	}
	return nil
}

func (d *Decoder) errorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s (at byte %d)", ErrMalformed, fmt.Sprintf(format, args...), d.r.i)
}

func (d *Decoder) wrap(what string, err error) error {
	if errors.Is(err, ErrMalformed) {
		return err
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return d.errorf("truncated msgpack reading %s", what)
	}
	return d.errorf("reading %s: %v", what, err)
}

func (d *Decoder) peek(what string) (byte, error) {
	c, err := d.md.PeekCode()
	if err != nil {
		return 0, d.wrap(what, err)
	}
	return c, nil
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

func isInt(c byte) bool {
	return msgpcode.IsFixedNum(c) || (c >= msgpcode.Uint8 && c <= msgpcode.Int64)
}

// arrayLen reads an array header; nilOK allows nil, returned as -1. The
// length is bounded by the bytes left (each element takes at least one) and
// by limit.
func (d *Decoder) arrayLen(what string, nilOK bool, limit int) (int, error) {
	c, err := d.peek(what)
	if err != nil {
		return 0, err
	}
	if c == msgpcode.Nil && nilOK {
		d.r.i++
		return -1, nil
	}
	if !isArray(c) {
		return 0, d.errorf("bad field type: %s is not an array (code 0x%02x)", what, c)
	}
	n, err := d.md.DecodeArrayLen()
	if err != nil {
		return 0, d.wrap(what, err)
	}
	if n > d.r.remaining() || n > limit {
		return 0, d.errorf("%s: length %d exceeds the payload or the limit", what, n)
	}
	return n, nil
}

// str returns the bytes of a string (or bin) value, aliasing the payload.
func (d *Decoder) str(what string) ([]byte, error) {
	c, err := d.peek(what)
	if err != nil {
		return nil, err
	}
	if !msgpcode.IsString(c) && !msgpcode.IsBin(c) {
		return nil, d.errorf("bad field type: %s is not a string (code 0x%02x)", what, c)
	}
	n, err := d.md.DecodeBytesLen()
	if err != nil {
		return nil, d.wrap(what, err)
	}
	if n > d.r.remaining() {
		return nil, d.errorf("truncated msgpack reading %s", what)
	}
	s := d.r.b[d.r.i : d.r.i+n]
	d.r.i += n
	return s, nil
}

// intern returns b as a string without allocating for strings seen before
// (media, LoRA names). The table is bounded; past it strings are allocated.
func (d *Decoder) intern(b []byte) string {
	if s, ok := d.strs[string(b)]; ok {
		return s
	}
	s := string(b)
	if len(d.strs) < 1024 {
		d.strs[s] = s
	}
	return s
}

func (d *Decoder) isNil() bool {
	c, err := d.md.PeekCode()
	if err == nil && c == msgpcode.Nil {
		d.r.i++
		return true
	}
	return false
}

// int reads a signed integer that must fit in an int32 (ranks, sizes, ids).
func (d *Decoder) int(what string) (int, error) {
	c, err := d.peek(what)
	if err != nil {
		return 0, err
	}
	if !isInt(c) {
		return 0, d.errorf("bad field type: %s is not an integer (code 0x%02x)", what, c)
	}
	v, err := d.md.DecodeInt64()
	if err != nil {
		return 0, d.wrap(what, err)
	}
	if v < math.MinInt32 || v > math.MaxInt32 {
		return 0, d.errorf("%s %d out of range", what, v)
	}
	return int(v), nil
}

// uint reads a non-negative integer of up to 64 bits straight from the
// payload: the hot path (token ids, block hashes) stays free of per-value
// interface calls.
func (d *Decoder) uint(what string) (uint64, error) {
	r := &d.r
	if r.i >= len(r.b) {
		return 0, d.errorf("truncated msgpack reading %s", what)
	}
	c := r.b[r.i]
	if c <= msgpcode.PosFixedNumHigh {
		r.i++
		return uint64(c), nil
	}
	var n int
	signed := false
	switch c {
	case msgpcode.Uint8:
		n = 1
	case msgpcode.Uint16:
		n = 2
	case msgpcode.Uint32:
		n = 4
	case msgpcode.Uint64:
		n = 8
	case msgpcode.Int8:
		n, signed = 1, true
	case msgpcode.Int16:
		n, signed = 2, true
	case msgpcode.Int32:
		n, signed = 4, true
	case msgpcode.Int64:
		n, signed = 8, true
	default:
		if c >= msgpcode.NegFixedNumLow {
			return 0, d.errorf("%s is negative", what)
		}
		return 0, d.errorf("bad field type: %s is not an integer (code 0x%02x)", what, c)
	}
	if r.i+1+n > len(r.b) {
		return 0, d.errorf("truncated msgpack reading %s", what)
	}
	var v uint64
	for _, x := range r.b[r.i+1 : r.i+1+n] {
		v = v<<8 | uint64(x)
	}
	if signed && v>>(uint(n)*8-1) != 0 {
		return 0, d.errorf("%s is negative", what)
	}
	r.i += 1 + n
	return v, nil
}

// hash reads a block hash: an integer, or raw digest bytes reduced to their
// last 8 bytes, big-endian.
func (d *Decoder) hash(what string) (uint64, error) {
	r := &d.r
	if r.i < len(r.b) {
		c := r.b[r.i]
		if msgpcode.IsBin(c) || msgpcode.IsString(c) {
			b, err := d.str(what)
			if err != nil {
				return 0, err
			}
			if len(b) == 0 || len(b) > maxHashSize {
				return 0, d.errorf("%s: digest of %d bytes", what, len(b))
			}
			if len(b) > 8 {
				b = b[len(b)-8:]
			}
			var v uint64
			for _, x := range b {
				v = v<<8 | uint64(x)
			}
			return v, nil
		}
	}
	return d.uint(what)
}

// skip skips one value of any type, bounding nesting so that a hostile
// payload cannot recurse deeply.
func (d *Decoder) skip(depth int) error {
	if depth > maxDepth {
		return d.errorf("nesting deeper than %d", maxDepth)
	}
	c, err := d.peek("value")
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		n, err := d.arrayLen("array", false, d.r.remaining())
		if err != nil {
			return err
		}
		for range n {
			if err := d.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case isMap(c):
		n, err := d.md.DecodeMapLen()
		if err != nil {
			return d.wrap("map", err)
		}
		if n > d.r.remaining() {
			return d.errorf("map length %d exceeds the payload", n)
		}
		for range 2 * n {
			if err := d.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		_, err := d.str("value")
		return err
	case msgpcode.IsExt(c) || msgpcode.IsFixedExt(c):
		return d.skipExt(c)
	}
	if err := d.md.Skip(); err != nil {
		return d.wrap("value", err)
	}
	return nil
}

// skipExt skips an extension value in place. msgpack's own Skip reads the
// body into the Decoder's buffer and keeps that buffer grown even when the
// payload is shorter than the length claims, so every such payload would
// grow a long-lived Decoder by a megabyte or more.
func (d *Decoder) skipExt(c byte) error {
	r := &d.r
	n, hdr := 0, 0
	switch c {
	case msgpcode.FixExt1:
		n = 1
	case msgpcode.FixExt2:
		n = 2
	case msgpcode.FixExt4:
		n = 4
	case msgpcode.FixExt8:
		n = 8
	case msgpcode.FixExt16:
		n = 16
	case msgpcode.Ext8:
		hdr = 1
	case msgpcode.Ext16:
		hdr = 2
	case msgpcode.Ext32:
		hdr = 4
	}
	if r.remaining() < 1+hdr {
		return d.errorf("truncated msgpack reading an extension value")
	}
	for _, x := range r.b[r.i+1 : r.i+1+hdr] {
		n = n<<8 | int(x)
	}
	// Code byte, length, type byte, body.
	if n > r.remaining()-2-hdr {
		return d.errorf("truncated msgpack reading an extension value")
	}
	r.i += 2 + hdr + n
	return nil
}

func (d *Decoder) batch(b *Batch) error {
	c, err := d.peek("batch")
	if err != nil {
		return err
	}
	if isMap(c) {
		return d.mapBatch(b)
	}
	if !isArray(c) {
		return d.errorf("not an EventBatch: top level is not an array (code 0x%02x)", c)
	}
	n, err := d.arrayLen("batch", false, maxEvents)
	if err != nil {
		return err
	}
	if n < 2 {
		return d.errorf("not an EventBatch: %d elements", n)
	}
	if err := d.ts(b); err != nil {
		return err
	}
	if err := d.events(b); err != nil {
		return err
	}
	if n >= 3 {
		if err := d.rank(b); err != nil {
			return err
		}
		for range n - 3 {
			if err := d.skip(0); err != nil {
				return err
			}
		}
	}
	return nil
}

// mapBatch reads an EventBatch encoded as a map by field name: vLLM's
// EventBatch struct without msgspec's array_like, as in vLLM's main branch
// after the events became maps. Unknown fields are skipped.
func (d *Decoder) mapBatch(b *Batch) error {
	n, err := d.md.DecodeMapLen()
	if err != nil {
		return d.wrap("batch", err)
	}
	if n > d.r.remaining() {
		return d.errorf("batch map length %d exceeds the payload", n)
	}
	hasTS, hasEvents := false, false
	for range n {
		key, err := d.str("batch field name")
		if err != nil {
			return err
		}
		switch string(key) {
		case "ts":
			hasTS = true
			err = d.ts(b)
		case "events":
			hasEvents = true
			err = d.events(b)
		case "data_parallel_rank":
			err = d.rank(b)
		default:
			err = d.skip(1)
		}
		if err != nil {
			return err
		}
	}
	if !hasTS || !hasEvents {
		return d.errorf("not an EventBatch: a map without ts or events")
	}
	return nil
}

func (d *Decoder) ts(b *Batch) error {
	c, err := d.peek("ts")
	if err != nil {
		return err
	}
	if c != msgpcode.Double && c != msgpcode.Float && !isInt(c) {
		return d.errorf("bad field type: ts (code 0x%02x)", c)
	}
	if b.TS, err = d.md.DecodeFloat64(); err != nil {
		return d.wrap("ts", err)
	}
	return nil
}

func (d *Decoder) events(b *Batch) error {
	ne, err := d.arrayLen("events", false, maxEvents)
	if err != nil {
		return err
	}
	// Grown one event at a time: a hostile count costs no more than the
	// events that actually decode. Recycled events keep their slices.
	b.Events = b.Events[:0]
	for i := range ne {
		if len(b.Events) < cap(b.Events) {
			b.Events = b.Events[:i+1]
		} else {
			b.Events = append(b.Events, Event{})
		}
		e := &b.Events[i]
		e.reset()
		if err := d.event(e); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
	}
	return nil
}

// rank reads data_parallel_rank, which may be nil.
func (d *Decoder) rank(b *Batch) error {
	b.DPRank = Opt[int]{}
	if d.isNil() {
		return nil
	}
	rank, err := d.int("data_parallel_rank")
	if err != nil {
		return err
	}
	if rank < 0 {
		return d.errorf("negative data_parallel_rank %d", rank)
	}
	b.DPRank = Some(rank)
	return nil
}

// Field positions of the array layout, after the tag; the map layout uses
// the same names.
const (
	fHashes = iota
	fParent
	fTokens
	fBlockSize
	fLoRAID
	fMedium
	fLoRAName
	fExtraKeys
	fGroupIdx
	fOther
)

var storedFields = [...]int{fHashes, fParent, fTokens, fBlockSize, fLoRAID, fMedium, fLoRAName, fExtraKeys, fGroupIdx}
var removedFields = [...]int{fHashes, fMedium, fGroupIdx}

func fieldByName(name []byte) int {
	switch string(name) {
	case "block_hashes":
		return fHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokens
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoRAID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoRAName
	case "extra_keys":
		return fExtraKeys
	case "group_idx":
		return fGroupIdx
	}
	return fOther
}

func eventType(tag []byte) EventType {
	switch string(tag) {
	case "BlockStored":
		return EventBlockStored
	case "BlockRemoved":
		return EventBlockRemoved
	case "AllBlocksCleared":
		return EventAllBlocksCleared
	}
	return EventUnknown
}

func (d *Decoder) event(e *Event) error {
	c, err := d.peek("event")
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		return d.arrayEvent(e)
	case isMap(c):
		return d.mapEvent(e)
	}
	return d.errorf("bad field type: event is neither array nor map (code 0x%02x)", c)
}

func (d *Decoder) arrayEvent(e *Event) error {
	n, err := d.arrayLen("event", false, d.r.remaining())
	if err != nil {
		return err
	}
	if n < 1 {
		return d.errorf("event array without a type tag")
	}
	tag, err := d.str("event tag")
	if err != nil {
		return err
	}
	e.Type = eventType(tag)
	var fields []int
	switch e.Type {
	case EventBlockStored:
		fields = storedFields[:]
	case EventBlockRemoved:
		fields = removedFields[:]
	case EventUnknown:
		e.TypeName = string(tag)
	}
	seen := 0
	for i := range n - 1 {
		f := fOther
		if i < len(fields) {
			f = fields[i]
		}
		if f == fHashes {
			seen++
		}
		if err := d.field(e, f); err != nil {
			return err
		}
	}
	return d.check(e, seen > 0)
}

func (d *Decoder) mapEvent(e *Event) error {
	n, err := d.md.DecodeMapLen()
	if err != nil {
		return d.wrap("event", err)
	}
	if n > d.r.remaining() {
		return d.errorf("event map length %d exceeds the payload", n)
	}
	// The tag may come anywhere; fields before it are kept by name and
	// interpreted once the type is known, which vLLM's encoder (type first)
	// never needs.
	start := d.r.i
	typed := false
	for range n {
		key, err := d.str("event field name")
		if err != nil {
			return err
		}
		if string(key) == "type" {
			tag, err := d.str("event type")
			if err != nil {
				return err
			}
			e.Type = eventType(tag)
			if e.Type == EventUnknown {
				e.TypeName = string(tag)
			}
			typed = true
			break
		}
		if err := d.skip(1); err != nil {
			return err
		}
	}
	if !typed {
		return d.errorf("event map without a type")
	}
	// Second pass over every field but the tag.
	d.r.i = start
	seen := false
	for range n {
		key, err := d.str("event field name")
		if err != nil {
			return err
		}
		f := fieldByName(key)
		if string(key) == "type" || e.Type == EventUnknown || e.Type == EventAllBlocksCleared {
			f = fOther
		} else if e.Type == EventBlockRemoved && f != fHashes && f != fMedium && f != fGroupIdx {
			f = fOther
		}
		if f == fHashes {
			seen = true
		}
		if err := d.field(e, f); err != nil {
			return err
		}
	}
	return d.check(e, seen)
}

// check validates an event once all its fields are read.
func (d *Decoder) check(e *Event, hasHashes bool) error {
	switch e.Type {
	case EventBlockStored:
		if !hasHashes {
			return d.errorf("BlockStored without block_hashes")
		}
		nt := len(e.TokenIDs)
		if nt > 0 {
			// Hybrid models may skip blocks in block_hashes while token_ids
			// still covers them, so more tokens than blocks is allowed; a
			// partial block or fewer tokens than blocks is not.
			if e.BlockSize <= 0 || nt%e.BlockSize != 0 || nt < len(e.BlockHashes)*e.BlockSize {
				return d.errorf("token_ids length %d does not match %d block_hashes and block_size %d",
					nt, len(e.BlockHashes), e.BlockSize)
			}
		}
		if x := e.ExtraKeys.v; e.ExtraKeys.ok && len(x) != len(e.BlockHashes) && len(x) != nt/max(e.BlockSize, 1) {
			return d.errorf("extra_keys has %d entries for %d blocks", len(x), len(e.BlockHashes))
		}
	case EventBlockRemoved:
		if !hasHashes {
			return d.errorf("BlockRemoved without block_hashes")
		}
	}
	return nil
}

func (d *Decoder) field(e *Event, f int) error {
	var err error
	switch f {
	case fHashes:
		n, err := d.arrayLen("block_hashes", false, maxBlocks)
		if err != nil {
			return err
		}
		if cap(e.BlockHashes) < n {
			e.BlockHashes = make([]uint64, n)
		}
		e.BlockHashes = e.BlockHashes[:n]
		for i := range e.BlockHashes {
			// Python packs hashes of 2^56 and above as uint64, nearly all.
			if r := &d.r; r.i+9 <= len(r.b) && r.b[r.i] == msgpcode.Uint64 {
				e.BlockHashes[i] = binary.BigEndian.Uint64(r.b[r.i+1:])
				r.i += 9
				continue
			}
			if e.BlockHashes[i], err = d.hash("block_hashes"); err != nil {
				return err
			}
		}
	case fParent:
		if d.isNil() {
			return nil
		}
		if e.Parent.v, err = d.hash("parent_block_hash"); err != nil {
			return err
		}
		// No engine key is 0 but by a 2^-64 chance; llm-d means "none".
		e.Parent.ok = e.Parent.v != 0
		e.ZeroParent = e.Parent.v == 0
	case fTokens:
		n, err := d.arrayLen("token_ids", true, maxTokens)
		if err != nil || n < 0 {
			return err
		}
		if cap(e.TokenIDs) < n {
			e.TokenIDs = make([]uint32, n)
		}
		e.TokenIDs = e.TokenIDs[:n]
		return d.tokens(e.TokenIDs)
	case fBlockSize:
		if d.isNil() {
			return nil
		}
		if e.BlockSize, err = d.int("block_size"); err != nil {
			return err
		}
		if e.BlockSize < 0 {
			return d.errorf("negative block_size %d", e.BlockSize)
		}
	case fLoRAID:
		if d.isNil() {
			return nil
		}
		if e.LoRAID.v, err = d.int("lora_id"); err != nil {
			return err
		}
		e.LoRAID.ok = true
	case fMedium:
		if d.isNil() {
			return nil
		}
		s, err := d.str("medium")
		if err != nil {
			return err
		}
		e.Medium = d.medium(s)
	case fLoRAName:
		if d.isNil() {
			return nil
		}
		s, err := d.str("lora_name")
		if err != nil {
			return err
		}
		e.LoRAName = d.intern(s)
	case fExtraKeys:
		return d.extraKeys(e)
	case fGroupIdx:
		if d.isNil() {
			return nil
		}
		if e.GroupIdx.v, err = d.int("group_idx"); err != nil {
			return err
		}
		if e.GroupIdx.v < 0 {
			return d.errorf("negative group_idx %d", e.GroupIdx.v)
		}
		e.GroupIdx.ok = true
	default:
		return d.skip(1)
	}
	return nil
}

// tokens fills dst from a token-id array whose header was read. The usual
// encodings are decoded inline; anything else goes through uint, which
// also reports errors.
func (d *Decoder) tokens(dst []uint32) error {
	b, i := d.r.b, d.r.i
	for j := range dst {
		if i+5 <= len(b) {
			switch c := b[i]; {
			case c <= msgpcode.PosFixedNumHigh:
				dst[j] = uint32(c)
				i++
				continue
			case c == msgpcode.Uint8:
				dst[j] = uint32(b[i+1])
				i += 2
				continue
			case c == msgpcode.Uint16:
				dst[j] = uint32(binary.BigEndian.Uint16(b[i+1:]))
				i += 3
				continue
			case c == msgpcode.Uint32:
				dst[j] = binary.BigEndian.Uint32(b[i+1:])
				i += 5
				continue
			}
		}
		d.r.i = i
		v, err := d.uint("token_ids")
		if err != nil {
			return err
		}
		if v > math.MaxUint32 {
			return d.errorf("token id %d out of range", v)
		}
		dst[j] = uint32(v)
		i = d.r.i
	}
	d.r.i = i
	return nil
}

func (d *Decoder) medium(s []byte) string {
	switch string(s) {
	case "GPU", "gpu", "cuda", "CUDA":
		return mediumGPU
	case "CPU", "cpu":
		return mediumCPU
	}
	// On the stack: intern copies only a medium it has not seen.
	var buf [32]byte
	up := buf[:0]
	for _, c := range s {
		if 'a' <= c && c <= 'z' {
			c -= 'a' - 'A'
		}
		up = append(up, c)
	}
	return d.intern(up)
}

func (d *Decoder) extraKeys(e *Event) error {
	n, err := d.arrayLen("extra_keys", true, maxBlocks)
	if err != nil || n < 0 {
		return err
	}
	e.ExtraKeys.ok = true
	// Spans first, slices after: extraBuf may move while it grows.
	e.extraSpans = e.extraSpans[:0]
	for i := range n {
		if d.isNil() {
			e.extraSpans = append(e.extraSpans, -1, -1)
			continue
		}
		c, err := d.peek("extra_keys")
		if err != nil {
			return err
		}
		if !isArray(c) {
			return d.errorf("bad field type: extra_keys[%d] is not a tuple (code 0x%02x)", i, c)
		}
		lo := d.r.i
		if err := d.skip(2); err != nil {
			return err
		}
		off := len(e.extraBuf)
		e.extraBuf = append(e.extraBuf, d.r.b[lo:d.r.i]...)
		e.extraSpans = append(e.extraSpans, off, len(e.extraBuf))
	}
	if cap(e.ExtraKeys.v) < n {
		e.ExtraKeys.v = make([][]byte, n)
	}
	e.ExtraKeys.v = e.ExtraKeys.v[:n]
	for i := range e.ExtraKeys.v {
		lo, hi := e.extraSpans[2*i], e.extraSpans[2*i+1]
		if lo < 0 {
			e.ExtraKeys.v[i] = nil
			continue
		}
		e.ExtraKeys.v[i] = e.extraBuf[lo:hi:hi]
	}
	return nil
}
