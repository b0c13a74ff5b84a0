package fake_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
	"github.com/kvsource/kvsource/transfer/fake"
)

const blockLen = 64

// virtualClock charges time without sleeping and records every charge.
type virtualClock struct {
	mu      sync.Mutex
	now     time.Duration
	charges []time.Duration
}

func (c *virtualClock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	c.now += d
	c.charges = append(c.charges, d)
	c.mu.Unlock()
	return nil
}

func (c *virtualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return time.Unix(0, 0).Add(c.now)
}

func keys(n int, base uint64) []transfer.Key {
	ks := make([]transfer.Key, n)
	for i := range ks {
		ks[i] = transfer.KeyFromUint64(base+uint64(i), 0)
	}
	return ks
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

func setup(t *testing.T, cfg fake.Config, dstBlocks int) (*fake.Network, *fake.Peer, []byte, transfer.Session) {
	t.Helper()
	cfg.BlockLen = blockLen
	n := fake.New(cfg)
	p := n.AddPeer("pod-a")
	dst := make([]byte, dstBlocks*blockLen)
	s, err := n.Client(dst).Connect(context.Background(), "pod-a")
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return n, p, dst, s
}

func TestFetchWritesBlockContentsIntoDestinationIndexes(t *testing.T) {
	_, p, dst, s := setup(t, fake.Config{}, 8)
	ks := keys(3, 100)
	put := bytes.Repeat([]byte{0xab}, blockLen)
	require.NoError(t, p.Put(ks[0], put))
	p.Hold(ks[1], ks[2])

	ctx := context.Background()
	hits, err := s.Lookup(ctx, ks)
	require.NoError(t, err)
	require.Equal(t, []bool{true, true, true}, hits)
	st, err := s.Fetch(ctx, ks, []int{5, 0, 7})
	require.NoError(t, err)
	require.Equal(t, transfer.Stats{Blocks: 3, Bytes: 3 * blockLen}, st)

	require.Equal(t, put, dst[5*blockLen:6*blockLen])
	require.Equal(t, fake.Content(ks[1], blockLen), dst[0:blockLen])
	require.Equal(t, fake.Content(ks[2], blockLen), dst[7*blockLen:8*blockLen])
	require.Equal(t, make([]byte, blockLen), dst[blockLen:2*blockLen], "untouched block stays zero")
}

func TestContentIsDeterministicPerKey(t *testing.T) {
	a := fake.Content(transfer.KeyFromUint64(1, 0), 100)
	require.Equal(t, a, fake.Content(transfer.KeyFromUint64(1, 0), 100))
	require.NotEqual(t, a, fake.Content(transfer.KeyFromUint64(2, 0), 100))
	require.NotEqual(t, a, fake.Content(transfer.KeyFromUint64(1, 1), 100), "group is part of the key")
}

func TestLookupReportsOnlyHeldKeys(t *testing.T) {
	_, p, _, s := setup(t, fake.Config{}, 4)
	ks := keys(4, 0)
	p.Hold(ks[0], ks[2])
	hits, err := s.Lookup(context.Background(), ks)
	require.NoError(t, err)
	require.Equal(t, []bool{true, false, true, false}, hits)
}

func TestLatencyAndBandwidthAreChargedThroughSleep(t *testing.T) {
	clk := &virtualClock{}
	n, p, _, s := setup(t, fake.Config{Latency: 2 * time.Millisecond, Bandwidth: blockLen * 1000, Sleep: clk.Sleep}, 16)
	ks := keys(10, 0)
	p.Hold(ks...)
	ctx := context.Background()
	_, err := s.Lookup(ctx, ks)
	require.NoError(t, err)
	st, err := s.Fetch(ctx, ks, seq(10))
	require.NoError(t, err)

	// 10 blocks at 1000 blocks/s = 10 ms, plus the 2 ms floor.
	want := 12 * time.Millisecond
	require.Equal(t, want, n.FetchCost(10))
	require.Equal(t, want, st.Duration)
	require.Equal(t, []time.Duration{2 * time.Millisecond /* connect */, 2 * time.Millisecond /* lookup */, want}, clk.charges)
}

func TestFetchCostWithUnlimitedBandwidthIsTheLatencyFloor(t *testing.T) {
	n := fake.New(fake.Config{Latency: time.Millisecond})
	require.Equal(t, time.Millisecond, n.FetchCost(1000))
	require.Equal(t, 4096, n.BlockLen())
}

func TestRealSleepTakesWallTime(t *testing.T) {
	_, p, _, s := setup(t, fake.Config{Latency: 20 * time.Millisecond}, 1)
	ks := keys(1, 0)
	p.Hold(ks...)
	start := time.Now()
	_, err := s.Lookup(context.Background(), ks)
	require.NoError(t, err)
	require.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond)
}

func TestFetchRules(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		run  func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error
		want error
	}{
		{"key not looked up", func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error {
			_, err := s.Fetch(ctx, ks[:1], []int{0})
			return err
		}, transfer.ErrMissingKeys},
		{"key a miss of this round", func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error {
			_, err := s.Lookup(ctx, ks[2:3])
			if err != nil {
				return err
			}
			_, err = s.Fetch(ctx, ks[2:3], []int{0})
			return err
		}, transfer.ErrMissingKeys},
		{"hit of an earlier, fetched round", func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error {
			if _, err := s.Lookup(ctx, ks[:2]); err != nil {
				return err
			}
			if _, err := s.Fetch(ctx, ks[:1], []int{0}); err != nil {
				return err
			}
			_, err := s.Fetch(ctx, ks[1:2], []int{1})
			return err
		}, transfer.ErrMissingKeys},
		{"hit released by an empty fetch", func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error {
			if _, err := s.Lookup(ctx, ks[:1]); err != nil {
				return err
			}
			if _, err := s.Fetch(ctx, nil, nil); err != nil {
				return err
			}
			_, err := s.Fetch(ctx, ks[:1], []int{0})
			return err
		}, transfer.ErrMissingKeys},
		{"evicted after lookup", func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error {
			if _, err := s.Lookup(ctx, ks[:1]); err != nil {
				return err
			}
			p.Evict(ks[0])
			_, err := s.Fetch(ctx, ks[:1], []int{0})
			return err
		}, transfer.ErrMissingKeys},
		{"mismatched lengths", func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error {
			_, err := s.Fetch(ctx, ks[:2], []int{0})
			return err
		}, transfer.ErrInvalid},
		{"block index past the destination", func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error {
			_, err := s.Fetch(ctx, ks[:1], []int{4})
			return err
		}, transfer.ErrInvalid},
		{"negative block index", func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error {
			_, err := s.Fetch(ctx, ks[:1], []int{-1})
			return err
		}, transfer.ErrInvalid},
		{"malformed key", func(s transfer.Session, p *fake.Peer, ks []transfer.Key) error {
			_, err := s.Lookup(ctx, []transfer.Key{{1, 2}})
			return err
		}, transfer.ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, p, _, s := setup(t, fake.Config{}, 4)
			ks := keys(3, 0)
			p.Hold(ks[0], ks[1])
			require.ErrorIs(t, tt.run(s, p, ks), tt.want)
		})
	}
}

func TestFailureInjection(t *testing.T) {
	ctx := context.Background()
	short := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 20*time.Millisecond) }
	tests := []struct {
		name   string
		faults fake.Faults
		run    func(t *testing.T, s transfer.Session, ks []transfer.Key) error
		want   []error
	}{
		{"unreachable mid-session loses the session", fake.Faults{Unreachable: true},
			func(t *testing.T, s transfer.Session, ks []transfer.Key) error {
				_, err := s.Lookup(ctx, ks)
				require.ErrorIs(t, err, transfer.ErrPeerLost)
				_, err = s.Fetch(ctx, nil, nil)
				return err
			}, []error{transfer.ErrPeerLost}},
		{"stalled lookup waits for its context", fake.Faults{Stall: true},
			func(t *testing.T, s transfer.Session, ks []transfer.Key) error {
				c, cancel := short()
				defer cancel()
				_, err := s.Lookup(c, ks)
				return err
			}, []error{context.DeadlineExceeded}},
		{"partial hit", fake.Faults{Miss: func(k transfer.Key) bool { return k.Uint64() == 1 }},
			func(t *testing.T, s transfer.Session, ks []transfer.Key) error {
				hits, err := s.Lookup(ctx, ks)
				require.NoError(t, err)
				require.Equal(t, []bool{true, false, true}, hits)
				_, err = s.Fetch(ctx, ks[1:2], []int{0})
				return err
			}, []error{transfer.ErrMissingKeys}},
		{"evict between lookup and fetch", fake.Faults{EvictAfterLookup: true},
			func(t *testing.T, s transfer.Session, ks []transfer.Key) error {
				hits, err := s.Lookup(ctx, ks)
				require.NoError(t, err)
				require.Equal(t, []bool{true, true, true}, hits)
				_, err = s.Fetch(ctx, ks, seq(3))
				return err
			}, []error{transfer.ErrMissingKeys}},
		{"failed transfer", fake.Faults{FailFetch: true},
			func(t *testing.T, s transfer.Session, ks []transfer.Key) error {
				_, err := s.Lookup(ctx, ks)
				require.NoError(t, err)
				_, err = s.Fetch(ctx, ks, seq(3))
				return err
			}, []error{transfer.ErrFetchFailed}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, p, dst, s := setup(t, fake.Config{}, 4)
			ks := keys(3, 0)
			p.Hold(ks...)
			p.SetFaults(tt.faults)
			err := tt.run(t, s, ks)
			for _, w := range tt.want {
				require.ErrorIs(t, err, w)
			}
			require.Equal(t, make([]byte, len(dst)), dst, "a failed call writes nothing")
		})
	}
}

func TestStalledFetchLosesTheSessionWhenItsContextEnds(t *testing.T) {
	_, p, _, s := setup(t, fake.Config{}, 4)
	ks := keys(2, 0)
	p.Hold(ks...)
	_, err := s.Lookup(context.Background(), ks)
	require.NoError(t, err)
	p.SetFaults(fake.Faults{Stall: true})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err = s.Fetch(ctx, ks, seq(2))
	require.ErrorIs(t, err, transfer.ErrPeerLost)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	p.SetFaults(fake.Faults{})
	_, err = s.Lookup(context.Background(), ks)
	require.ErrorIs(t, err, transfer.ErrPeerLost, "a lost session stays lost")
}

func TestConnectFailures(t *testing.T) {
	tests := []struct {
		name   string
		peer   string
		faults fake.Faults
		want   error
	}{
		{"unknown peer", "nobody", fake.Faults{}, transfer.ErrUnreachable},
		{"unreachable peer", "pod-a", fake.Faults{Unreachable: true}, transfer.ErrUnreachable},
		{"rejecting peer", "pod-a", fake.Faults{Reject: true}, transfer.ErrHandshake},
		{"stalled peer", "pod-a", fake.Faults{Stall: true}, transfer.ErrHandshake},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := &virtualClock{}
			n := fake.New(fake.Config{HandshakeTimeout: 3 * time.Second, Sleep: clk.Sleep})
			n.AddPeer("pod-a").SetFaults(tt.faults)
			_, err := n.Client(nil).Connect(context.Background(), tt.peer)
			require.ErrorIs(t, err, tt.want)
			require.Equal(t, []time.Duration{3 * time.Second}, clk.charges, "failure surfaces after the handshake timeout")
			require.Equal(t, uint64(1), n.Stats().ConnectErrors)
		})
	}
}

func TestConnectWithEndedContextWrapsTheContextError(t *testing.T) {
	n := fake.New(fake.Config{HandshakeTimeout: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	_, err := n.Client(nil).Connect(ctx, "nobody")
	require.ErrorIs(t, err, transfer.ErrUnreachable)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

func TestRemovedPeerIsLostAndUnreachable(t *testing.T) {
	n, p, _, s := setup(t, fake.Config{HandshakeTimeout: time.Millisecond}, 1)
	p.Hold(keys(1, 0)...)
	n.RemovePeer("pod-a")
	require.Nil(t, n.Peer("pod-a"))
	_, err := s.Lookup(context.Background(), keys(1, 0))
	require.ErrorIs(t, err, transfer.ErrPeerLost)
	_, err = n.Client(nil).Connect(context.Background(), "pod-a")
	require.ErrorIs(t, err, transfer.ErrUnreachable)
}

func TestAbortCancelsAnInFlightFetch(t *testing.T) {
	// The transfer's charge blocks until cancelled, so only the abort can
	// end it; started says it is in flight.
	started := make(chan struct{})
	sleep := func(ctx context.Context, d time.Duration) error {
		if d < time.Second {
			return ctx.Err()
		}
		close(started)
		<-ctx.Done()
		return ctx.Err()
	}
	_, p, dst, s := setup(t, fake.Config{Bandwidth: 1, Sleep: sleep}, 1)
	ks := keys(1, 0)
	p.Hold(ks...)
	ctx := context.Background()
	_, err := s.Lookup(ctx, ks)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() {
		_, err := s.Fetch(ctx, ks, []int{0})
		done <- err
	}()
	<-started
	require.NoError(t, s.Abort(ctx))
	require.ErrorIs(t, <-done, transfer.ErrAborted)
	require.Equal(t, make([]byte, blockLen), dst)

	_, err = s.Fetch(ctx, ks, []int{0})
	require.ErrorIs(t, err, transfer.ErrMissingKeys, "the aborted round's pins are gone")
}

func TestFetchAbortsWhenItsContextEnds(t *testing.T) {
	n, p, _, s := setup(t, fake.Config{Bandwidth: 1}, 1)
	ks := keys(1, 0)
	p.Hold(ks...)
	_, err := s.Lookup(context.Background(), ks)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err = s.Fetch(ctx, ks, []int{0})
	require.ErrorIs(t, err, transfer.ErrAborted)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, uint64(1), n.Stats().Aborts)
}

func TestAbortWithoutFetchClosesTheRound(t *testing.T) {
	_, p, _, s := setup(t, fake.Config{}, 1)
	ks := keys(1, 0)
	p.Hold(ks...)
	ctx := context.Background()
	_, err := s.Lookup(ctx, ks)
	require.NoError(t, err)
	require.NoError(t, s.Abort(ctx))
	_, err = s.Fetch(ctx, ks, []int{0})
	require.ErrorIs(t, err, transfer.ErrMissingKeys)
}

func TestAbortOnStalledPeerLosesTheSession(t *testing.T) {
	_, p, _, s := setup(t, fake.Config{}, 1)
	p.SetFaults(fake.Faults{Stall: true})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, s.Abort(ctx), transfer.ErrPeerLost)
}

func TestClosedSessionRefusesCalls(t *testing.T) {
	_, p, _, s := setup(t, fake.Config{}, 1)
	p.Hold(keys(1, 0)...)
	require.NoError(t, s.Close())
	require.NoError(t, s.Close(), "Close is idempotent")
	ctx := context.Background()
	_, err := s.Lookup(ctx, keys(1, 0))
	require.ErrorIs(t, err, transfer.ErrClosed)
	_, err = s.Fetch(ctx, nil, nil)
	require.ErrorIs(t, err, transfer.ErrClosed)
	require.ErrorIs(t, s.Abort(ctx), transfer.ErrClosed)
}

func TestPutRejectsWrongSizesAndBadKeys(t *testing.T) {
	n := fake.New(fake.Config{BlockLen: 8})
	p := n.AddPeer("a")
	require.Same(t, p, n.AddPeer("a"))
	require.ErrorIs(t, p.Put(transfer.KeyFromUint64(1, 0), make([]byte, 7)), transfer.ErrInvalid)
	require.ErrorIs(t, p.Put(transfer.Key{0, 0, 0, 0}, make([]byte, 8)), transfer.ErrInvalid)
	require.NoError(t, p.Put(transfer.KeyFromUint64(1, 0), make([]byte, 8)))
	require.Equal(t, 1, p.Len())
	require.True(t, p.Holds(transfer.KeyFromUint64(1, 0)))
	require.Equal(t, "a", p.Name())
}

func TestNilDestinationCountsBytesWithoutCopying(t *testing.T) {
	n := fake.New(fake.Config{BlockLen: 8})
	p := n.AddPeer("a")
	ks := keys(2, 0)
	p.Hold(ks...)
	s, err := n.Client(nil).Connect(context.Background(), "a")
	require.NoError(t, err)
	_, err = s.Lookup(context.Background(), ks)
	require.NoError(t, err)
	st, err := s.Fetch(context.Background(), ks, []int{1 << 20, 7})
	require.NoError(t, err)
	require.Equal(t, int64(16), st.Bytes)
}

func TestStatsCountEveryOutcome(t *testing.T) {
	n, p, _, s := setup(t, fake.Config{}, 4)
	ks := keys(3, 0)
	p.Hold(ks[:2]...)
	ctx := context.Background()
	_, err := s.Lookup(ctx, ks)
	require.NoError(t, err)
	_, err = s.Fetch(ctx, ks[:2], seq(2))
	require.NoError(t, err)
	_, err = s.Fetch(ctx, ks[:1], seq(1))
	require.Error(t, err)
	_, err = s.Fetch(ctx, nil, nil)
	require.NoError(t, err)
	_, err = s.Fetch(ctx, ks, seq(1))
	require.Error(t, err)
	require.Equal(t, fake.Stats{
		Connects: 1, Lookups: 1, LookupKeys: 3, LookupHits: 2,
		Fetches: 1, Blocks: 2, Bytes: 2 * blockLen, FetchErrors: 1, EmptyFetches: 1, InvalidRequest: 1,
	}, n.Stats())
}

func TestConcurrentSessionsAgreeWithASerialModel(t *testing.T) {
	n := fake.New(fake.Config{BlockLen: 16})
	const peers, perPeer = 4, 32
	for i := range peers {
		p := n.AddPeer(fmt.Sprint("pod-", i))
		p.Hold(keys(perPeer, uint64(i*1000))...)
	}
	var wg sync.WaitGroup
	errs := make(chan error, peers*4)
	for w := range peers * 4 {
		wg.Go(func() {
			peer := w % peers
			dst := make([]byte, perPeer*16)
			s, err := n.Client(dst).Connect(context.Background(), fmt.Sprint("pod-", peer))
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			ks := keys(perPeer, uint64(peer*1000))
			if _, err := s.Lookup(context.Background(), ks); err != nil {
				errs <- err
				return
			}
			if _, err := s.Fetch(context.Background(), ks, seq(perPeer)); err != nil {
				errs <- err
				return
			}
			for i, k := range ks {
				if !bytes.Equal(dst[i*16:(i+1)*16], fake.Content(k, 16)) {
					errs <- errors.New("content mismatch")
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, uint64(peers*4*perPeer), n.Stats().Blocks)
}

// waitingContext closes waiting when a call first asks for its Done
// channel: the call has begun to wait on it.
type waitingContext struct {
	context.Context
	once    sync.Once
	waiting chan struct{}
}

func (c *waitingContext) Done() <-chan struct{} {
	c.once.Do(func() { close(c.waiting) })
	return c.Context.Done()
}

func TestCloseWakesACallWaitingOnAStalledPeer(t *testing.T) {
	_, p, _, s := setup(t, fake.Config{}, 1)
	p.SetFaults(fake.Faults{Stall: true})
	done := make(chan error, 1)
	ctx := &waitingContext{Context: context.Background(), waiting: make(chan struct{})}
	go func() {
		_, err := s.Lookup(ctx, keys(1, 0))
		done <- err
	}()
	<-ctx.waiting // the stalled lookup waits on its context and on Close
	require.NoError(t, s.Close())
	select {
	case err := <-done:
		require.ErrorIs(t, err, transfer.ErrClosed)
	case <-time.After(5 * time.Second):
		t.Fatal("lookup still waiting after Close")
	}
}
