package hashing

import (
	"fmt"
	"slices"
)

// Prefix is a hashed prefix of a request that grows as tokens arrive: the
// next turn of a conversation, or decoding. Extending it hashes only the new
// blocks, and it keeps the pending partial block until it fills. Its keys
// always equal BlockKeys of the whole request so far. That is what vLLM
// computes for a new request (the next turn); for blocks completed while
// decoding, vLLM restarts its multimodal walk at the last item, so a block
// that two or more items overlap hashes differently there.
//
// A Prefix is not safe for concurrent mutation; Clone gives each fork (a
// subagent sharing a system prompt, say) its own copy in O(pending tokens).
//
// The zero Prefix is an empty prefix of the zero Hasher, that is of vLLM's
// default configuration: as if made by NewPrefix(Request{}) on New(Config{}).
type Prefix struct {
	h        *Hasher
	c        chain
	d        derived      // d.mm is never modified in place, so clones share it
	explicit bool         // extra keys come from extra, not from d
	extra    [][]ExtraKey // explicit mode: extra-keys tuple of every block
	keys     []uint64
	pending  []uint32
}

// NewPrefix hashes req's full blocks and returns the Prefix holding them and
// the remaining tokens. With req.Extra set, later blocks need their extra
// keys added with AddExtra before Append can hash them.
func (h *Hasher) NewPrefix(req Request) (*Prefix, error) {
	h.ready()
	if h.enc == encSGLangEAGLE {
		return nil, fmt.Errorf("%w: a Prefix of %s, whose blocks need the token after them", ErrUnsupported, h.cfg.Algo)
	}
	if err := h.checkEngineRequest(&req); err != nil {
		return nil, err
	}
	d, err := prepare(&req, len(req.Tokens)/h.cfg.BlockSize, false)
	if err != nil {
		return nil, err
	}
	d.mm = slices.Clone(d.mm)
	p := &Prefix{h: h, c: chain{parent: h.root}, d: d}
	if req.Extra != nil {
		p.explicit = true
		p.extra = slices.Clone(req.Extra)
	}
	if err := p.Append(req.Tokens...); err != nil {
		return nil, err
	}
	return p, nil
}

// defaultHasher is the Hasher of zero Prefixes.
var defaultHasher Hasher

// initZero makes a zero Prefix the empty prefix of defaultHasher before its
// first change.
func (p *Prefix) initZero() {
	if p.h == nil {
		p.h = defaultHasher.ready()
		p.c.parent = p.h.root
	}
}

// Append adds tokens and hashes every block they complete. On error the
// Prefix is unchanged.
func (p *Prefix) Append(tokens ...uint32) error {
	p.initZero()
	bs := p.h.cfg.BlockSize
	full := (len(p.pending) + len(tokens)) / bs
	if p.explicit && len(p.extra) < len(p.keys)+full {
		return fmt.Errorf("%w: %d tuples for %d full blocks", ErrExtraKeys, len(p.extra), len(p.keys)+full)
	}
	out := sink{keys: p.keys}
	extra := func() [][]ExtraKey {
		if !p.explicit {
			return nil
		}
		return p.extra[len(p.keys):]
	}
	if len(p.pending) > 0 {
		fill := min(bs-len(p.pending), len(tokens))
		p.pending = append(p.pending, tokens[:fill]...)
		tokens = tokens[fill:]
		if len(p.pending) < bs {
			return nil
		}
		p.h.walk(&p.c, p.pending, &p.d, extra(), &out)
		p.keys = out.keys
		p.pending = p.pending[:0]
	}
	n := len(tokens) / bs * bs
	p.h.walk(&p.c, tokens[:n], &p.d, extra(), &out)
	p.keys = out.keys
	p.pending = append(p.pending, tokens[n:]...)
	return nil
}

// AddExtra supplies the extra-keys tuples of the next blocks of a Prefix made
// from a Request with Extra.
func (p *Prefix) AddExtra(extra ...[]ExtraKey) error {
	if !p.explicit {
		return fmt.Errorf("%w: AddExtra on a Prefix with derived extra keys", ErrExtraMode)
	}
	p.extra = append(p.extra, extra...)
	return nil
}

// AddMM adds multimodal items (offsets from the start of the request), such
// as an image in the next turn. It fails, leaving the Prefix unchanged, when
// the items would change the extra keys of blocks already hashed: then the
// request is not an extension of this prefix and must be hashed anew.
func (p *Prefix) AddMM(items ...MMItem) error {
	if p.explicit {
		return fmt.Errorf("%w: AddMM on a Prefix with explicit extra keys", ErrExtraMode)
	}
	p.initZero()
	add, err := sortedMM(items, false)
	if err != nil {
		return err
	}
	merged := slices.Clone(p.d.mm)
	for _, it := range add {
		i, _ := slices.BinarySearchFunc(merged, it.Offset+1, func(m MMItem, off int) int { return m.Offset - off })
		merged = slices.Insert(merged, i, it)
	}
	bs := p.h.cfg.BlockSize
	var oldCur, newCur mmCursor
	var oldIdx, newIdx []int
	for start := 0; start < p.c.pos; start += bs {
		oldIdx = oldCur.advance(oldIdx[:0], p.d.mm, start, start+bs)
		newIdx = newCur.advance(newIdx[:0], merged, start, start+bs)
		same := len(oldIdx) == len(newIdx)
		for i := 0; same && i < len(oldIdx); i++ {
			same = p.d.mm[oldIdx[i]] == merged[newIdx[i]]
		}
		if !same {
			return fmt.Errorf("%w: items change the extra keys of hashed block %d", ErrMMItem, start/bs)
		}
	}
	p.d.mm = merged
	p.c.cur = newCur
	return nil
}

// Keys returns the event-form key of every full block. The caller must not
// modify it; later Appends do not change it.
func (p *Prefix) Keys() []uint64 { return p.keys[:len(p.keys):len(p.keys)] }

// Len returns the number of full blocks.
func (p *Prefix) Len() int { return len(p.keys) }

// Tokens returns the number of tokens, the pending ones included.
func (p *Prefix) Tokens() int { return p.c.pos + len(p.pending) }

// Pending returns a copy of the tokens of the partial block.
func (p *Prefix) Pending() []uint32 { return slices.Clone(p.pending) }

// Last returns the digest of the last full block, or Hasher.Root when there
// is none: the parent of the next block.
func (p *Prefix) Last() Digest {
	if p.h == nil {
		return defaultHasher.Root()
	}
	return p.c.parent
}

// Clone returns an independent copy that shares the hashed blocks.
func (p *Prefix) Clone() *Prefix {
	c := *p
	c.keys = p.keys[:len(p.keys):len(p.keys)]
	c.extra = p.extra[:len(p.extra):len(p.extra)]
	c.pending = slices.Clone(p.pending)
	return &c
}
