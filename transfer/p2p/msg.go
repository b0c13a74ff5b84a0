//go:build cgo

package p2p

import (
	"bytes"
	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvsource/kvsource/internal/msgpackr"
)

// Message types, the values of the "type" key.
const (
	TypeConnect      = "connect"
	TypeConnectAck   = "connect_ack"
	TypeLookup       = "lookup"
	TypeLookupResp   = "lookup_resp"
	TypeFetch        = "fetch"
	TypeTransferDone = "transfer_done"
	TypeAbortFetch   = "abort_fetch"
	TypeAbortAck     = "abort_ack"
	TypeDisconnect   = "disconnect"
)

// ErrMalformed is wrapped by every decoding and validation error: a message
// that is not a msgpack map of the fields its type requires.
var ErrMalformed = errors.New("p2p: malformed message")

// message is any protocol message: Type says which fields are meaningful.
// Encoding writes exactly the fields of Type.
type message struct {
	Type string

	// connect
	PeerID            string // also connect_ack
	AgentMetadata     []byte
	BaseAddr          uint64
	NumBlocks         uint64
	BlockLen          uint64
	ConfigFingerprint string
	HashSeed          string

	// lookup, lookup_resp, fetch, transfer_done, abort_fetch, abort_ack
	KVRequestID  string
	Keys         [][]byte // lookup, lookup_resp, fetch
	Hits         []bool   // lookup_resp
	BlockIndexes []uint64 // fetch
	RoundSeq     uint64   // absent on the wire reads as 0
	Success      bool     // transfer_done
}

// Field presence bits, to tell a missing field from a zero one.
const (
	hasPeerID = 1 << iota
	hasAgentMetadata
	hasBaseAddr
	hasNumBlocks
	hasBlockLen
	hasConfigFingerprint
	hasHashSeed
	hasKVRequestID
	hasKeys
	hasHits
	hasBlockIndexes
	hasSuccess
)

// required lists the fields each type must carry. round_seq is never
// required (older peers omit it) and config_fingerprint may be absent.
var required = map[string]int{
	TypeConnect:      hasPeerID | hasAgentMetadata | hasBaseAddr | hasNumBlocks | hasBlockLen | hasHashSeed,
	TypeConnectAck:   hasPeerID,
	TypeLookup:       hasKVRequestID | hasKeys,
	TypeLookupResp:   hasKVRequestID | hasKeys | hasHits,
	TypeFetch:        hasKVRequestID | hasKeys | hasBlockIndexes,
	TypeTransferDone: hasKVRequestID | hasSuccess,
	TypeAbortFetch:   hasKVRequestID,
	TypeAbortAck:     hasKVRequestID,
	TypeDisconnect:   0,
}

// encode appends m's msgpack encoding to a fresh buffer. Maps are written
// with "type" first and then the fields in the order of the protocol table
// in the package documentation, so encodings are deterministic; strings as
// str, keys and metadata as bin, integers in their smallest form.
func (m *message) encode() ([]byte, error) {
	size := 96 + len(m.PeerID) + len(m.AgentMetadata) + len(m.ConfigFingerprint) + len(m.HashSeed) +
		len(m.KVRequestID) + 2*len(m.Hits) + 10*len(m.BlockIndexes)
	for _, k := range m.Keys {
		size += len(k) + 2
	}
	buf := bytes.NewBuffer(make([]byte, 0, size))
	e := msgpack.GetEncoder()
	defer msgpack.PutEncoder(e)
	e.Reset(buf)
	str := func(k, v string) {
		_ = e.EncodeString(k)
		_ = e.EncodeString(v)
	}
	uint := func(k string, v uint64) {
		_ = e.EncodeString(k)
		_ = e.EncodeUint(v)
	}
	keys := func() {
		_ = e.EncodeString("keys")
		_ = e.EncodeArrayLen(len(m.Keys))
		for _, k := range m.Keys {
			_ = e.EncodeBytes(k)
		}
	}
	n, ok := fieldCount[m.Type]
	if !ok {
		return nil, fmt.Errorf("%w: unknown type %q", ErrMalformed, m.Type)
	}
	_ = e.EncodeMapLen(n)
	str("type", m.Type)
	switch m.Type {
	case TypeConnect:
		str("peer_id", m.PeerID)
		_ = e.EncodeString("agent_metadata")
		_ = e.EncodeBytes(m.AgentMetadata)
		uint("base_addr", m.BaseAddr)
		uint("num_blocks", m.NumBlocks)
		uint("block_len", m.BlockLen)
		str("config_fingerprint", m.ConfigFingerprint)
		str("hash_seed", m.HashSeed)
	case TypeConnectAck:
		str("peer_id", m.PeerID)
	case TypeLookup:
		str("kv_request_id", m.KVRequestID)
		keys()
		uint("round_seq", m.RoundSeq)
	case TypeLookupResp:
		if len(m.Hits) != len(m.Keys) {
			return nil, fmt.Errorf("%w: %d hits for %d keys", ErrMalformed, len(m.Hits), len(m.Keys))
		}
		str("kv_request_id", m.KVRequestID)
		keys()
		_ = e.EncodeString("hits")
		_ = e.EncodeArrayLen(len(m.Hits))
		for _, h := range m.Hits {
			_ = e.EncodeBool(h)
		}
	case TypeFetch:
		if len(m.BlockIndexes) != len(m.Keys) {
			return nil, fmt.Errorf("%w: %d block indexes for %d keys", ErrMalformed, len(m.BlockIndexes), len(m.Keys))
		}
		str("kv_request_id", m.KVRequestID)
		keys()
		_ = e.EncodeString("block_indexes")
		_ = e.EncodeArrayLen(len(m.BlockIndexes))
		for _, b := range m.BlockIndexes {
			_ = e.EncodeUint(b)
		}
		uint("round_seq", m.RoundSeq)
	case TypeTransferDone:
		str("kv_request_id", m.KVRequestID)
		_ = e.EncodeString("success")
		_ = e.EncodeBool(m.Success)
		uint("round_seq", m.RoundSeq)
	case TypeAbortFetch, TypeAbortAck:
		str("kv_request_id", m.KVRequestID)
		uint("round_seq", m.RoundSeq)
	}
	// bytes.Buffer writes cannot fail, so the encoder's errors are nil.
	return buf.Bytes(), nil
}

// fieldCount is the map length of each type's encoding, "type" included.
var fieldCount = map[string]int{
	TypeConnect: 8, TypeConnectAck: 2, TypeLookup: 4, TypeLookupResp: 4,
	TypeFetch: 5, TypeTransferDone: 4, TypeAbortFetch: 3, TypeAbortAck: 3, TypeDisconnect: 1,
}

// decodeMessage parses one frame. Keys may come in any order and unknown
// keys are skipped, as vLLM's untyped decoding allows; integers of any width
// are accepted. An unknown type decodes without error so the caller can
// warn and carry on, as vLLM does.
//
// Keys and agent metadata alias data, which the caller must not modify
// afterwards.
func decodeMessage(data []byte) (message, error) {
	var m message
	var f frame
	f.r.Reset(data)
	n, err := f.mapLen()
	if err != nil {
		return m, err
	}
	var have int
	hasType := false
	for range n {
		k, err := f.str()
		if err != nil {
			return m, fmt.Errorf("map key: %w", err)
		}
		if err := m.decodeField(k, &f, &have, &hasType); err != nil {
			return m, fmt.Errorf("field %q: %w", k, err)
		}
	}
	if f.r.Len() != 0 {
		return m, fmt.Errorf("%w: %d trailing bytes", ErrMalformed, f.r.Len())
	}
	if !hasType {
		return m, fmt.Errorf("%w: no type", ErrMalformed)
	}
	req, known := required[m.Type]
	if !known {
		return m, nil
	}
	if missing := req &^ have; missing != 0 {
		return m, fmt.Errorf("%w: %s without %s", ErrMalformed, m.Type, fieldNames(missing))
	}
	switch m.Type {
	case TypeLookupResp:
		if len(m.Hits) != len(m.Keys) {
			return m, fmt.Errorf("%w: %d hits for %d keys", ErrMalformed, len(m.Hits), len(m.Keys))
		}
	case TypeFetch:
		if len(m.BlockIndexes) != len(m.Keys) {
			return m, fmt.Errorf("%w: %d block indexes for %d keys", ErrMalformed, len(m.BlockIndexes), len(m.Keys))
		}
	}
	return m, nil
}

func (m *message) decodeField(k string, f *frame, have *int, hasType *bool) error {
	var err error
	switch k {
	case "type":
		m.Type, err = f.str()
		*hasType = true
	case "peer_id":
		m.PeerID, err = f.str()
		*have |= hasPeerID
	case "agent_metadata":
		m.AgentMetadata, err = f.bin()
		*have |= hasAgentMetadata
	case "base_addr":
		m.BaseAddr, err = f.uint()
		*have |= hasBaseAddr
	case "num_blocks":
		m.NumBlocks, err = f.uint()
		*have |= hasNumBlocks
	case "block_len":
		m.BlockLen, err = f.uint()
		*have |= hasBlockLen
	case "config_fingerprint":
		m.ConfigFingerprint, err = f.str()
		*have |= hasConfigFingerprint
	case "hash_seed":
		m.HashSeed, err = f.str()
		*have |= hasHashSeed
	case "kv_request_id":
		m.KVRequestID, err = f.str()
		*have |= hasKVRequestID
	case "keys":
		var n int
		if n, err = f.arrayLen(); err != nil {
			return err
		}
		m.Keys = make([][]byte, n)
		for i := range m.Keys {
			if m.Keys[i], err = f.bin(); err != nil {
				return fmt.Errorf("key %d: %w", i, err)
			}
		}
		*have |= hasKeys
	case "hits":
		var n int
		if n, err = f.arrayLen(); err != nil {
			return err
		}
		m.Hits = make([]bool, n)
		for i := range m.Hits {
			if m.Hits[i], err = f.bool(); err != nil {
				return fmt.Errorf("hit %d: %w", i, err)
			}
		}
		*have |= hasHits
	case "block_indexes":
		var n int
		if n, err = f.arrayLen(); err != nil {
			return err
		}
		m.BlockIndexes = make([]uint64, n)
		for i := range m.BlockIndexes {
			if m.BlockIndexes[i], err = f.uint(); err != nil {
				return fmt.Errorf("block index %d: %w", i, err)
			}
		}
		*have |= hasBlockIndexes
	case "round_seq":
		m.RoundSeq, err = f.uint()
	case "success":
		m.Success, err = f.bool()
		*have |= hasSuccess
	default:
		err = f.wrap(f.r.Skip(maxSkipDepth))
	}
	return err
}

var fieldBitNames = []string{"peer_id", "agent_metadata", "base_addr", "num_blocks", "block_len",
	"config_fingerprint", "hash_seed", "kv_request_id", "keys", "hits", "block_indexes", "success"}

func fieldNames(bits int) string {
	s := ""
	for i, name := range fieldBitNames {
		if bits&(1<<i) != 0 {
			if s != "" {
				s += ", "
			}
			s += name
		}
	}
	return s
}

// maxSkipDepth bounds the nesting of an unknown field's value.
const maxSkipDepth = 32

// frame is a message being decoded; strings and binaries are sliced out of
// its data instead of copied.
type frame struct {
	r msgpackr.Reader
}

func (f *frame) wrap(err error) error {
	if err != nil {
		return fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return nil
}

func (f *frame) mapLen() (int, error) {
	n, err := f.r.MapLen()
	return n, f.wrap(err)
}

func (f *frame) arrayLen() (int, error) {
	n, err := f.r.ArrayLen()
	return n, f.wrap(err)
}

func (f *frame) str() (string, error) {
	b, err := f.r.Str()
	return string(b), f.wrap(err)
}

func (f *frame) bin() ([]byte, error) {
	b, err := f.r.Bin()
	return b, f.wrap(err)
}

func (f *frame) uint() (uint64, error) {
	v, err := f.r.Uint()
	return v, f.wrap(err)
}

func (f *frame) bool() (bool, error) {
	v, err := f.r.Bool()
	return v, f.wrap(err)
}

// toInt converts a wire integer to int, failing on values past MaxInt.
func toInt(v uint64) (int, bool) {
	if v > math.MaxInt {
		return 0, false
	}
	return int(v), true
}
