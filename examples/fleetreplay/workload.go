package main

import (
	"fmt"
	"math/rand/v2"
	"slices"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/transfer"
)

// vocab is the token id range prompts are drawn from (Qwen2's vocabulary).
const vocab = 152064

// prompt is a shared prefix: a session's context that branches fork from, or
// a system prompt and document many requests start with.
type prompt struct {
	id     int
	tokens []uint32
	// base, when set, is a prompt this one extends (tokens starts with
	// base's tokens): a conversation's next turn, or a document a
	// conversation opens with. Hashing continues base's chain.
	base *prompt
	// salt is vLLM's cache_salt (an extra key of block 0); only a prompt
	// without base carries one.
	salt string
}

// rootSalt returns the cache salt of the prompt p extends, or p's own.
func (p *prompt) rootSalt() string {
	for p.base != nil {
		p = p.base
	}
	return p.salt
}

// saltExtraKeys is the msgpack of block 0's extra-keys tuple for a cache
// salt, as a KV event carries it: (salt,).
func saltExtraKeys(salt string) []byte {
	b := []byte{0x91} // an array of one element
	switch n := len(salt); {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n < 256:
		b = append(b, 0xd9, byte(n))
	default:
		b = append(b, 0xda, byte(n>>8), byte(n))
	}
	return append(b, salt...)
}

func newRand(seed, stream uint64) *rand.Rand {
	return rand.New(rand.NewPCG(seed, stream)) //nolint:gosec // a reproducible workload, not a secret
}

func randomTokens(rng *rand.Rand, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(rng.IntN(vocab))
	}
	return t
}

// request is one prompt the router places: a shared prefix and its own
// suffix, with what happened to it.
type request struct {
	id      int
	name    string // the picker's request id
	arrival float64
	prefix  *prompt
	suffix  []uint32

	keys []uint64     // the router's block keys (hashing, router side)
	eng  engineBlocks // the engine's (hashing, engine side)

	decode         *pod   // the decode pod in a P/D split, while the run lasts
	destName       string // the pod that computed the prefill
	decodeName     string // the decode pod's name, "" when aggregated
	reason         string // the picker's reason ("" when P2P is off)
	source         string // the pull's source pod, "" when none
	localBlocks    int    // blocks the destination already held
	pulledBlocks   int    // blocks pulled from a peer
	computedBlocks int    // full blocks computed
	waited         bool   // waited for blocks another request was bringing to its pod
	cpuRestored    int    // local blocks loaded from the destination's CPU tier
	ttft           float64
	done           bool

	// A conversation's turn: the pod that decodes it holds answer (this
	// prompt and the reply) decodeTime after the first token, and next
	// arrives gap seconds after that.
	answer     *prompt
	decodeTime float64
	gap        float64
	next       *request
	chained    bool // arrival is set when the previous turn's answer is done
	turn       int  // the turn's index in its conversation
}

func (r *request) tokens() int { return len(r.prefix.tokens) + len(r.suffix) }

// appendTokens appends the prompt's tokens [from, to) to dst.
func (r *request) appendTokens(dst []uint32, from, to int) []uint32 {
	p := len(r.prefix.tokens)
	if from < p {
		dst = append(dst, r.prefix.tokens[from:min(to, p)]...)
	}
	if to > p {
		dst = append(dst, r.suffix[max(from-p, 0):to-p]...)
	}
	return dst
}

// engineBlocks are a prompt's block keys as an engine computes them.
type engineBlocks struct {
	keys []uint64
}

// routerHasher is the router's hashing: each shared prefix is hashed once
// into a hashing.Prefix, and every request forks it and appends its suffix.
type routerHasher struct {
	h        *hashing.Hasher
	prefixes map[*prompt]*hashing.Prefix
}

func newRouterHasher(cfg hashing.Config) (*routerHasher, error) {
	h, err := hashing.New(cfg)
	if err != nil {
		return nil, err
	}
	return &routerHasher{h: h, prefixes: make(map[*prompt]*hashing.Prefix)}, nil
}

// keys returns the block keys of r's prompt.
func (rh *routerHasher) keys(r *request) ([]uint64, error) {
	pre, err := rh.prefix(r.prefix)
	if err != nil {
		return nil, err
	}
	fork := pre.Clone()
	if err := fork.Append(r.suffix...); err != nil {
		return nil, fmt.Errorf("router hashing %s: %w", r.name, err)
	}
	return fork.Keys(), nil
}

// prefix returns p hashed, extending its base's hashed prefix when it has
// one.
func (rh *routerHasher) prefix(p *prompt) (*hashing.Prefix, error) {
	if pre, ok := rh.prefixes[p]; ok {
		return pre, nil
	}
	var pre *hashing.Prefix
	var err error
	if p.base == nil {
		pre, err = rh.h.NewPrefix(hashing.Request{Tokens: p.tokens, CacheSalt: p.salt})
	} else {
		var b *hashing.Prefix
		if b, err = rh.prefix(p.base); err == nil {
			pre = b.Clone()
			err = pre.Append(p.tokens[len(p.base.tokens):]...)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("router hashing prefix %d: %w", p.id, err)
	}
	rh.prefixes[p] = pre
	return pre, nil
}

// chainHasher is the engines' hashing: full digests, since a pull names
// blocks by digest. Each shared prefix is hashed once and its chain
// continued for every suffix, as vLLM extends a running request's hashes.
// The engines and the router hash independently: the router's keys must
// match the engines' for any lookup to hit.
type chainHasher struct {
	h        *hashing.Hasher
	prefixes map[*prompt]chain
	// offload maps an event key to the engine's offload key (the full
	// digest and KV group 0), what a pull names a block by.
	offload map[uint64]transfer.Key
	scratch []hashing.Block
	tail    []uint32
}

// chain is a hashed prompt's full blocks: their keys and the last digest,
// the parent of whatever extends it.
type chain struct {
	keys []uint64
	last hashing.Digest
}

func newChainHasher(cfg hashing.Config, offloadKeys bool) (*chainHasher, error) {
	h, err := hashing.New(cfg)
	if err != nil {
		return nil, err
	}
	c := &chainHasher{h: h, prefixes: make(map[*prompt]chain)}
	if offloadKeys {
		c.offload = make(map[uint64]transfer.Key)
	}
	return c, nil
}

// extend hashes tokens' full blocks after parent and appends their keys to
// keys (a fresh slice when keys is full, so that prompts sharing a base
// never write into each other's keys).
func (c *chainHasher) extend(keys []uint64, parent hashing.Digest, req hashing.Request) ([]uint64, hashing.Digest, error) {
	var err error
	if len(keys) == 0 && req.CacheSalt != "" {
		c.scratch, err = c.h.Blocks(c.scratch, req)
	} else {
		req.CacheSalt = ""
		c.scratch, err = c.h.BlocksFrom(c.scratch, parent, req)
	}
	if err != nil {
		return nil, parent, err
	}
	c.register(c.scratch)
	keys = slices.Grow(slices.Clip(keys), len(c.scratch))
	for _, b := range c.scratch {
		keys = append(keys, b.Key)
	}
	if n := len(c.scratch); n > 0 {
		parent = c.scratch[n-1].Digest
	}
	return keys, parent, nil
}

// prefix returns p's chain, extending its base's.
func (c *chainHasher) prefix(p *prompt) (chain, error) {
	if ch, ok := c.prefixes[p]; ok {
		return ch, nil
	}
	ch := chain{last: c.h.Root()}
	from := 0
	if p.base != nil {
		b, err := c.prefix(p.base)
		if err != nil {
			return chain{}, err
		}
		ch, from = b, len(b.keys)*c.h.Config().BlockSize
	}
	var err error
	ch.keys, ch.last, err = c.extend(ch.keys, ch.last, hashing.Request{Tokens: p.tokens[from:], CacheSalt: p.salt})
	if err != nil {
		return chain{}, fmt.Errorf("hashing prefix %d: %w", p.id, err)
	}
	ch.keys = slices.Clip(ch.keys)
	c.prefixes[p] = ch
	return ch, nil
}

// keys returns the block keys of r's prompt.
func (c *chainHasher) keys(r *request) ([]uint64, error) {
	bs := c.h.Config().BlockSize
	pre, err := c.prefix(r.prefix)
	if err != nil {
		return nil, err
	}
	c.tail = append(c.tail[:0], r.prefix.tokens[len(pre.keys)*bs:]...)
	c.tail = append(c.tail, r.suffix...)
	if len(pre.keys) == 0 && r.prefix.salt != "" {
		// The salt keys block 0, which only the whole prompt fills.
		keys, _, err := c.extend(nil, pre.last, hashing.Request{Tokens: c.tail, CacheSalt: r.prefix.salt})
		return keys, err
	}
	keys, _, err := c.extend(pre.keys, pre.last, hashing.Request{Tokens: c.tail})
	if err != nil {
		return nil, fmt.Errorf("hashing %s: %w", r.name, err)
	}
	return keys, nil
}

func (c *chainHasher) register(blocks []hashing.Block) {
	if c.offload == nil {
		return
	}
	for _, b := range blocks {
		if _, ok := c.offload[b.Key]; !ok {
			c.offload[b.Key] = transfer.NewKey(b.Digest.Bytes(), 0)
		}
	}
}

// forkBurst is the published experiment: n subagents fork over one session's
// prefix, arriving gap seconds apart on average (each gap drawn uniformly
// from half to one and a half times it: an agent issuing its tool calls at a
// steady pace), each with its own task prompt of suffixMin..suffixMax tokens.
func forkBurst(seed uint64, n, prefixTokens, suffixMin, suffixMax int, gap float64) ([]*prompt, []*request) {
	rng := rand.New(rand.NewPCG(seed, 0xf0)) //nolint:gosec // a reproducible workload, not a secret
	session := &prompt{id: 0, tokens: randomTokens(rng, prefixTokens)}
	reqs := make([]*request, n)
	t := 0.0
	for i := range reqs {
		if i > 0 {
			t += gap * (0.5 + rng.Float64())
		}
		reqs[i] = &request{
			id: i, name: fmt.Sprintf("fork-%d-branch-%d", seed, i), arrival: t, prefix: session,
			suffix: randomTokens(rng, suffixMin+rng.IntN(suffixMax-suffixMin+1)),
		}
	}
	return []*prompt{session}, reqs
}

// sharedPrefixes returns n shared prefixes of tokens tokens each.
func sharedPrefixes(seed uint64, n, tokens int) []*prompt {
	rng := rand.New(rand.NewPCG(seed, 0x5e)) //nolint:gosec // a reproducible workload
	ps := make([]*prompt, n)
	for i := range ps {
		ps[i] = &prompt{id: i, tokens: randomTokens(rng, tokens)}
	}
	return ps
}

// poissonLoad draws requests at rate per second for duration seconds, each
// on a uniformly chosen prefix with a suffix of suffixMin..suffixMax tokens.
func poissonLoad(seed uint64, prefixes []*prompt, rate, duration float64, suffixMin, suffixMax int) []*request {
	rng := rand.New(rand.NewPCG(seed, uint64(rate*1000))) //nolint:gosec // a reproducible workload
	var reqs []*request
	for t := rng.ExpFloat64() / rate; t < duration; t += rng.ExpFloat64() / rate {
		i := len(reqs)
		reqs = append(reqs, &request{
			id: i, name: fmt.Sprintf("load-%d-%g-%d", seed, rate, i), arrival: t,
			prefix: prefixes[rng.IntN(len(prefixes))],
			suffix: randomTokens(rng, suffixMin+rng.IntN(suffixMax-suffixMin+1)),
		})
	}
	return reqs
}
