package fake

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/kvsource/kvsource/internal/ctxlock"
	"github.com/kvsource/kvsource/transfer"
)

type session struct {
	c *Client
	p *Peer

	// mu serialises Lookup, Fetch and the round bookkeeping of Abort.
	mu   sync.Mutex
	pins *keySet // hits of the current round's lookups

	// st guards the fields below; Abort and Close take it while a Fetch
	// holds mu.
	st       sync.Mutex
	closed   bool
	done     chan struct{} // closed by Close, to wake calls waiting on a stalled peer
	dead     bool
	inflight context.CancelCauseFunc
	abortErr error // outcome of the abort an in-flight Fetch performed
}

var _ transfer.Session = (*session)(nil)

func (s *session) Peer() string { return s.p.name }

// check fails the call when the session is closed or lost, or when the peer
// became unreachable, in which case the session is lost from now on.
func (s *session) check() error {
	s.st.Lock()
	defer s.st.Unlock()
	switch {
	case s.closed:
		return transfer.ErrClosed
	case s.dead:
		return fmt.Errorf("%w: %s", transfer.ErrPeerLost, s.p.name)
	case s.p.isRemoved() || s.p.Faults().Unreachable:
		s.dead = true
		return fmt.Errorf("%w: %s", transfer.ErrPeerLost, s.p.name)
	}
	return nil
}

func (s *session) markDead() {
	s.st.Lock()
	s.dead = true
	s.st.Unlock()
}

func (s *session) Lookup(ctx context.Context, keys []transfer.Key) ([]bool, error) {
	n := s.c.n
	for i, k := range keys {
		if !k.Valid() {
			n.c.invalid.Add(1)
			return nil, fmt.Errorf("lookup at %s: %w: key %d is %d bytes", s.p.name, transfer.ErrInvalid, i, len(k))
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.check(); err != nil {
		return nil, fmt.Errorf("lookup at %s: %w", s.p.name, err)
	}
	f := s.p.Faults()
	if f.Stall {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("lookup at %s: %w", s.p.name, ctx.Err())
		case <-s.done:
			return nil, fmt.Errorf("lookup at %s: %w", s.p.name, transfer.ErrClosed)
		}
	}
	if err := n.cfg.Sleep(ctx, n.cfg.Latency); err != nil {
		return nil, fmt.Errorf("lookup at %s: %w", s.p.name, err)
	}
	hits := make([]bool, len(keys))
	nhits := 0
	s.p.mu.Lock()
	for i, k := range keys {
		if _, ok := s.p.blocks[string(k)]; ok && (f.Miss == nil || !f.Miss(k)) {
			hits[i] = true
			nhits++
			s.pins.add(k)
			if f.EvictAfterLookup {
				delete(s.p.blocks, string(k))
			}
		}
	}
	s.p.mu.Unlock()
	n.c.lookups.Add(1)
	n.c.lookupKeys.Add(uint64(len(keys)))
	n.c.lookupHits.Add(uint64(nhits))
	return hits, nil
}

func (s *session) Fetch(ctx context.Context, keys []transfer.Key, blockIndexes []int) (transfer.Stats, error) {
	n := s.c.n
	if err := s.validate(keys, blockIndexes); err != nil {
		n.c.invalid.Add(1)
		return transfer.Stats{}, fmt.Errorf("fetch from %s: %w", s.p.name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.check(); err != nil {
		return transfer.Stats{}, fmt.Errorf("fetch from %s: %w", s.p.name, err)
	}
	if len(keys) == 0 {
		// The request ends; the peer sends no reply, so no time is charged.
		s.pins.reset()
		n.c.emptyFetches.Add(1)
		return transfer.Stats{}, nil
	}

	fctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	s.st.Lock()
	s.inflight = cancel
	s.abortErr = nil
	s.st.Unlock()
	defer func() {
		s.st.Lock()
		s.inflight = nil
		s.st.Unlock()
	}()

	st, err := s.transfer(fctx, keys, blockIndexes)
	// The round is closed whatever the outcome: vLLM's consumer moves to the
	// next round after a fetch, and the producer's pins for it are spent.
	s.pins.reset()
	if err != nil {
		n.c.fetchErrors.Add(1)
		return transfer.Stats{}, fmt.Errorf("fetch from %s: %w", s.p.name, err)
	}
	n.c.fetches.Add(1)
	n.c.blocks.Add(uint64(st.Blocks))
	n.c.bytes.Add(uint64(st.Bytes))
	return st, nil
}

func (s *session) validate(keys []transfer.Key, blockIndexes []int) error {
	if len(keys) != len(blockIndexes) {
		return fmt.Errorf("%w: %d keys, %d block indexes", transfer.ErrInvalid, len(keys), len(blockIndexes))
	}
	bl := s.c.n.cfg.BlockLen
	limit := -1
	if s.c.dst != nil {
		limit = len(s.c.dst) / bl
	}
	for i, b := range blockIndexes {
		if !keys[i].Valid() {
			return fmt.Errorf("%w: key %d is %d bytes", transfer.ErrInvalid, i, len(keys[i]))
		}
		if b < 0 || (limit >= 0 && b >= limit) {
			return fmt.Errorf("%w: block index %d outside the destination", transfer.ErrInvalid, b)
		}
	}
	return nil
}

// transfer runs one non-empty fetch under ctx, which Abort cancels with
// cause transfer.ErrAborted.
func (s *session) transfer(ctx context.Context, keys []transfer.Key, blockIndexes []int) (transfer.Stats, error) {
	n := s.c.n
	f := s.p.Faults()
	if f.Stall {
		<-ctx.Done()
		s.markDead()
		return transfer.Stats{}, fmt.Errorf("%w: abort not acknowledged: %w", transfer.ErrPeerLost, context.Cause(ctx))
	}
	fail := func(err error) (transfer.Stats, error) {
		if serr := n.cfg.Sleep(ctx, n.cfg.Latency); serr != nil {
			return s.aborted(ctx)
		}
		return transfer.Stats{}, err
	}
	if err := s.missing(keys); err != nil {
		return fail(err)
	}
	if f.FailFetch {
		return fail(fmt.Errorf("%w: injected transfer failure", transfer.ErrFetchFailed))
	}
	cost := n.FetchCost(len(keys))
	if err := n.cfg.Sleep(ctx, cost); err != nil {
		return s.aborted(ctx)
	}
	bl := n.cfg.BlockLen
	if s.c.dst != nil {
		s.p.mu.Lock()
		for i, k := range keys {
			dst := s.c.dst[blockIndexes[i]*bl : (blockIndexes[i]+1)*bl]
			if b := s.p.blocks[string(k)]; b != nil {
				copy(dst, b)
			} else {
				// Held synthetic content, or evicted during the transfer,
				// which a real peer's pin prevents: either way the key's
				// synthetic content.
				fillContent(dst, k)
			}
		}
		s.p.mu.Unlock()
	}
	return transfer.Stats{Blocks: len(keys), Bytes: int64(len(keys)) * int64(bl), Duration: cost}, nil
}

// missing reports the first of keys that is not a pinned hit of this round
// or no longer held, taking the peer's lock once for all keys.
func (s *session) missing(keys []transfer.Key) error {
	s.p.mu.Lock()
	defer s.p.mu.Unlock()
	for i, k := range keys {
		if !s.pins.has(k) {
			return fmt.Errorf("%w: key %d (%v) was not a hit of this round", transfer.ErrMissingKeys, i, k)
		}
		if _, ok := s.p.blocks[string(k)]; !ok {
			return fmt.Errorf("%w: key %d (%v) was evicted", transfer.ErrMissingKeys, i, k)
		}
	}
	return nil
}

// aborted finishes a fetch whose ctx ended: the abort is sent and its
// acknowledgement awaited, as vLLM's consumer does, unless the peer stalled.
func (s *session) aborted(ctx context.Context) (transfer.Stats, error) {
	n := s.c.n
	cause := context.Cause(ctx)
	var err error
	switch {
	case s.p.Faults().Stall:
		s.markDead()
		err = fmt.Errorf("%w: abort not acknowledged: %w", transfer.ErrPeerLost, cause)
	default:
		if serr := n.cfg.Sleep(context.WithoutCancel(ctx), n.cfg.Latency); serr != nil {
			err = fmt.Errorf("%w: %w", transfer.ErrPeerLost, serr)
		} else if errors.Is(cause, transfer.ErrAborted) {
			err = cause
		} else {
			err = fmt.Errorf("%w: %w", transfer.ErrAborted, cause)
		}
		n.c.aborts.Add(1)
	}
	s.st.Lock()
	s.abortErr = err
	s.st.Unlock()
	return transfer.Stats{}, err
}

func (s *session) Abort(ctx context.Context) error {
	n := s.c.n
	s.st.Lock()
	if s.closed {
		s.st.Unlock()
		return transfer.ErrClosed
	}
	cancel := s.inflight
	s.st.Unlock()
	if cancel != nil {
		cancel(transfer.ErrAborted)
	}
	// Wait for an in-flight Fetch to finish its abort; its outcome is ours.
	if err := ctxlock.Lock(ctx, &s.mu); err != nil {
		return fmt.Errorf("abort at %s: %w", s.p.name, err)
	}
	defer s.mu.Unlock()
	if cancel != nil {
		s.st.Lock()
		err := s.abortErr
		s.st.Unlock()
		if err == nil || errors.Is(err, transfer.ErrAborted) {
			return nil
		}
		return fmt.Errorf("abort at %s: %w", s.p.name, err)
	}
	if err := s.check(); err != nil {
		return fmt.Errorf("abort at %s: %w", s.p.name, err)
	}
	if s.p.Faults().Stall {
		select {
		case <-ctx.Done():
		case <-s.done:
			return fmt.Errorf("abort at %s: %w", s.p.name, transfer.ErrClosed)
		}
		s.markDead()
		return fmt.Errorf("abort at %s: %w: abort not acknowledged: %w", s.p.name, transfer.ErrPeerLost, ctx.Err())
	}
	if err := n.cfg.Sleep(ctx, n.cfg.Latency); err != nil {
		return fmt.Errorf("abort at %s: %w", s.p.name, err)
	}
	s.pins.reset()
	n.c.aborts.Add(1)
	return nil
}

func (s *session) Close() error {
	s.st.Lock()
	defer s.st.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	close(s.done)
	if s.inflight != nil {
		s.inflight(transfer.ErrClosed)
	}
	return nil
}
