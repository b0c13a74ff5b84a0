// Package enginepub models the KV-event publishers of SGLang and
// TensorRT-LLM for tests, written from their source as
// ../shared/spec/producers.md summarises it, not from kvsource's decoder:
// a prefix cache of pages with least-recently-used leaf eviction whose
// changes become events in each engine's wire form, sequence numbers as
// each engine numbers them, and a replay buffer that answers as each
// engine's ROUTER socket does. Its keys are computed here, independently
// of package hashing, so that tests compare two implementations.
//
// SGLang (ZmqEventPublisher and RadixCache): one BlockStored per page,
// ["BlockStored", [h], parent, tokens, len(page), nil, "GPU"], hashes as
// signed int64; with a cache salt the BlockStoredWithMetadata form with
// {"cache_salt": salt} after the medium; with EAGLE the tokens as pairs
// [[a,b],...] and keys over bigrams; BlockRemoved [h] per page;
// AllBlocksCleared on reset; batches [ts, events, attn_dp_rank] numbered
// from 0.
//
// TensorRT-LLM (its streaming publisher of the KV cache manager V2):
// vLLM-style tagged maps, a new chain's pages coalesced into one
// BlockStored, v1_block_key hashes as signed int64; batches numbered from
// the process's start time in nanoseconds (Config.Start), the first
// holding AllBlocksCleared; Heartbeat publishes an empty batch, as the
// engine does every 5 s.
package enginepub

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"slices"
	"sync"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvsource/kvsource/index"
)

// Engine is the publisher modelled.
type Engine uint8

const (
	SGLang Engine = iota
	TRTLLM
)

// Config configures a Pod.
type Config struct {
	Engine Engine
	// PageSize is the tokens per page (SGLang's page_size, default 1;
	// TensorRT-LLM's tokens_per_block, default 32).
	PageSize int
	// Capacity bounds the pages held: past it the least recently used
	// leaf pages are evicted. 0: unbounded.
	Capacity int
	// EAGLE makes SGLang's keys bigrams and its token_ids pairs.
	EAGLE bool
	// CacheSalt is the salt of every request: SGLang sends it in
	// BlockStoredWithMetadata (and does not hash it); TensorRT-LLM mixes
	// it into block 0's key.
	CacheSalt string
	// Rank is the data-parallel rank every batch names.
	Rank int
	// Start is TensorRT-LLM's first sequence number, its start time_ns.
	Start uint64
}

// Pod is one engine process's cache and publisher. It is safe for
// concurrent use.
type Pod struct {
	cfg Config

	mu     sync.Mutex
	pages  map[uint64]*page // by key
	clock  uint64
	events []any
	next   uint64 // sequence number of the next batch
	ts     float64
	buffer []buffered
}

type page struct {
	key, parent uint64
	root        bool
	children    int
	used        uint64
}

type buffered struct {
	seq     uint64
	payload []byte
}

// New returns a pod with an empty cache. A TensorRT-LLM pod's first batch
// will start with AllBlocksCleared, as the engine's does.
func New(cfg Config) *Pod {
	if cfg.PageSize <= 0 {
		cfg.PageSize = 1
		if cfg.Engine == TRTLLM {
			cfg.PageSize = 32
		}
	}
	p := &Pod{cfg: cfg, pages: map[uint64]*page{}, next: cfg.Start, ts: 1.7e9}
	if cfg.Engine == TRTLLM {
		p.events = append(p.events, map[string]any{"type": "AllBlocksCleared"})
	}
	return p
}

// Config returns the pod's configuration with its defaults.
func (p *Pod) Config() Config { return p.cfg }

// fullPages is how many pages n tokens fill: EAGLE's bigrams need the
// token after a page.
func (p *Pod) fullPages(n int) int {
	if p.cfg.EAGLE {
		n--
	}
	if n <= 0 {
		return 0
	}
	return n / p.cfg.PageSize
}

// chain computes the keys of the pages of tokens.
func (p *Pod) chain(tokens []uint32) (keys []uint64) {
	ps := p.cfg.PageSize
	var prev [32]byte
	var parent uint64
	for i := range p.fullPages(len(tokens)) {
		blk := tokens[i*ps : (i+1)*ps]
		switch p.cfg.Engine {
		case SGLang:
			h := sha256.New()
			if i > 0 {
				h.Write(prev[:])
			}
			var b [4]byte
			for j := range blk {
				binary.LittleEndian.PutUint32(b[:], blk[j])
				h.Write(b[:])
				if p.cfg.EAGLE {
					binary.LittleEndian.PutUint32(b[:], tokens[i*ps+j+1])
					h.Write(b[:])
				}
			}
			h.Sum(prev[:0])
			parent = binary.BigEndian.Uint64(prev[:8])
		case TRTLLM:
			parent = v1Key(blk, parent, p.cfg.CacheSalt)
		}
		keys = append(keys, parent)
	}
	return keys
}

// Keys returns the engine's keys of the full pages of tokens.
func (p *Pod) Keys(tokens []uint32) []uint64 {
	return p.chain(tokens)
}

// Holds returns how many leading full pages of tokens the cache holds:
// the positional reference a router's lookups are checked against.
func (p *Pod) Holds(tokens []uint32) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, k := range p.Keys(tokens) {
		if p.pages[k] == nil {
			break
		}
		n++
	}
	return n
}

// Serve runs a request for tokens: its full pages not cached are stored
// (events), the cached ones touched, then least recently used leaves are
// evicted past Capacity (events).
func (p *Pod) Serve(tokens []uint32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	keys := p.chain(tokens)
	ps := p.cfg.PageSize
	p.clock++
	var run []int // new pages since the last cached one (TensorRT-LLM coalesces them)
	for i, k := range keys {
		if pg := p.pages[k]; pg != nil {
			pg.used = p.clock
			continue
		}
		pg := &page{key: k, root: i == 0, used: p.clock}
		if i > 0 {
			pg.parent = keys[i-1]
			p.pages[pg.parent].children++
		}
		p.pages[k] = pg
		if p.cfg.Engine == SGLang {
			p.events = append(p.events, p.sglangStored(pg, tokens, i))
		} else {
			run = append(run, i)
		}
	}
	if len(run) > 0 {
		first, last := run[0], run[len(run)-1]
		hashes := make([]int64, 0, len(run))
		for _, i := range run {
			hashes = append(hashes, int64(keys[i]))
		}
		var parent any
		if first > 0 {
			parent = int64(keys[first-1])
		}
		p.events = append(p.events, map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
			"token_ids": tokens[first*ps : (last+1)*ps], "block_size": ps, "lora_id": nil, "medium": "GPU"})
	}
	p.evict()
}

// sglangStored is the BlockStored of page i of tokens.
func (p *Pod) sglangStored(pg *page, tokens []uint32, i int) []any {
	ps := p.cfg.PageSize
	blk := tokens[i*ps : (i+1)*ps]
	var parent any
	if !pg.root {
		parent = int64(pg.parent)
	}
	var toks any = blk
	if p.cfg.EAGLE {
		pairs := make([][2]uint32, ps)
		for j := range pairs {
			pairs[j] = [2]uint32{tokens[i*ps+j], tokens[i*ps+j+1]}
		}
		toks = pairs
	}
	ev := []any{"BlockStored", []int64{int64(pg.key)}, parent, toks, len(blk), nil, "GPU"}
	if p.cfg.CacheSalt != "" {
		ev = append(ev, map[string]any{"cache_salt": p.cfg.CacheSalt})
	}
	return ev
}

// evict removes least recently used leaves until Capacity holds.
func (p *Pod) evict() {
	if p.cfg.Capacity <= 0 {
		return
	}
	var removed []int64
	for len(p.pages) > p.cfg.Capacity {
		var victim *page
		for _, pg := range p.pages {
			if pg.children == 0 && (victim == nil || pg.used < victim.used || (pg.used == victim.used && pg.key < victim.key)) {
				victim = pg
			}
		}
		delete(p.pages, victim.key)
		if !victim.root {
			p.pages[victim.parent].children--
		}
		if p.cfg.Engine == SGLang {
			p.events = append(p.events, []any{"BlockRemoved", []int64{int64(victim.key)}, "GPU"})
		} else {
			removed = append(removed, int64(victim.key))
		}
	}
	if len(removed) > 0 {
		p.events = append(p.events, map[string]any{"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU"})
	}
}

// Reset empties the cache: AllBlocksCleared.
func (p *Pod) Reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	clear(p.pages)
	if p.cfg.Engine == SGLang {
		p.events = append(p.events, []any{"AllBlocksCleared"})
	} else {
		p.events = append(p.events, map[string]any{"type": "AllBlocksCleared"})
	}
}

// Flush publishes the events since the last flush as one batch and
// returns its sequence number and payload, which the replay buffer keeps.
// A flush without events publishes an empty batch: TensorRT-LLM's
// heartbeat.
func (p *Pod) Flush() (seq uint64, payload []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	events := p.events
	if events == nil {
		events = []any{}
	}
	p.events = nil
	p.ts++
	payload, err := msgpack.Marshal([]any{p.ts, events, p.cfg.Rank})
	if err != nil {
		// Only the model's own slices, maps and scalars are encoded.
		panic("enginepub: " + err.Error())
	}
	seq = p.next
	p.next++
	p.buffer = append(p.buffer, buffered{seq, payload})
	if len(p.buffer) > 10_000 {
		p.buffer = p.buffer[1:]
	}
	return seq, payload
}

// Heartbeat publishes an empty batch, as TensorRT-LLM does every 5 s;
// pending events wait for the next Flush.
func (p *Pod) Heartbeat() (seq uint64, payload []byte) {
	p.mu.Lock()
	pending := p.events
	p.events = nil
	p.mu.Unlock()
	seq, payload = p.Flush()
	p.mu.Lock()
	p.events = append(pending, p.events...)
	p.mu.Unlock()
	return seq, payload
}

// Replay sends the buffered batches from sequence number from on, as the
// engines' replay sockets do (the end marker is the return). It
// implements events.Replayer.
func (p *Pod) Replay(ctx context.Context, _ index.Holder, from uint64, fn func(seq uint64, payload []byte) bool) error {
	p.mu.Lock()
	buf := slices.Clone(p.buffer)
	p.mu.Unlock()
	for _, b := range buf {
		if err := ctx.Err(); err != nil {
			return err
		}
		if b.seq >= from && !fn(b.seq, b.payload) {
			return nil
		}
	}
	return nil
}

// TensorRT-LLM's hash_v1_block_key, without a LoRA task id.
func v1Key(tokens []uint32, parent uint64, salt string) uint64 {
	const c1, c2, k32, g = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x45D9F3B, 0x9E3779B9
	mix64 := func(v, seed uint64) uint64 {
		v = (v ^ v>>30) * c1
		v = (v ^ v>>27) * c2
		v ^= v >> 31
		return seed ^ (v + g + seed<<6 + seed>>2)
	}
	seed := uint64(len(tokens)) ^ parent*c1
	if parent == 0 && salt != "" {
		s := sha256.Sum256([]byte(salt))
		seed = mix64(binary.LittleEndian.Uint64(s[:8]), seed)
	}
	for _, t := range tokens {
		v := uint32(t)
		v = ((v >> 16) ^ v) * k32
		v = ((v >> 16) ^ v) * k32
		v = ((v >> 16) ^ v) + g
		seed ^= uint64(v) + seed<<6 + seed>>2
	}
	return seed
}
