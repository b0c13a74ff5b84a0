package hashing

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// DefaultCacheBytes is the default bound of a Cache: about 2,000 remembered
// 32,768-token prompts (a remembered 2,048-block prompt costs about 30 KiB).
const DefaultCacheBytes = 64 << 20

// CacheConfig configures a Cache.
type CacheConfig struct {
	// MaxBytes bounds the memory of the remembered chains, as estimated by
	// the cache (keys, digests and table entries); 0 means
	// DefaultCacheBytes.
	MaxBytes int64
}

// CacheStats are a Cache's counters since it was made.
type CacheStats struct {
	// Requests counts BlockKeys calls with at least one full block.
	Requests int64
	// HitBlocks counts blocks whose keys came from the cache; MissBlocks
	// counts blocks hashed. The hit rate is HitBlocks/(HitBlocks+MissBlocks).
	HitBlocks, MissBlocks int64
	// Evictions counts chains dropped to stay within MaxBytes.
	Evictions int64
	// Chains and Bytes are the remembered chains and their estimated size.
	Chains, Bytes int64
}

// Cache remembers the block chains of recent prompts so that a prompt whose
// leading blocks were hashed recently (the next turn of a conversation, a
// forked agent) is hashed only past them: Cache.BlockKeys pays a cheap
// content pass over the whole prompt (XXH3-128 over its tokens and extra
// keys, about a fifth of raw SHA-256's time) plus the Hasher's own hash for
// the new blocks only.
//
// A block's content key chains the content keys of every block before it
// and the Hasher's algorithm, seed and block size, so one Cache can serve
// Hashers of different configurations and two prompts share cached blocks
// exactly when they share the tokens and extra keys (LoRA, salt,
// multimodal items, explicit tuples) of those blocks. Content keys are
// 128-bit and seeded per Cache from a random value, so a client cannot
// aim a collision at another prompt's chain offline.
//
// A Cache remembers each prompt as a chain of keys with the digest of every
// 16th block and of its last block; its table maps the content keys of
// those blocks to the chain. It is bounded by CacheConfig.MaxBytes and
// evicts the oldest chains first; a prompt that extends a remembered one
// adds a new chain that takes over the shared blocks, so an active
// conversation stays. It is safe for concurrent use: lookups take only the
// read lock of the table shard they probe.
//
// The zero Cache is ready to use with the default configuration; a nil
// *Cache hashes without caching.
type Cache struct {
	once   sync.Once
	seed   uint64
	budget int64 // per shard
	shards [cacheShards]cacheShard
}

// cacheShards spreads the table and the eviction queues; a power of two.
const cacheShards = 16

// checkpointEvery is the stride of the blocks a chain records digests of and
// enters in the table: a fork that diverges inside a remembered chain
// rehashes at most this many blocks more than it would have to.
const checkpointEvery = 16

// Per-chain and per-entry overheads in the byte estimate: a chain's struct
// and slice headers, and a table entry (key, value and the map's slack).
const (
	chainOverhead = 128
	entryOverhead = 48
)

type cacheShard struct {
	mu sync.RWMutex
	m  map[uint64]cacheEntry // content key's low half -> chain position

	// emu guards the chains this shard owns (by their last content key)
	// and their bytes; it is never held while waiting for emu of another
	// shard.
	emu   sync.Mutex
	fifo  []*cachedChain // oldest first, from head
	head  int
	bytes int64

	requests, hits, misses, evictions, chains atomic.Int64
	_                                         [64]byte // keeps shards' counters off one cache line
}

// cacheEntry points at position pos of a chain; hi is the content key's
// high half, which the probe compares.
type cacheEntry struct {
	hi    uint64
	chain *cachedChain
	pos   int32
}

// cachedChain is one remembered prompt; it never changes once entered.
type cachedChain struct {
	keys []uint64
	// digests holds the digest of each checkpoint block (positions
	// checkpointEvery-1, 2*checkpointEvery-1, ...) and, last, of the
	// chain's last block when that is not a checkpoint.
	digests []Digest
	// entries are the table keys (content keys' low halves) of the entered
	// blocks, in the order of digests.
	entries []uint64
	bytes   int64
}

// entered reports whether block pos of a chain of n blocks is in the table,
// and the index of its digest.
func entered(pos, n int) (int, bool) {
	if pos%checkpointEvery == checkpointEvery-1 {
		return pos / checkpointEvery, true
	}
	if pos == n-1 {
		return n / checkpointEvery, true
	}
	return 0, false
}

// NewCache returns a Cache for cfg.
func NewCache(cfg CacheConfig) *Cache {
	c := &Cache{}
	c.once.Do(func() { c.setup(cfg) })
	return c
}

func (c *Cache) ready() *Cache {
	c.once.Do(func() { c.setup(CacheConfig{}) })
	return c
}

func (c *Cache) setup(cfg CacheConfig) {
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultCacheBytes
	}
	c.seed = rand.Uint64()
	c.budget = max(cfg.MaxBytes/cacheShards, 1)
	for i := range c.shards {
		c.shards[i].m = make(map[uint64]cacheEntry)
	}
}

// Stats returns the cache's counters.
func (c *Cache) Stats() CacheStats {
	var st CacheStats
	if c == nil {
		return st
	}
	c.ready()
	for i := range c.shards {
		s := &c.shards[i]
		st.Requests += s.requests.Load()
		st.HitBlocks += s.hits.Load()
		st.MissBlocks += s.misses.Load()
		st.Evictions += s.evictions.Load()
		st.Chains += s.chains.Load()
		s.emu.Lock()
		st.Bytes += s.bytes
		s.emu.Unlock()
	}
	return st
}

// cacheScratch is BlockKeys' per-call working memory: the content pass's
// byte image of the prompt and its offsets.
type cacheScratch struct {
	buf []byte
	hdr []int32 // per checkpoint segment, the offset of its header in buf
	end []int32 // per block, the offset after its bytes in buf
	ck  []xxh3.Uint128
	cur []int32
	mm  []int
	// A plain prompt (no extra keys) is hashed from its tokens' memory
	// instead of buf: plain holds its tokens, seg the header key of each
	// segment, hx the streaming hasher (see plainPass).
	plain []uint32
	bs    int
	seg   []xxh3.Uint128
	hx    xxh3.Hasher
}

var cacheScratchPool = sync.Pool{New: func() any { return new(cacheScratch) }}

// BlockKeys is h.BlockKeys(dst, req), served from the cache as far as a
// remembered chain covers req's leading blocks; req's chain is remembered
// for later calls. The result always equals h.BlockKeys'. On a nil Cache it
// is h.BlockKeys.
func (c *Cache) BlockKeys(h *Hasher, dst []uint64, req Request) ([]uint64, error) {
	if c == nil {
		return h.BlockKeys(dst, req)
	}
	return c.blockKeys(nil, h, dst, req)
}

// BlockKeysContext is BlockKeys that stops when ctx is done, as
// Hasher.BlockKeysContext does: between the blocks it hashes, returning
// those hashed so far and an error wrapping ErrStopped. A stopped call
// remembers nothing; remembered blocks cost no hashing to return.
func (c *Cache) BlockKeysContext(ctx context.Context, h *Hasher, dst []uint64, req Request) ([]uint64, error) {
	if c == nil {
		return h.BlockKeysContext(ctx, dst, req)
	}
	keys, err := c.blockKeys(ctx.Done(), h, dst, req)
	if errors.Is(err, ErrStopped) {
		err = fmt.Errorf("%w: %w", err, context.Cause(ctx))
	}
	return keys, err
}

// blockKeys is BlockKeys, stopping between blocks once done is closed.
func (c *Cache) blockKeys(done <-chan struct{}, h *Hasher, dst []uint64, req Request) ([]uint64, error) {
	c.ready()
	h.ready()
	dst = dst[:0]
	bs := h.cfg.BlockSize
	n := len(req.Tokens) / bs
	d, err := prepare(&req, n, false)
	if err != nil || n == 0 {
		return dst, err
	}
	if err := h.checkEngineRequest(&req); err != nil {
		return dst, err
	}
	if !cacheable(&d, req.Extra) || h.enc == encSGLangEAGLE {
		out := sink{keys: dst, done: done}
		h.walk(&chain{parent: h.root}, req.Tokens, &d, req.Extra, &out)
		if out.stopped {
			return out.keys, fmt.Errorf("%w after %d of %d blocks", ErrStopped, len(out.keys), n)
		}
		return out.keys, nil
	}
	s := cacheScratchPool.Get().(*cacheScratch)
	defer func() {
		s.plain = nil // the caller's tokens are not the pool's to keep
		cacheScratchPool.Put(s)
	}()
	c.contentPass(h, s, req.Tokens[:n*bs], &d, req.Extra)

	hit, pos := c.probe(s, n)
	endKey := c.keyAt(s, n-1)
	own := &c.shards[endKey.Lo&(cacheShards-1)]
	own.requests.Add(1)
	own.hits.Add(int64(pos + 1))
	own.misses.Add(int64(n - pos - 1))
	if pos == n-1 {
		return append(dst, hit.keys[:n]...), nil
	}

	ch := &cachedChain{
		digests: make([]Digest, 0, n/checkpointEvery+1),
		entries: make([]uint64, 0, n/checkpointEvery+1),
	}
	cc := chain{parent: h.root}
	if hit != nil {
		dst = append(dst, hit.keys[:pos+1]...)
		last, _ := entered(pos, len(hit.keys))
		ch.digests = append(ch.digests, hit.digests[:(pos+1)/checkpointEvery]...)
		// The multimodal cursor is the request's own: items of no extra
		// key (empty ones) move it without changing any content key.
		if len(d.mm) > 0 {
			cc.cur.idx = int(s.cur[pos])
		}
		cc.parent = hit.digests[last]
		cc.pos = (pos + 1) * bs
	}
	out := sink{keys: dst, done: done}
	for b := pos + 1; b < n; {
		end := min((b/checkpointEvery+1)*checkpointEvery, n)
		var extra [][]ExtraKey
		if req.Extra != nil {
			extra = req.Extra[b:end]
		}
		h.walk(&cc, req.Tokens[b*bs:end*bs], &d, extra, &out)
		if out.stopped {
			return out.keys, fmt.Errorf("%w after %d of %d blocks", ErrStopped, len(out.keys), n)
		}
		if _, ok := entered(end-1, n); ok {
			ch.digests = append(ch.digests, cc.parent)
		}
		b = end
	}
	dst = out.keys
	ch.keys = slices.Clone(dst) // no zeroing before the copy, unlike make
	his := make([]uint64, 0, n/checkpointEvery+1)
	for _, k := range s.ck {
		ch.entries = append(ch.entries, k.Lo)
		his = append(his, k.Hi)
	}
	if n%checkpointEvery != 0 {
		ch.entries = append(ch.entries, endKey.Lo)
		his = append(his, endKey.Hi)
	}
	ch.bytes = chainOverhead + int64(8*n+len(ch.digests)*(len(Digest{}.b)+1)+(8+entryOverhead)*len(ch.entries))
	c.insert(own, ch, his)
	return dst, nil
}

// cacheMaxExtraBytes bounds the extra-key bytes a block may carry for its
// prompt to be cached: the content pass copies them into every block they
// cover, so a prompt whose blocks each carry kilobytes (a long LoRA name, a
// multimodal id over thousands of blocks) would cost the cache its size in
// memory many times over. Such a prompt is hashed uncached. Real names and
// ids (a LoRA adapter's name, a salt, a content hash) are far shorter.
const cacheMaxExtraBytes = 256

// cacheable reports whether every block of a prompt with d and extra carries
// at most cacheMaxExtraBytes of extra keys (counted generously: every
// multimodal item as if it covered every block).
func cacheable(d *derived, extra [][]ExtraKey) bool {
	n := len(d.lora) + len(d.salt)
	for _, m := range d.mm {
		n += len(m.ID)
	}
	if n > cacheMaxExtraBytes {
		return false
	}
	for _, block := range extra {
		m := n
		for _, k := range block {
			if m += k.size(); m > cacheMaxExtraBytes {
				return false
			}
		}
	}
	return true
}

// contentPass lays out the content of tokens, which are whole blocks, in
// s.buf: per segment of checkpointEvery blocks, a 16-byte header holding
// the content key of the block before the segment (for the first, a key of
// the Hasher's configuration), then per block its tokens (uint32 LE) and
// its extra keys (Content's encoding, or its None tag). The content key of
// block p is XXH3-128 of its segment's bytes from the header to p's end:
// it covers every block up to p. contentPass fills s.ck with the keys of
// the segments' last blocks, the checkpoints, and with multimodal items
// s.cur with the cursor after each block. A prompt without extra keys is
// laid out by plainPass instead, without a copy.
func (c *Cache) contentPass(h *Hasher, s *cacheScratch, tokens []uint32, d *derived, extra [][]ExtraKey) {
	bs := h.cfg.BlockSize
	n := len(tokens) / bs
	s.ck, s.cur, s.hdr, s.end = s.ck[:0], s.cur[:0], s.hdr[:0], s.end[:0]
	b := s.buf[:0]
	b = append(b, "kvsource cache\x00"...)
	b = append(b, h.cfg.Algo...)
	b = append(b, 0)
	b = binary.LittleEndian.AppendUint64(b, uint64(len(h.cfg.Seed)))
	b = append(b, h.cfg.Seed...)
	b = binary.LittleEndian.AppendUint64(b, uint64(bs))
	plain := extra == nil && d.lora == "" && d.salt == "" && len(d.mm) == 0
	s.plain = nil
	if plain {
		// Plain prompts' bytes are laid out otherwise (no tag per block):
		// their keys start from a key of their own, so that no plain
		// prompt's segment can be taken for another layout's.
		b = append(b, "plain"...)
	}
	prev := xxh3.Hash128Seed(b, c.seed)
	s.buf = b // kept for the next call's configuration bytes
	if plain {
		c.plainPass(s, tokens, bs, prev)
		return
	}
	b = slices.Grow(b[:0], (n/checkpointEvery+1)*16+n*(4*bs+1))
	var ex extraSource
	var cur mmCursor
	for i := range n {
		if i%checkpointEvery == 0 {
			s.hdr = append(s.hdr, int32(len(b)))
			b = binary.LittleEndian.AppendUint64(b, prev.Hi)
			b = binary.LittleEndian.AppendUint64(b, prev.Lo)
		}
		start := i * bs
		o := len(b)
		b = slices.Grow(b, 4*bs+1)[:o+4*bs] // extra keys may outgrow the estimate
		putTokens(b[o:], tokens[start:start+bs])
		s.mm = d.blockExtra(&ex, s.mm, &cur, extra, i, start, bs)
		if ex.count() > 0 {
			b = appendContentExtra(b, &ex)
		} else {
			b = append(b, ctNone)
		}
		if len(d.mm) > 0 {
			s.cur = append(s.cur, int32(cur.idx))
		}
		s.end = append(s.end, int32(len(b)))
		if i%checkpointEvery == checkpointEvery-1 {
			prev = xxh3.Hash128Seed(b[s.hdr[i/checkpointEvery]:], c.seed)
			s.ck = append(s.ck, prev)
		}
	}
	s.buf = b
}

// plainPass is contentPass for a prompt without extra keys: a segment's
// bytes are its header and its blocks' tokens (uint32 LE) with no tag per
// block, so that they are hashed straight from the tokens' memory on a
// little-endian machine instead of copied into s.buf first. prev is the
// first segment's header key.
func (c *Cache) plainPass(s *cacheScratch, tokens []uint32, bs int, prev xxh3.Uint128) {
	n := len(tokens) / bs
	s.plain, s.bs, s.seg = tokens, bs, s.seg[:0]
	for first := 0; first < n; first += checkpointEvery {
		s.seg = append(s.seg, prev)
		if first+checkpointEvery <= n {
			prev = c.plainKey(s, len(s.seg)-1, first+checkpointEvery)
			s.ck = append(s.ck, prev)
		}
	}
}

// plainKey is the content key of the plain prompt's block end-1, whose
// segment is seg: XXH3-128 of the segment's header and of its tokens up to
// block end.
func (c *Cache) plainKey(s *cacheScratch, seg, end int) xxh3.Uint128 {
	var hdr [16]byte
	binary.LittleEndian.PutUint64(hdr[:], s.seg[seg].Hi)
	binary.LittleEndian.PutUint64(hdr[8:], s.seg[seg].Lo)
	s.hx.ResetSeed(c.seed)
	_, _ = s.hx.Write(hdr[:])
	toks := s.plain[seg*checkpointEvery*s.bs : end*s.bs]
	if littleEndian {
		_, _ = s.hx.Write(unsafe.Slice((*byte)(unsafe.Pointer(&toks[0])), 4*len(toks)))
	} else {
		s.buf = slices.Grow(s.buf[:0], 4*len(toks))[:4*len(toks)]
		putTokensStores(s.buf, toks)
		_, _ = s.hx.Write(s.buf)
	}
	return s.hx.Sum128()
}

// keyAt returns the content key of block p of the prompt contentPass laid
// out in s.
func (c *Cache) keyAt(s *cacheScratch, p int) xxh3.Uint128 {
	if p%checkpointEvery == checkpointEvery-1 {
		return s.ck[p/checkpointEvery]
	}
	if s.plain != nil {
		return c.plainKey(s, p/checkpointEvery, p+1)
	}
	return xxh3.Hash128Seed(s.buf[s.hdr[p/checkpointEvery]:s.end[p]], c.seed)
}

// probe returns the remembered chain that covers the most leading blocks of
// the n-block prompt laid out in s, and the position of the last block it
// covers; nil and -1 when none does. A chain enters its checkpoints, so the
// furthest checkpoint found bounds where a chain could end.
func (c *Cache) probe(s *cacheScratch, n int) (*cachedChain, int) {
	var best *cachedChain
	pos := -1
	for j := len(s.ck) - 1; j >= 0; j-- {
		i := j*checkpointEvery + checkpointEvery - 1
		if ch := c.lookup(s.ck[j], i); ch != nil {
			best, pos = ch, i
			break
		}
	}
	for i := min(pos+checkpointEvery-1, n-1); i > pos; i-- {
		if i%checkpointEvery == checkpointEvery-1 {
			continue
		}
		if ch := c.lookup(c.keyAt(s, i), i); ch != nil {
			return ch, i
		}
	}
	return best, pos
}

func (c *Cache) lookup(k xxh3.Uint128, pos int) *cachedChain {
	s := &c.shards[k.Lo&(cacheShards-1)]
	s.mu.RLock()
	e, ok := s.m[k.Lo]
	s.mu.RUnlock()
	if !ok || e.hi != k.Hi || int(e.pos) != pos {
		return nil
	}
	return e.chain
}

// insert enters ch, owned by shard own, with his the high halves of its
// entries' content keys, and evicts own's oldest chains past its budget.
func (c *Cache) insert(own *cacheShard, ch *cachedChain, his []uint64) {
	if ch.bytes > c.budget {
		return
	}
	n := len(ch.keys)
	for j, lo := range ch.entries {
		pos := j*checkpointEvery + checkpointEvery - 1
		if j == len(ch.entries)-1 {
			pos = n - 1
		}
		s := &c.shards[lo&(cacheShards-1)]
		s.mu.Lock()
		s.m[lo] = cacheEntry{hi: his[j], chain: ch, pos: int32(pos)}
		s.mu.Unlock()
	}
	own.emu.Lock()
	defer own.emu.Unlock()
	own.fifo = append(own.fifo, ch)
	own.bytes += ch.bytes
	own.chains.Add(1)
	for own.bytes > c.budget {
		old := own.fifo[own.head]
		own.fifo[own.head] = nil
		own.head++
		own.bytes -= old.bytes
		c.remove(old)
		own.chains.Add(-1)
		own.evictions.Add(1)
	}
	if own.head > len(own.fifo)/2 {
		own.fifo = append(own.fifo[:0], own.fifo[own.head:]...)
		own.head = 0
	}
}

// remove deletes the table entries that still point at ch; a later chain
// may have taken some over.
func (c *Cache) remove(ch *cachedChain) {
	for _, lo := range ch.entries {
		s := &c.shards[lo&(cacheShards-1)]
		s.mu.Lock()
		if e, ok := s.m[lo]; ok && e.chain == ch {
			delete(s.m, lo)
		}
		s.mu.Unlock()
	}
}
