package picker

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/kvsource/kvsource/index"
)

// Score is one holder's match of a prompt.
type Score struct {
	Holder index.Holder
	// Blocks is the holder's consecutive prefix of the prompt in any tier.
	Blocks int
	// Tiers holds each tier's own consecutive prefix, for tiers with one.
	Tiers []index.TierPrefix
	// Score weighs each block of the prefix by the highest weight among the
	// tiers whose own consecutive prefix covers it; a block covered by no
	// single tier's prefix (the prefix continues only across tiers) counts
	// with the lowest configured weight. With the default weights a prefix
	// of n blocks on GPU scores n, and on CPU only 0.8n.
	Score float64
}

// Tier returns the holder's consecutive prefix in tier t, 0 when none.
func (s *Score) Tier(t string) int {
	for _, tp := range s.Tiers {
		if tp.Tier == t {
			return tp.Blocks
		}
	}
	return 0
}

// Score appends to dst[:0] the match of every holder with a non-empty prefix
// of req's prompt, or of every candidate when req has candidates (with zero
// scores for those holding nothing), best first: by score, then blocks, then
// holder. It reads req's Model, Keys or Prompt, and Candidates. Reusing dst
// across calls reuses its Tiers slices too. A prompt no holder has a block
// of, under a model the index knows no holder of while it knows others,
// fails with ErrUnknownModel.
func (p *Picker) Score(req Request, dst []Score) ([]Score, error) {
	return p.ScoreContext(context.Background(), req, dst)
}

// ScoreContext is Score that stops when ctx is done: between blocks while
// hashing the prompt and before the lookup, returning an error that wraps
// ctx's.
func (p *Picker) ScoreContext(ctx context.Context, req Request, dst []Score) ([]Score, error) {
	dst = dst[:0]
	s := p.getScratch()
	defer p.putScratch(s)
	keys, err := p.keys(ctx, &req, s)
	if err != nil {
		return dst, err
	}
	if err := stopped(ctx, ctx.Done(), "before the lookup"); err != nil {
		return dst, err
	}
	if len(keys) > 0 {
		p.idx.Lookup(req.Model, keys, &s.res)
		if len(s.res.Hits) == 0 && p.unknownModel(req.Model, s) {
			return dst, fmt.Errorf("%w %q", ErrUnknownModel, req.Model)
		}
	} else {
		s.res.Hits = s.res.Hits[:0]
	}
	if len(req.Candidates) == 0 {
		for i := range s.res.Hits {
			dst = p.appendScore(dst, &s.res.Hits[i])
		}
	} else {
		for _, c := range req.Candidates {
			if hit := s.res.Holder(c.Holder); hit != nil {
				dst = p.appendScore(dst, hit)
			} else {
				dst = p.appendScore(dst, &index.Hit{Holder: c.Holder})
			}
		}
	}
	slices.SortFunc(dst, func(a, b Score) int {
		if c := cmp.Compare(b.Score, a.Score); c != 0 {
			return c
		}
		if c := cmp.Compare(b.Blocks, a.Blocks); c != 0 {
			return c
		}
		return a.Holder.Compare(b.Holder)
	})
	return dst, nil
}

func (p *Picker) appendScore(dst []Score, hit *index.Hit) []Score {
	n := len(dst)
	if n < cap(dst) {
		dst = dst[:n+1]
	} else {
		dst = append(dst, Score{})
	}
	s := &dst[n]
	s.Holder = hit.Holder
	s.Blocks = hit.Prefix
	s.Tiers = append(s.Tiers[:0], hit.Tiers...)
	s.Score = p.weigh(hit)
	return dst
}

func (p *Picker) weight(tier string) float64 {
	for _, tw := range p.weights {
		if tw.tier == tier {
			return tw.weight
		}
	}
	return p.minWeight
}

func (p *Picker) weigh(hit *index.Hit) float64 {
	// Walk the prefix front to back; each step credits the blocks up to the
	// end of the heaviest tier whose prefix extends past what is covered.
	covered, score := 0, 0.0
	for {
		next, w := covered, -1.0
		for _, tp := range hit.Tiers {
			if tp.Blocks <= covered {
				continue
			}
			tw := p.weight(tp.Tier)
			if tw > w || (tw == w && tp.Blocks > next) {
				next, w = tp.Blocks, tw
			}
		}
		if w < 0 {
			break
		}
		score += w * float64(min(next, hit.Prefix)-covered)
		covered = min(next, hit.Prefix)
		if covered == hit.Prefix {
			break
		}
	}
	return score + p.minWeight*float64(hit.Prefix-covered)
}
