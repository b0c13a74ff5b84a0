package main

import (
	"fmt"
	"math/rand/v2"

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
	ttft           float64
	done           bool
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
	pre, ok := rh.prefixes[r.prefix]
	if !ok {
		var err error
		if pre, err = rh.h.NewPrefix(hashing.Request{Tokens: r.prefix.tokens}); err != nil {
			return nil, fmt.Errorf("router hashing prefix %d: %w", r.prefix.id, err)
		}
		rh.prefixes[r.prefix] = pre
	}
	fork := pre.Clone()
	if err := fork.Append(r.suffix...); err != nil {
		return nil, fmt.Errorf("router hashing %s: %w", r.name, err)
	}
	return fork.Keys(), nil
}

// chainHasher is the engines' hashing: full digests, since a pull names
// blocks by digest. Each shared prefix is hashed once and its chain
// continued for every suffix, as vLLM extends a running request's hashes.
// The engines and the router hash independently: the router's keys must
// match the engines' for any lookup to hit.
type chainHasher struct {
	h        *hashing.Hasher
	prefixes map[*prompt][]hashing.Block
	// offload maps an event key to the engine's offload key (the full
	// digest and KV group 0), what a pull names a block by.
	offload map[uint64]transfer.Key
	scratch []hashing.Block
	tail    []uint32
}

func newChainHasher(cfg hashing.Config, offloadKeys bool) (*chainHasher, error) {
	h, err := hashing.New(cfg)
	if err != nil {
		return nil, err
	}
	c := &chainHasher{h: h, prefixes: make(map[*prompt][]hashing.Block)}
	if offloadKeys {
		c.offload = make(map[uint64]transfer.Key)
	}
	return c, nil
}

// keys returns the block keys of r's prompt.
func (c *chainHasher) keys(r *request) ([]uint64, error) {
	bs := c.h.Config().BlockSize
	pre, ok := c.prefixes[r.prefix]
	if !ok {
		var err error
		pre, err = c.h.Blocks(nil, hashing.Request{Tokens: r.prefix.tokens})
		if err != nil {
			return nil, fmt.Errorf("hashing prefix %d: %w", r.prefix.id, err)
		}
		c.prefixes[r.prefix] = pre
		c.register(pre)
	}
	parent := c.h.Root()
	if len(pre) > 0 {
		parent = pre[len(pre)-1].Digest
	}
	c.tail = append(c.tail[:0], r.prefix.tokens[len(pre)*bs:]...)
	c.tail = append(c.tail, r.suffix...)
	var err error
	c.scratch, err = c.h.BlocksFrom(c.scratch, parent, hashing.Request{Tokens: c.tail})
	if err != nil {
		return nil, fmt.Errorf("hashing %s: %w", r.name, err)
	}
	c.register(c.scratch)
	keys := make([]uint64, 0, len(pre)+len(c.scratch))
	for _, b := range pre {
		keys = append(keys, b.Key)
	}
	for _, b := range c.scratch {
		keys = append(keys, b.Key)
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
