package transfer

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ProbeResult is a peer's answer to "do you still hold these keys?".
type ProbeResult struct {
	Hits     []bool        // Hits[i] answers keys[i]
	Prefix   int           // leading consecutive hits: the pullable prefix
	Duration time.Duration // lookup round trip
}

// Probe asks the peer of s which of keys it still holds, then ends the
// request with an empty fetch so the peer releases the pins the lookup took.
// This is the verification a router runs before naming a peer to pull from.
func Probe(ctx context.Context, s Session, keys []Key) (ProbeResult, error) {
	start := time.Now()
	hits, err := s.Lookup(ctx, keys)
	if err != nil {
		return ProbeResult{}, fmt.Errorf("probe %s: %w", s.Peer(), err)
	}
	r := ProbeResult{Hits: hits, Prefix: Prefix(hits), Duration: time.Since(start)}
	if _, err := s.Fetch(ctx, nil, nil); err != nil {
		return r, fmt.Errorf("probe %s: release: %w", s.Peer(), err)
	}
	return r, nil
}

// Prefix returns the number of leading true values of hits.
func Prefix(hits []bool) int {
	for i, h := range hits {
		if !h {
			return i
		}
	}
	return len(hits)
}

// Sample is one measurement of how long a prompt's prefix took: handling
// Tokens tokens took Millis milliseconds. It is the one measurement type of
// the SDK: MeasurePull returns pulls as Samples (Blocks is then the number
// of keys pulled, lookup and fetch included in Millis), a caller times
// recomputes as Samples (Blocks optional), picker.Fit fits both, and
// kvsource serve's --calibration file holds them as JSON.
type Sample struct {
	Tokens int     `json:"tokens"`
	Blocks int     `json:"blocks,omitempty"`
	Millis float64 `json:"ms"`
}

// PullPlan configures MeasurePull.
type PullPlan struct {
	// Sizes are the numbers of keys to pull, each at most len(keys).
	// Default: 1, 2, 4, ... doubling up to len(keys), and len(keys).
	Sizes []int
	// Repeats is the number of pulls per size. Default 1.
	Repeats int
	// TokensPerKey is the number of tokens one key covers (block size times
	// blocks per offloaded chunk). Default 16, vLLM's default block size.
	TokensPerKey int
	// Now reads the clock the samples are timed with. Default time.Now; a
	// simulator on virtual time passes its own clock.
	Now func() time.Time
}

func (p PullPlan) withDefaults(n int) PullPlan {
	if len(p.Sizes) == 0 {
		for s := 1; s < n; s *= 2 {
			p.Sizes = append(p.Sizes, s)
		}
		if n > 0 {
			p.Sizes = append(p.Sizes, n)
		}
	}
	if p.Repeats < 1 {
		p.Repeats = 1
	}
	if p.TokensPerKey < 1 {
		p.TokensPerKey = 16
	}
	if p.Now == nil {
		p.Now = time.Now
	}
	return p
}

// MeasurePull times pulls of growing prefixes of keys from the peer of s,
// each a lookup followed by a fetch of keys[:n] into blockIndexes[:n]. Every
// pulled key must be held by the peer: a miss ends the request (empty fetch)
// and returns ErrMissingKeys with the samples taken so far.
func MeasurePull(ctx context.Context, s Session, keys []Key, blockIndexes []int, plan PullPlan) ([]Sample, error) {
	if len(keys) != len(blockIndexes) {
		return nil, fmt.Errorf("%w: %d keys, %d block indexes", ErrInvalid, len(keys), len(blockIndexes))
	}
	plan = plan.withDefaults(len(keys))
	for _, n := range plan.Sizes {
		if n < 1 || n > len(keys) {
			return nil, fmt.Errorf("%w: pull size %d outside 1..%d", ErrInvalid, n, len(keys))
		}
	}
	samples := make([]Sample, 0, len(plan.Sizes)*plan.Repeats)
	for _, n := range plan.Sizes {
		for range plan.Repeats {
			start := plan.Now()
			hits, err := s.Lookup(ctx, keys[:n])
			if err != nil {
				return samples, fmt.Errorf("measure pull from %s: %w", s.Peer(), err)
			}
			if p := Prefix(hits); p < n {
				_, rerr := s.Fetch(ctx, nil, nil)
				return samples, errors.Join(fmt.Errorf("measure pull from %s: %w: key %d of %d", s.Peer(), ErrMissingKeys, p, n), rerr)
			}
			if _, err := s.Fetch(ctx, keys[:n], blockIndexes[:n]); err != nil {
				return samples, fmt.Errorf("measure pull from %s: %w", s.Peer(), err)
			}
			samples = append(samples, Sample{
				Tokens: n * plan.TokensPerKey,
				Blocks: n,
				Millis: float64(plan.Now().Sub(start)) / float64(time.Millisecond),
			})
		}
	}
	return samples, nil
}
