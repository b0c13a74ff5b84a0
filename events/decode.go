package events

import (
	"errors"
	"fmt"
	"math"

	"github.com/kvsource/kvsource/internal/msgpackr"
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
	// CacheSalt is the cache_salt of SGLang's BlockStoredWithMetadata (a
	// metadata map where vLLM's layout has lora_name); "" when none.
	CacheSalt string
	// Bigram is set when token_ids came as SGLang's EAGLE pairs
	// [[t0,t1],[t1,t2],...]: TokenIDs then holds each pair's first token,
	// so a block's tokens are the prompt's as without EAGLE, and
	// BigramNext is the last pair's second token (the token after the
	// event's last block), which SGLang's EAGLE keys hash too.
	Bigram     bool
	BigramNext uint32

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
	e.CacheSalt = ""
	e.Bigram, e.BigramNext = false, 0
	e.extraBuf = e.extraBuf[:0]
	e.extraSpans = e.extraSpans[:0]
}

// Blocks is the number of blocks the event names.
func (e *Event) Blocks() int { return len(e.BlockHashes) }

const (
	mediumGPU = "GPU"
	mediumCPU = "CPU"
)

// Decoder decodes EventBatch payloads in every layout vLLM has used. The zero
// value is ready to use. A Decoder is not safe for concurrent use; give each
// goroutine its own.
type Decoder struct {
	r    msgpackr.Reader
	strs map[string]string
}

// NewDecoder returns a ready Decoder.
func NewDecoder() *Decoder {
	d := &Decoder{}
	d.init()
	return d
}

func (d *Decoder) init() {
	if d.strs == nil {
		d.strs = make(map[string]string)
	}
}

// Decode decodes payload into b, replacing its contents. On error the batch
// is not usable and must not be applied; the error wraps ErrMalformed.
// Decode never panics, whatever the input.
func (d *Decoder) Decode(payload []byte, b *Batch) error {
	d.init()
	d.r.Reset(payload)
	b.TS, b.DPRank = 0, Opt[int]{}
	b.Events = b.Events[:0]
	if len(payload) == 0 {
		return fmt.Errorf("%w: empty payload", ErrMalformed)
	}
	if err := d.batch(b); err != nil {
		b.Events = b.Events[:0]
		return err
	}
	if d.r.Len() != 0 {
		b.Events = b.Events[:0]
		return d.errorf("%d trailing bytes after the batch", d.r.Len())
	}
	return nil
}

func (d *Decoder) errorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s (at byte %d)", ErrMalformed, fmt.Sprintf(format, args...), d.r.Pos())
}

// wrap makes a reader's error one of Decode's, naming the field read.
func (d *Decoder) wrap(what string, err error) error {
	return fmt.Errorf("%w: reading %s: %v (at byte %d)", ErrMalformed, what, err, d.r.Pos())
}

func (d *Decoder) peek(what string) (msgpackr.Kind, error) {
	c, err := d.r.Peek()
	if err != nil {
		return msgpackr.KindInvalid, d.wrap(what, err)
	}
	return msgpackr.KindOf(c), nil
}

// arrayLen reads an array header; nilOK allows nil, returned as -1. The
// length is bounded by the bytes left (each element takes at least one) and
// by limit.
func (d *Decoder) arrayLen(what string, nilOK bool, limit int) (int, error) {
	if nilOK && d.r.Nil() {
		return -1, nil
	}
	n, err := d.r.ArrayLen()
	if err != nil {
		return 0, d.wrap(what, err)
	}
	if n > limit {
		return 0, d.errorf("%s: length %d exceeds the limit", what, n)
	}
	return n, nil
}

func (d *Decoder) mapLen(what string) (int, error) {
	n, err := d.r.MapLen()
	if err != nil {
		return 0, d.wrap(what, err)
	}
	return n, nil
}

// str returns the bytes of a string (or bin) value, aliasing the payload.
func (d *Decoder) str(what string) ([]byte, error) {
	s, err := d.r.Bytes()
	if err != nil {
		return nil, d.wrap(what, err)
	}
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

// int reads a signed integer that must fit in an int32 (ranks, sizes, ids).
func (d *Decoder) int(what string) (int, error) {
	v, err := d.r.Int()
	if err != nil {
		return 0, d.wrap(what, err)
	}
	if v < math.MinInt32 || v > math.MaxInt32 {
		return 0, d.errorf("%s %d out of range", what, v)
	}
	return int(v), nil
}

// hash reads a block hash: an integer, signed or not (a negative one is its
// 64-bit two's-complement pattern), or raw digest bytes reduced to their
// last 8 bytes, big-endian.
func (d *Decoder) hash(what string) (uint64, error) {
	if k, _ := d.peek(what); k == msgpackr.KindBin || k == msgpackr.KindStr {
		b, err := d.str(what)
		if err != nil {
			return 0, err
		}
		if k == msgpackr.KindStr {
			if v, ok := hexKey(b); ok {
				return v, nil
			}
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
	// Signed producers (SGLang, TensorRT-LLM, Dynamo) send a hash as int64:
	// its bit pattern is the key, as Dynamo's decoder reads it.
	v, err := d.r.Word()
	if err != nil {
		return 0, d.wrap(what, err)
	}
	return v, nil
}

// hexKey reads a hash sent as a hex string of a SHA-256 digest
// (TensorRT-LLM's v2_sha256 events): its key is the digest's first 8 bytes
// big-endian, which is what the same engine sends as v2_sha256_64, so both
// forms index a block under one key.
func hexKey(s []byte) (uint64, bool) {
	if len(s) != 2*32 {
		return 0, false
	}
	var v uint64
	for i, c := range s {
		var x byte
		switch {
		case '0' <= c && c <= '9':
			x = c - '0'
		case 'a' <= c && c <= 'f':
			x = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			x = c - 'A' + 10
		default:
			return 0, false
		}
		if i < 16 {
			v = v<<4 | uint64(x)
		}
	}
	return v, true
}

// skip skips one value of any type at the given nesting depth, bounding
// nesting so that a hostile payload cannot recurse deeply.
func (d *Decoder) skip(depth int) error {
	if err := d.r.Skip(maxDepth - depth); err != nil {
		return d.wrap("a skipped value", err)
	}
	return nil
}

func (d *Decoder) batch(b *Batch) error {
	k, err := d.peek("batch")
	if err != nil {
		return err
	}
	if k == msgpackr.KindMap {
		return d.mapBatch(b)
	}
	if k != msgpackr.KindArray {
		return d.errorf("not an EventBatch: top level is a %s, not an array", k)
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
	n, err := d.mapLen("batch")
	if err != nil {
		return err
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
	var err error
	if b.TS, err = d.r.Float(); err != nil {
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
	if d.r.Nil() {
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
	case "metadata":
		// SGLang's BlockStoredWithMetadata by name; by position it is
		// where vLLM's lora_name is.
		return fLoRAName
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
	k, err := d.peek("event")
	if err != nil {
		return err
	}
	switch k {
	case msgpackr.KindArray:
		return d.arrayEvent(e)
	case msgpackr.KindMap:
		return d.mapEvent(e)
	}
	return d.errorf("bad field type: event is a %s, neither array nor map", k)
}

func (d *Decoder) arrayEvent(e *Event) error {
	n, err := d.arrayLen("event", false, math.MaxInt)
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
	n, err := d.mapLen("event")
	if err != nil {
		return err
	}
	// The tag may come anywhere; fields before it are kept by name and
	// interpreted once the type is known, which vLLM's encoder (type first)
	// never needs.
	start := d.r.Pos()
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
	d.r.Seek(start)
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
		// Integers of either sign in one pass; a raw digest (or an error,
		// which hash reports) stops it, and hash reads that one.
		for i := 0; i < n; i++ {
			k, err := d.r.Words(e.BlockHashes[i:])
			if i += k; err == nil {
				break
			}
			if e.BlockHashes[i], err = d.hash("block_hashes"); err != nil {
				return err
			}
		}
	case fParent:
		if d.r.Nil() {
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
		if n > 0 {
			if k, _ := d.peek("token_ids"); k == msgpackr.KindArray {
				return d.tokenPairs(e, n)
			}
		}
		if cap(e.TokenIDs) < n {
			e.TokenIDs = make([]uint32, n)
		}
		e.TokenIDs = e.TokenIDs[:n]
		if err := d.r.Uint32s(e.TokenIDs); err != nil {
			return d.wrap("token_ids", err)
		}
	case fBlockSize:
		if d.r.Nil() {
			return nil
		}
		if e.BlockSize, err = d.int("block_size"); err != nil {
			return err
		}
		if e.BlockSize < 0 {
			return d.errorf("negative block_size %d", e.BlockSize)
		}
	case fLoRAID:
		if d.r.Nil() {
			return nil
		}
		if e.LoRAID.v, err = d.int("lora_id"); err != nil {
			return err
		}
		e.LoRAID.ok = true
	case fMedium:
		if d.r.Nil() {
			return nil
		}
		s, err := d.str("medium")
		if err != nil {
			return err
		}
		e.Medium = d.medium(s)
	case fLoRAName:
		if d.r.Nil() {
			return nil
		}
		if k, _ := d.peek("lora_name"); k == msgpackr.KindMap {
			return d.metadata(e)
		}
		s, err := d.str("lora_name")
		if err != nil {
			return err
		}
		e.LoRAName = d.intern(s)
	case fExtraKeys:
		return d.extraKeys(e)
	case fGroupIdx:
		if d.r.Nil() {
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

func (d *Decoder) medium(s []byte) string {
	switch string(s) {
	case "GPU", "gpu", "cuda", "CUDA":
		return mediumGPU
	case "CPU", "cpu", "CPU_PINNED", "cpu_pinned":
		// CPU_PINNED is SGLang's HiCache host tier.
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

// tokenPairs reads SGLang's EAGLE token_ids, n pairs [a, b] of
// consecutive tokens (each b the next pair's a), into e as Bigram
// describes.
func (d *Decoder) tokenPairs(e *Event, n int) error {
	if cap(e.TokenIDs) < n {
		e.TokenIDs = make([]uint32, n)
	}
	e.TokenIDs = e.TokenIDs[:n]
	var pair [2]uint32
	for i := range n {
		if _, err := d.arrayLen("token_ids pair", false, 2); err != nil {
			return err
		}
		if err := d.r.Uint32s(pair[:]); err != nil {
			return d.wrap("token_ids pair", err)
		}
		if i > 0 && pair[0] != e.BigramNext {
			return d.errorf("token_ids pair %d starts with %d, not the previous pair's %d", i, pair[0], e.BigramNext)
		}
		e.TokenIDs[i], e.BigramNext = pair[0], pair[1]
	}
	e.Bigram = true
	return nil
}

// metadata reads SGLang's BlockStoredMetadata map, of which only
// cache_salt is known; other keys are skipped.
func (d *Decoder) metadata(e *Event) error {
	n, err := d.mapLen("metadata")
	if err != nil {
		return err
	}
	for range n {
		key, err := d.str("metadata field name")
		if err != nil {
			return err
		}
		if string(key) != "cache_salt" || d.r.Nil() {
			if err := d.skip(2); err != nil {
				return err
			}
			continue
		}
		s, err := d.str("cache_salt")
		if err != nil {
			return err
		}
		e.CacheSalt = string(s)
	}
	return nil
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
		if d.r.Nil() {
			e.extraSpans = append(e.extraSpans, -1, -1)
			continue
		}
		k, err := d.peek("extra_keys")
		if err != nil {
			return err
		}
		if k != msgpackr.KindArray {
			return d.errorf("bad field type: extra_keys[%d] is a %s, not a tuple", i, k)
		}
		lo := d.r.Pos()
		if err := d.skip(2); err != nil {
			return err
		}
		off := len(e.extraBuf)
		e.extraBuf = append(e.extraBuf, d.r.Since(lo)...)
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
