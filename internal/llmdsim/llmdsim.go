// Package llmdsim produces KV-event streams as llm-d's inference simulator
// (llm-d-inference-sim) publishes them, for tests of kvsource against a
// producer nobody on this project wrote: its keys are deliberately not any
// vLLM algorithm's, so only content keys derived from the events' tokens can
// match them.
//
// What it models (from running the simulator): topic kv@<host:port>@<model>;
// every batch the positional array [ts, events, dp_rank] with rank 0; events
// as 9-element arrays ["BlockStored", hashes, parent, token_ids, block_size,
// lora_id, medium, lora_name, extra_keys] whose parent is the integer 0 for
// a chain's first block (llm-d's empty block hash), ["BlockRemoved", hashes,
// medium] and ["AllBlocksCleared"]; or, in the map format, events as maps
// with a nil parent for a chain's first block. Keys are FNV-64a over
// canonical CBOR of [parent, tokens, extra], the chain rooted in a hash of
// the seed and the model name, in the manner of llm-d's own scheme.
package llmdsim

import (
	"encoding/binary"
	"hash/fnv"

	"github.com/vmihailenco/msgpack/v5"
)

// Format is the simulator's event encoding.
type Format uint8

const (
	// Array is the simulator's default: positional arrays.
	Array Format = iota
	// Map is its map format.
	Map
)

// Sim is one simulated pod's event stream. The zero value is not usable:
// set Model and BlockSize.
type Sim struct {
	Seed, Model string
	BlockSize   int
	Format      Format
	// TS is the timestamp of the next batch; it advances one second per
	// batch, as the simulator flushes about once a second.
	TS float64

	events []any
}

// Topic is the simulator's topic for a pod at hostPort serving model.
func Topic(hostPort, model string) string { return "kv@" + hostPort + "@" + model }

// Root is the parent of a chain's first block in the key computation (never
// sent: the events carry 0 or nil instead).
func (s *Sim) Root() uint64 {
	var b []byte
	b = appendCBORArrayHead(b, 2)
	b = appendCBORText(b, s.Seed)
	b = appendCBORText(b, s.Model)
	return fnv64a(b)
}

// Keys returns the simulator's keys of the full blocks of tokens, a prompt
// from its first token.
func (s *Sim) Keys(tokens []uint32) []uint64 {
	parent := s.Root()
	n := len(tokens) / s.BlockSize
	keys := make([]uint64, n)
	var b []byte
	for i := range n {
		b = b[:0]
		b = appendCBORArrayHead(b, 3)
		b = appendCBORUint(b, 0, parent)
		blk := tokens[i*s.BlockSize : (i+1)*s.BlockSize]
		b = appendCBORArrayHead(b, len(blk))
		for _, t := range blk {
			b = appendCBORUint(b, 0, uint64(t))
		}
		b = append(b, 0xf6) // null: no extra keys
		parent = fnv64a(b)
		keys[i] = parent
	}
	return keys
}

// Store queues a BlockStored for the full blocks of tokens (a prompt from
// its first token) from block from on: parent 0 (Array) or nil (Map) when
// from is 0, else the key of block from-1. It returns all the prompt's keys.
func (s *Sim) Store(tokens []uint32, from int) []uint64 {
	keys := s.Keys(tokens)
	if from >= len(keys) {
		return keys
	}
	var parent any
	if from > 0 {
		parent = keys[from-1]
	} else if s.Format == Array {
		parent = uint64(0)
	}
	hashes := keys[from:]
	toks := tokens[from*s.BlockSize : len(keys)*s.BlockSize]
	if s.Format == Map {
		s.events = append(s.events, map[string]any{
			"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
			"token_ids": toks, "block_size": s.BlockSize, "medium": "GPU",
		})
	} else {
		s.events = append(s.events, []any{"BlockStored", hashes, parent, toks, s.BlockSize, nil, "GPU", nil, nil})
	}
	return keys
}

// Remove queues a BlockRemoved of keys.
func (s *Sim) Remove(keys ...uint64) {
	if s.Format == Map {
		s.events = append(s.events, map[string]any{"type": "BlockRemoved", "block_hashes": keys, "medium": "GPU"})
	} else {
		s.events = append(s.events, []any{"BlockRemoved", keys, "GPU"})
	}
}

// Clear queues an AllBlocksCleared.
func (s *Sim) Clear() {
	if s.Format == Map {
		s.events = append(s.events, map[string]any{"type": "AllBlocksCleared"})
	} else {
		s.events = append(s.events, []any{"AllBlocksCleared"})
	}
}

// Flush returns the queued events as one batch payload, [ts, events, 0],
// and starts a new batch.
func (s *Sim) Flush() ([]byte, error) {
	evs := s.events
	s.events = nil
	if evs == nil {
		evs = []any{}
	}
	ts := s.TS
	s.TS++
	return msgpack.Marshal([]any{ts, evs, 0})
}

func fnv64a(b []byte) uint64 {
	h := fnv.New64a()
	_, _ = h.Write(b)
	return h.Sum64()
}

// appendCBORUint appends a CBOR head of major type major with argument v in
// its shortest form, as canonical CBOR requires.
func appendCBORUint(b []byte, major byte, v uint64) []byte {
	m := major << 5
	switch {
	case v < 24:
		return append(b, m|byte(v))
	case v <= 0xff:
		return append(b, m|24, byte(v))
	case v <= 0xffff:
		return binary.BigEndian.AppendUint16(append(b, m|25), uint16(v))
	case v <= 0xffffffff:
		return binary.BigEndian.AppendUint32(append(b, m|26), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, m|27), v)
}

func appendCBORArrayHead(b []byte, n int) []byte { return appendCBORUint(b, 4, uint64(n)) }

func appendCBORText(b []byte, s string) []byte {
	return append(appendCBORUint(b, 3, uint64(len(s))), s...)
}
