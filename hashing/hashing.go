package hashing

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"
	"github.com/zeebo/xxh3"
)

// Algo names a block hash algorithm. The vLLM algorithms are spelled as
// vLLM's --prefix-caching-hash-algo values.
type Algo string

// The supported algorithms.
const (
	// SHA256 is vLLM's default: SHA-256 of CPython's pickle (protocol 5).
	SHA256 Algo = "sha256"
	// SHA256CBOR is SHA-256 of canonical CBOR.
	SHA256CBOR Algo = "sha256_cbor"
	// XXHash is XXH3-128 of CPython's pickle (protocol 5).
	XXHash Algo = "xxhash"
	// XXHashCBOR is XXH3-128 of canonical CBOR.
	XXHashCBOR Algo = "xxhash_cbor"
	// SHA256CBOR64 is the legacy sha256_cbor_64bit of vLLM 0.10.0-0.10.1:
	// the low 64 bits of SHA-256 of canonical CBOR, chained as integers.
	SHA256CBOR64 Algo = "sha256_cbor_64bit"
	// Content is kvsource's own chained xxh64 content key, for engines whose
	// block hashes a router cannot reproduce. No engine computes it.
	Content Algo = "content"
)

// Algos lists every supported algorithm, vLLM's first.
var Algos = []Algo{SHA256, SHA256CBOR, XXHash, XXHashCBOR, SHA256CBOR64, Content}

// Defaults, as vLLM's.
const (
	// DefaultSeed is the seed vLLM uses for the SHA-256 algorithms when
	// PYTHONHASHSEED is unset.
	DefaultSeed = "vllm-none-hash"
	// DefaultBlockSize is vLLM's default block size in tokens.
	DefaultBlockSize = 16
)

// Errors that callers branch on. Returned errors wrap them.
var (
	// ErrUnknownAlgo reports an algorithm name this package does not know.
	ErrUnknownAlgo = errors.New("hashing: unknown algorithm")
	// ErrSeedRequired reports an xxhash algorithm configured without a seed:
	// such an engine hashes with a random seed no router can reproduce.
	ErrSeedRequired = errors.New("hashing: xxhash algorithms need an explicit seed")
	// ErrBlockSize reports a block size below 1.
	ErrBlockSize = errors.New("hashing: block size must be at least 1")
	// ErrNeedDigest reports a chain continuation from an event key for an
	// algorithm whose parent is a full digest that the key does not determine.
	ErrNeedDigest = errors.New("hashing: continuing this algorithm's chain needs the parent's full digest")
	// ErrExtraKeys reports explicit per-block extra keys that do not cover
	// every full block.
	ErrExtraKeys = errors.New("hashing: extra keys missing for a full block")
	// ErrMMItem reports a multimodal item with a negative offset or length,
	// or one that Prefix.AddMM cannot add.
	ErrMMItem = errors.New("hashing: invalid multimodal item")
	// ErrExtraMode reports an operation that mixes explicit per-block extra
	// keys with extra keys derived from LoRA, salt and multimodal items.
	ErrExtraMode = errors.New("hashing: explicit and derived extra keys mixed")
	// ErrStopped wraps the context's error when BlockKeysContext stops.
	ErrStopped = errors.New("hashing: stopped")
)

// Config selects the algorithm, seed and block size. The zero value is vLLM's
// default configuration.
type Config struct {
	// Algo is the algorithm; "" means SHA256.
	Algo Algo
	// Seed is the engine's PYTHONHASHSEED string. It is set when non-empty
	// or when SeedSet is true. Unset means vLLM's default for an engine
	// without PYTHONHASHSEED: DefaultSeed, except for XXHash and XXHashCBOR,
	// which then hash with a random seed and so require a set one.
	Seed string
	// SeedSet makes an empty Seed the seed itself: an engine started with
	// PYTHONHASHSEED="" hashes the empty string, not DefaultSeed.
	SeedSet bool
	// BlockSize is the number of tokens per block; 0 means DefaultBlockSize.
	BlockSize int
}

// MMItem is a multimodal item of a prompt: its identifier (vLLM's mm hash) and
// the token range [Offset, Offset+Length) of its placeholder tokens.
type MMItem struct {
	ID             string
	Offset, Length int
}

// Request is what determines a prompt's block hashes.
type Request struct {
	// Tokens are the prompt's token ids. Only full blocks are hashed.
	Tokens []uint32
	// LoRAName is the LoRA adapter's name, an extra key of every block;
	// "" means no LoRA.
	LoRAName string
	// CacheSalt is an extra key of block 0; "" means none.
	CacheSalt string
	// MM are the multimodal items, sorted by Offset; an unsorted slice is
	// stably sorted in a copy.
	MM []MMItem
	// Extra, when non-nil, is the complete extra-keys tuple of each block
	// (nil or empty meaning None: vLLM never hashes an empty tuple). It
	// replaces the keys derived from LoRAName, CacheSalt and MM, which must
	// then be empty. It is what a KV event's extra_keys carries, and how
	// callers pass what the SDK does not model, such as the SHA-256 digests
	// of prompt-embedding slices. It must cover every full block; entries
	// past the last full block are ignored.
	Extra [][]ExtraKey
}

const sha256Size = sha256.Size

// Digest is a block's full hash: 32 bytes for the SHA-256 algorithms, 16 for
// the XXH3-128 ones, and the 8-byte big-endian value for SHA256CBOR64 and
// Content. Digests compare with ==; the zero Digest is empty.
type Digest struct {
	n uint8
	// first marks the digests of engine algorithms whose key is the first
	// 8 bytes (SGLang's, TensorRT-LLM's v2), not vLLM's last 8.
	first bool
	b     [sha256Size]byte
}

// DigestOf returns b as a Digest. It fails when b is empty or longer than 32
// bytes.
func DigestOf(b []byte) (Digest, error) {
	var d Digest
	if len(b) == 0 || len(b) > len(d.b) {
		return d, fmt.Errorf("hashing: digest of %d bytes, want 1 to 32", len(b))
	}
	d.n = uint8(copy(d.b[:], b))
	return d, nil
}

// ParseDigest parses a hex digest as printed by Digest.String.
func ParseDigest(s string) (Digest, error) {
	b, err := hex.DecodeString(s)
	if err != nil {
		return Digest{}, fmt.Errorf("hashing: parse digest: %w", err)
	}
	return DigestOf(b)
}

func digest64(v uint64) Digest {
	d := Digest{n: 8}
	binary.BigEndian.PutUint64(d.b[:], v)
	return d
}

// Len returns the digest's length in bytes.
func (d Digest) Len() int { return int(d.n) }

// Bytes returns a copy of the digest's bytes.
func (d Digest) Bytes() []byte { return slices.Clone(d.b[:d.n]) }

// AppendTo appends the digest's bytes to dst.
func (d Digest) AppendTo(dst []byte) []byte { return append(dst, d.b[:d.n]...) }

// String returns the digest in lowercase hex.
func (d Digest) String() string { return hex.EncodeToString(d.b[:d.n]) }

// Key returns the event form of the digest: its last 8 bytes read big-endian,
// what vLLM puts in KV events (the first 8 for SGLang's and TensorRT-LLM's
// v2 SHA-256 digests, what those engines send).
func (d Digest) Key() uint64 {
	if d.first {
		return binary.BigEndian.Uint64(d.b[:8])
	}
	if d.n >= 8 {
		return binary.BigEndian.Uint64(d.b[d.n-8 : d.n])
	}
	var v uint64
	for _, c := range d.b[:d.n] {
		v = v<<8 | uint64(c)
	}
	return v
}

// Block is one hashed block.
type Block struct {
	// Key is the event form of the hash (Digest.Key).
	Key uint64
	// Digest is the full hash, the parent of the next block.
	Digest Digest
	// Extra is the block's extra-keys tuple; nil means None.
	Extra []ExtraKey
}

// Hasher computes the block hashes of one configuration. It is safe for
// concurrent use. The zero Hasher is ready to use and behaves exactly as
// New(Config{}): vLLM's default SHA256, DefaultSeed and DefaultBlockSize.
// A Hasher must not be copied after first use.
type Hasher struct {
	once sync.Once // guards the fields below: done by New, or on first use
	cfg  Config
	root Digest // the parent of block 0: vLLM's NONE_HASH, or Content's root
	enc  encoding
	fn   hashFunc
	pool sync.Pool // *scratch
}

// encoding is how a block's value becomes bytes.
type encoding uint8

const (
	encPickle encoding = iota
	encCBOR
	encContent
	encSGLang      // previous digest, tokens as uint32 LE
	encSGLangEAGLE // previous digest, each position's bigram
	encTRTV1       // TensorRT-LLM's v1 mix, chained on the key
	encTRTV2       // previous digest, tokens as uint32 LE, from a scope root
)

// hashFunc is how the bytes become a digest.
type hashFunc uint8

const (
	fnSHA256      hashFunc = iota
	fnSHA256Low64          // the low 64 bits, as the 8-byte digest
	fnXXH3                 // XXH3-128
	fnXXH64
	fnSHA256First // SHA-256, keyed by its first 8 bytes
	fnNone        // the encoding computed the key itself (TRTV1)
)

// scratch is the per-call working memory, pooled so that hashing allocates
// nothing per block.
type scratch struct {
	buf []byte
	mm  []int
	ex  extraSource
}

// New returns a Hasher for cfg.
func New(cfg Config) (*Hasher, error) {
	h := &Hasher{}
	var err error
	h.once.Do(func() { err = h.setup(cfg) })
	if err != nil {
		return nil, err
	}
	return h, nil
}

// ready initialises a zero Hasher as New(Config{}) does, on first use, and
// returns h. Every exported method calls it before reading h's fields; for a
// Hasher from New it is one atomic load.
func (h *Hasher) ready() *Hasher {
	h.once.Do(h.initDefault)
	return h
}

func (h *Hasher) initDefault() {
	// The zero Config is valid, so setup cannot fail.
	_ = h.setup(Config{})
}

// setup fills in cfg's defaults, validates it and sets h up for it.
func (h *Hasher) setup(cfg Config) error {
	if cfg.Algo == "" {
		cfg.Algo = SHA256
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = DefaultBlockSize
	}
	if cfg.BlockSize < 1 {
		return fmt.Errorf("%w: %d", ErrBlockSize, cfg.BlockSize)
	}
	switch cfg.Algo {
	case SHA256:
		h.enc, h.fn = encPickle, fnSHA256
	case XXHash:
		h.enc, h.fn = encPickle, fnXXH3
	case SHA256CBOR:
		h.enc, h.fn = encCBOR, fnSHA256
	case XXHashCBOR:
		h.enc, h.fn = encCBOR, fnXXH3
	case SHA256CBOR64:
		h.enc, h.fn = encCBOR, fnSHA256Low64
	case Content:
		h.enc, h.fn = encContent, fnXXH64
	case SGLang:
		h.enc, h.fn = encSGLang, fnSHA256First
	case SGLangEAGLE:
		h.enc, h.fn = encSGLangEAGLE, fnSHA256First
	case TRTV1:
		h.enc, h.fn = encTRTV1, fnNone
	case TRTV2SHA256_64, TRTV2SHA256:
		h.enc, h.fn = encTRTV2, fnSHA256First
	default:
		return fmt.Errorf("%w: %q", ErrUnknownAlgo, cfg.Algo)
	}
	if IsEngineAlgo(cfg.Algo) {
		// No seed: these engines hash nothing but the blocks.
		cfg.Seed, cfg.SeedSet = "", false
		h.cfg = cfg
		h.pool.New = func() any { return &scratch{buf: make([]byte, 0, 256)} }
		h.root = h.hashSeed()
		return nil
	}
	if cfg.Seed == "" && !cfg.SeedSet {
		if cfg.Algo == XXHash || cfg.Algo == XXHashCBOR {
			return fmt.Errorf("%w: %s", ErrSeedRequired, cfg.Algo)
		}
		cfg.Seed = DefaultSeed
	}
	// The normal form: a non-empty seed is set by itself.
	cfg.SeedSet = cfg.Seed == ""
	h.cfg = cfg
	h.pool.New = func() any { return &scratch{buf: make([]byte, 0, 256)} }
	h.root = h.hashSeed()
	return nil
}

// Config returns the configuration with defaults filled in: Seed is the
// seed hashed, and SeedSet is true only for the empty seed.
func (h *Hasher) Config() Config { return h.ready().cfg }

// Root returns the parent of block 0: vLLM's NONE_HASH, the hash of the seed.
func (h *Hasher) Root() Digest { return h.ready().root }

func (h *Hasher) hashSeed() Digest {
	var buf []byte
	switch h.enc {
	case encPickle:
		buf = appendPickleValue(buf, h.cfg.Seed)
	case encCBOR:
		buf = appendCBORString(buf, h.cfg.Seed)
	case encContent:
		return digest64(xxhash.Sum64String(h.cfg.Seed))
	case encSGLang, encSGLangEAGLE:
		// The first page hashes no parent; the all-zero digest stands for
		// none.
		return Digest{n: sha256Size, first: true}
	case encTRTV1:
		return digest64(0)
	case encTRTV2:
		return trtV2Root("")
	}
	var d Digest
	h.sum(&d, buf)
	return d
}

// sum hashes an encoded value into d and returns d.Key(), computed from the
// hash's output rather than read back from d.
func (h *Hasher) sum(d *Digest, buf []byte) uint64 {
	switch h.fn {
	case fnSHA256:
		s := sha256.Sum256(buf)
		d.n, d.b = sha256Size, s
		return binary.BigEndian.Uint64(s[24:])
	case fnSHA256Low64:
		s := sha256.Sum256(buf)
		k := binary.BigEndian.Uint64(s[24:])
		d.n = 8
		binary.BigEndian.PutUint64(d.b[:8], k)
		return k
	case fnXXH3:
		v := xxh3.Hash128(buf)
		d.n = 16
		binary.BigEndian.PutUint64(d.b[0:], v.Hi)
		binary.BigEndian.PutUint64(d.b[8:], v.Lo)
		return v.Lo
	case fnSHA256First:
		s := sha256.Sum256(buf)
		d.n, d.first, d.b = sha256Size, true, s
		return binary.BigEndian.Uint64(s[:8])
	default:
		k := xxhash.Sum64(buf)
		d.n = 8
		binary.BigEndian.PutUint64(d.b[:8], k)
		return k
	}
}

// BlockKeys appends to dst[:0] the event-form key of every full block of req
// and returns the extended slice.
func (h *Hasher) BlockKeys(dst []uint64, req Request) ([]uint64, error) {
	return h.BlockKeysContext(context.Background(), dst, req)
}

// BlockKeysContext is BlockKeys that stops when ctx is done, returning the
// keys hashed so far and an error wrapping ErrStopped and ctx's error. It
// checks ctx between blocks: every block when extra keys make blocks costly
// to hash (a long LoRA name is hashed into each), every ctxCheckBlocks
// blocks otherwise, so a prompt of any size stops within a few blocks'
// work. A ctx that is never done costs nothing per block.
func (h *Hasher) BlockKeysContext(ctx context.Context, dst []uint64, req Request) ([]uint64, error) {
	h.ready()
	dst = dst[:0]
	if err := h.checkEngineRequest(&req); err != nil {
		return dst, err
	}
	d, err := prepare(&req, len(req.Tokens)/h.cfg.BlockSize, false)
	if err != nil {
		return dst, err
	}
	c := chain{parent: h.root}
	out := sink{keys: dst, done: ctx.Done()}
	h.walk(&c, req.Tokens, &d, req.Extra, &out)
	if out.stopped {
		return out.keys, fmt.Errorf("%w after %d of %d blocks: %w", ErrStopped, len(out.keys), len(req.Tokens)/h.cfg.BlockSize, context.Cause(ctx))
	}
	return out.keys, nil
}

// Blocks appends to dst[:0] every full block of req, with its digest and
// extra keys, and returns the extended slice. Unlike BlockKeys it allocates
// the extra-key tuples of the blocks that have any.
func (h *Hasher) Blocks(dst []Block, req Request) ([]Block, error) {
	h.ready()
	return h.blocks(dst, chain{parent: h.root}, req, false)
}

// BlockKeysFrom is BlockKeys for the blocks that follow a block known only by
// its event-form key parent, as a KV event's parent_block_hash gives it.
// Only Content, SHA256CBOR64 and TRTV1 chain on a value the key determines; other
// algorithms return ErrNeedDigest (continue those with BlocksFrom or a
// Prefix). req.Tokens start at the first block after parent; MM offsets are
// relative to that start, negative for an item that began before it; and
// CacheSalt is ignored: only block 0 carries it.
func (h *Hasher) BlockKeysFrom(dst []uint64, parent uint64, req Request) ([]uint64, error) {
	h.ready()
	dst = dst[:0]
	if h.cfg.Algo != Content && h.cfg.Algo != SHA256CBOR64 && h.cfg.Algo != TRTV1 {
		return dst, fmt.Errorf("%w: %s", ErrNeedDigest, h.cfg.Algo)
	}
	if err := h.checkEngineRequest(&req); err != nil {
		return dst, err
	}
	req.CacheSalt = ""
	d, err := prepare(&req, len(req.Tokens)/h.cfg.BlockSize, true)
	if err != nil {
		return dst, err
	}
	c := chain{parent: digest64(parent)}
	out := sink{keys: dst}
	h.walk(&c, req.Tokens, &d, req.Extra, &out)
	return out.keys, nil
}

// BlocksFrom is Blocks for the blocks that follow the block whose full digest
// is parent, for any algorithm; req is as for BlockKeysFrom.
func (h *Hasher) BlocksFrom(dst []Block, parent Digest, req Request) ([]Block, error) {
	h.ready()
	if parent.n != h.root.n {
		return dst[:0], fmt.Errorf("%w: got %d bytes, %s chains digests of %d", ErrNeedDigest, parent.n, h.cfg.Algo, h.root.n)
	}
	req.CacheSalt = ""
	return h.blocks(dst, chain{parent: parent}, req, true)
}

func (h *Hasher) blocks(dst []Block, c chain, req Request, continuation bool) ([]Block, error) {
	dst = dst[:0]
	if err := h.checkEngineRequest(&req); err != nil {
		return dst, err
	}
	d, err := prepare(&req, len(req.Tokens)/h.cfg.BlockSize, continuation)
	if err != nil {
		return dst, err
	}
	out := sink{blocks: dst, wantBlocks: true}
	h.walk(&c, req.Tokens, &d, req.Extra, &out)
	return out.blocks, nil
}

// chain is where a chain of blocks stands: the digest of its last block, the
// token position of its next block and the multimodal cursor.
type chain struct {
	parent Digest
	pos    int
	cur    mmCursor
}

// derived are the request options that extra keys are derived from.
type derived struct {
	lora, salt string
	mm         []MMItem // sorted, positions relative to the chain's start
}

// sink receives walk's blocks: their keys, or with wantBlocks whole Blocks.
// When done is closed walk stops between blocks and sets stopped.
type sink struct {
	keys       []uint64
	blocks     []Block
	wantBlocks bool
	done       <-chan struct{}
	stopped    bool
}

// ctxCheckBlocks is how many blocks without extra keys walk hashes between
// two checks of its sink's done channel: about 10-20 µs of SHA-256.
const ctxCheckBlocks = 32

// walk hashes every full block of tokens, which start at c.pos, advancing c,
// and appends them to out. Block i's extra keys are extra[i] when extra is
// non-nil, else derived from d.
func (h *Hasher) walk(c *chain, tokens []uint32, d *derived, extra [][]ExtraKey, out *sink) {
	s := h.pool.Get().(*scratch)
	defer h.pool.Put(s)
	bs := h.cfg.BlockSize
	ex := &s.ex
	*ex = extraSource{}
	// Most requests have no extra keys; their blocks skip deriving them.
	plain := extra == nil && d.lora == "" && (d.salt == "" || c.pos > 0) && len(d.mm) == 0
	every := 1
	if plain {
		every = ctxCheckBlocks
	}
	span := h.blockSpan()
	for i := range h.fullBlocks(len(tokens)) {
		if out.done != nil && i%every == 0 {
			select {
			case <-out.done:
				out.stopped = true
				s.ex = extraSource{}
				return
			default:
			}
		}
		start := c.pos
		if !plain {
			s.mm = d.blockExtra(ex, s.mm, &c.cur, extra, i, start, bs)
		}
		key := h.hashBlock(s, &c.parent, tokens[i*bs:i*bs+span], ex)
		c.pos += bs
		if out.wantBlocks {
			out.blocks = append(out.blocks, Block{Key: key, Digest: c.parent, Extra: ex.materialise()})
		} else {
			out.keys = append(out.keys, key)
		}
	}
	// Drop references to the caller's data before the scratch is reused.
	s.ex = extraSource{}
}

// blockExtra sets ex to the extra keys of block i of a walk, which starts at
// token position start: extra[i] when extra is non-nil, else derived from d
// with the multimodal cursor cur. It returns mm, the item-index buffer that ex
// refers to, reused from mm.
func (d *derived) blockExtra(ex *extraSource, mm []int, cur *mmCursor, extra [][]ExtraKey, i, start, bs int) []int {
	if extra != nil {
		*ex = extraSource{explicit: true, keys: extra[i]}
		return mm
	}
	*ex = extraSource{lora: d.lora}
	if start == 0 {
		ex.salt = d.salt
	}
	mm = cur.advance(mm[:0], d.mm, start, start+bs)
	ex.mm, ex.mmIdx, ex.start = d.mm, mm, start
	return mm
}

// prepare validates req for n full blocks and returns its derived options.
// A continuation's items may start before its first token.
func prepare(req *Request, n int, continuation bool) (derived, error) {
	if err := checkExtra(*req, n); err != nil {
		return derived{}, err
	}
	mm, err := sortedMM(req.MM, continuation)
	if err != nil {
		return derived{}, err
	}
	return derived{lora: req.LoRAName, salt: req.CacheSalt, mm: mm}, nil
}

func checkExtra(req Request, blocks int) error {
	if req.Extra == nil {
		return nil
	}
	if req.LoRAName != "" || req.CacheSalt != "" || len(req.MM) > 0 {
		return fmt.Errorf("%w: Extra set together with LoRAName, CacheSalt or MM", ErrExtraMode)
	}
	if len(req.Extra) < blocks {
		return fmt.Errorf("%w: %d tuples for %d full blocks", ErrExtraKeys, len(req.Extra), blocks)
	}
	return nil
}

// sortedMM validates items and returns them sorted by offset, copying only
// when they are not sorted already.
func sortedMM(items []MMItem, negativeOffsets bool) ([]MMItem, error) {
	sorted := true
	for i, it := range items {
		if (it.Offset < 0 && !negativeOffsets) || it.Length < 0 {
			return nil, fmt.Errorf("%w: %q at offset %d, length %d", ErrMMItem, it.ID, it.Offset, it.Length)
		}
		if i > 0 && it.Offset < items[i-1].Offset {
			sorted = false
		}
	}
	if sorted {
		return items, nil
	}
	c := slices.Clone(items)
	slices.SortStableFunc(c, func(a, b MMItem) int { return a.Offset - b.Offset })
	return c, nil
}

// mmCursor walks the multimodal items block by block exactly as vLLM's
// _gen_mm_extra_hash_keys does, including its cursor that carries over from
// one block to the next.
type mmCursor struct{ idx int }

// advance appends to dst the indices of the items that become extra keys of
// the block [start, end).
func (c *mmCursor) advance(dst []int, items []MMItem, start, end int) []int {
	if len(items) == 0 {
		return dst
	}
	last := items[len(items)-1]
	if last.Offset+last.Length <= start {
		return dst
	}
	for c.idx < len(items) {
		it := items[c.idx]
		if end <= it.Offset {
			break
		}
		if start >= it.Offset+it.Length {
			c.idx++
			continue
		}
		dst = append(dst, c.idx)
		if end >= it.Offset+it.Length {
			c.idx++
			continue
		}
		break
	}
	return dst
}

// extraSource describes one block's extra keys without materialising them:
// either an explicit tuple, or the LoRA name, the multimodal items at mmIdx
// (offsets relative to start) and the salt.
type extraSource struct {
	explicit bool
	keys     []ExtraKey
	lora     string
	salt     string
	mm       []MMItem
	mmIdx    []int
	start    int
}

func (e *extraSource) count() int {
	if e.explicit {
		return len(e.keys)
	}
	n := len(e.mmIdx)
	if e.lora != "" {
		n++
	}
	if e.salt != "" {
		n++
	}
	return n
}

// materialise returns the block's extra keys as a tuple, nil for None.
func (e *extraSource) materialise() []ExtraKey {
	if e.explicit {
		return cloneKeys(e.keys)
	}
	if e.count() == 0 {
		return nil
	}
	out := make([]ExtraKey, 0, e.count())
	if e.lora != "" {
		out = append(out, Str(e.lora))
	}
	for _, k := range e.mmIdx {
		it := e.mm[k]
		out = append(out, Tuple(Str(it.ID), Int(int64(it.Offset-e.start))))
	}
	if e.salt != "" {
		out = append(out, Str(e.salt))
	}
	return out
}

// hashBlock encodes (parent, tokens, extra) into s.buf, replaces parent with
// the block's digest and returns its key.
func (h *Hasher) hashBlock(s *scratch, parent *Digest, tokens []uint32, ex *extraSource) uint64 {
	switch h.enc {
	case encPickle:
		s.buf = appendPickleBlock(s.buf[:0], parent, tokens, ex)
	case encCBOR:
		s.buf = appendCBORBlock(s.buf[:0], parent, h.fn == fnSHA256Low64, tokens, ex)
	case encContent:
		s.buf = appendContentBlock(s.buf[:0], parent.Key(), tokens, ex)
	case encSGLang, encSGLangEAGLE:
		s.buf = s.buf[:0]
		if *parent != h.root {
			s.buf = append(s.buf, parent.b[:]...)
		}
		if h.enc == encSGLang {
			s.buf = appendLE32(s.buf, tokens)
		} else {
			s.buf = appendBigrams(s.buf, tokens)
		}
	case encTRTV1:
		k := trtV1Key(tokens, parent.Key(), ex.salt)
		*parent = digest64(k)
		return k
	case encTRTV2:
		if ex.salt != "" && *parent == h.root {
			*parent = trtV2Root(ex.salt)
		}
		s.buf = appendLE32(append(s.buf[:0], parent.b[:]...), tokens)
	}
	return h.sum(parent, s.buf)
}
