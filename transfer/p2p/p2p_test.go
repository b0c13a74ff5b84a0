//go:build cgo

package p2p

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
)

func TestGoClientAndProducerCompleteAPullOverLoopback(t *testing.T) {
	f := newFixture(t, fixtureOpts{stored: 6})
	ctx := context.Background()
	keys := []transfer.Key{testKey(0), testKey(1), testKey(99), testKey(2), testKey(5)}

	hits, err := f.session.Lookup(ctx, keys)
	require.NoError(t, err)
	require.Equal(t, []bool{true, true, false, true, true}, hits)
	require.Equal(t, 4, f.store.Pinned(), "every hit is pinned for the round")

	pull := []transfer.Key{keys[0], keys[1], keys[3], keys[4]}
	dst := []int{9, 0, 15, 3}
	st, err := f.session.Fetch(ctx, pull, dst)
	require.NoError(t, err)
	require.Equal(t, 4, st.Blocks)
	require.Equal(t, int64(4*testBlockLen), st.Bytes)
	require.Positive(t, st.Duration)
	for i, k := range pull {
		require.Equal(t, f.blocks[string(k)], f.block(dst[i]), "block %d", dst[i])
	}
	require.Equal(t, make([]byte, testBlockLen), f.block(1), "blocks not fetched stay untouched")
	require.Eventually(t, func() bool { return f.store.Pinned() == 0 }, waitLong, 5*time.Millisecond, "a finished round releases its pins")

	// The next round of the same session.
	hits, err = f.session.Lookup(ctx, keys[2:3])
	require.NoError(t, err)
	require.Equal(t, []bool{false}, hits)
	_, err = f.session.Fetch(ctx, nil, nil)
	require.NoError(t, err)

	ps := f.prod.Stats()
	require.Equal(t, uint64(1), ps.Sessions)
	require.Equal(t, uint64(2), ps.Lookups)
	require.Equal(t, uint64(4), ps.LookupHits)
	require.Equal(t, uint64(1), ps.Fetches)
	require.Equal(t, uint64(4), ps.Blocks)

	require.NoError(t, f.session.Close())
	require.Eventually(t, func() bool { return f.producerSessions() == 0 }, waitLong, 5*time.Millisecond,
		"disconnect ends the producer's session")
	_, err = f.session.Lookup(ctx, keys)
	require.ErrorIs(t, err, transfer.ErrClosed)
}

func TestProbeAndMeasurePullAgainstAGoProducer(t *testing.T) {
	f := newFixture(t, fixtureOpts{stored: 4})
	ctx := context.Background()
	keys := []transfer.Key{testKey(0), testKey(1), testKey(2), testKey(3), testKey(50)}
	r, err := transfer.Probe(ctx, f.session, keys)
	require.NoError(t, err)
	require.Equal(t, 4, r.Prefix)
	require.Eventually(t, func() bool { return f.store.Pinned() == 0 }, waitLong, 5*time.Millisecond,
		"the probe's empty fetch releases the pins")

	samples, err := transfer.MeasurePull(ctx, f.session, keys[:4], []int{0, 1, 2, 3}, transfer.PullPlan{})
	require.NoError(t, err)
	require.Len(t, samples, 3)
	require.Equal(t, []int{1, 2, 4}, []int{samples[0].Blocks, samples[1].Blocks, samples[2].Blocks})
	for i := range 4 {
		require.Equal(t, f.blocks[string(testKey(i))], f.block(i))
	}
}

func TestEmptyFetchReleasesPinsWithoutAReply(t *testing.T) {
	f := newFixture(t, fixtureOpts{stored: 3})
	ctx := context.Background()
	_, err := f.session.Lookup(ctx, []transfer.Key{testKey(0), testKey(1)})
	require.NoError(t, err)
	require.Equal(t, 2, f.store.Pinned())
	_, err = f.session.Fetch(ctx, nil, nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return f.store.Pinned() == 0 }, waitLong, 5*time.Millisecond)
	require.Zero(t, f.client.Stats().Stale, "no reply came")
	require.Equal(t, uint64(0), f.prod.Stats().FetchFailures)
}

func TestFetchOfAnUnpinnedKeyFailsTheRound(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		run  func(s transfer.Session) error
	}{
		{"never looked up", func(s transfer.Session) error {
			_, err := s.Fetch(ctx, []transfer.Key{testKey(0)}, []int{0})
			return err
		}},
		{"a miss", func(s transfer.Session) error {
			if _, err := s.Lookup(ctx, []transfer.Key{testKey(0), testKey(40)}); err != nil {
				return err
			}
			_, err := s.Fetch(ctx, []transfer.Key{testKey(0), testKey(40)}, []int{0, 1})
			return err
		}},
		{"a hit of an earlier round", func(s transfer.Session) error {
			if _, err := s.Lookup(ctx, []transfer.Key{testKey(0), testKey(1)}); err != nil {
				return err
			}
			if _, err := s.Fetch(ctx, []transfer.Key{testKey(0)}, []int{0}); err != nil {
				return err
			}
			_, err := s.Fetch(ctx, []transfer.Key{testKey(1)}, []int{1})
			return err
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, fixtureOpts{stored: 2})
			err := tt.run(f.session)
			require.ErrorIs(t, err, transfer.ErrMissingKeys)
			require.Equal(t, uint64(1), f.prod.Stats().FetchFailures, "the producer answered success=false")
			require.Eventually(t, func() bool { return f.store.Pinned() == 0 }, waitLong, 5*time.Millisecond)
			// The session survives a failed round.
			hits, err := f.session.Lookup(ctx, []transfer.Key{testKey(1)})
			require.NoError(t, err)
			require.Equal(t, []bool{true}, hits)
		})
	}
}

func TestExpiredPinsFailTheFetch(t *testing.T) {
	f := newFixture(t, fixtureOpts{stored: 1, producer: func(c *ProducerConfig) { c.PinTimeout = 30 * time.Millisecond }})
	ctx := context.Background()
	_, err := f.session.Lookup(ctx, []transfer.Key{testKey(0)})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return f.prod.Stats().PinsExpired == 1 }, waitLong, 5*time.Millisecond)
	require.Zero(t, f.store.Pinned())
	_, err = f.session.Fetch(ctx, []transfer.Key{testKey(0)}, []int{0})
	require.ErrorIs(t, err, transfer.ErrFetchFailed, "the client saw a hit; the producer no longer had it")
}

func TestMismatchedConnectFailsTheHandshake(t *testing.T) {
	tests := []struct {
		name     string
		producer func(*ProducerConfig)
		client   func(*ClientConfig)
		slow     bool // only the producer can tell: the client sees silence
	}{
		{"block length", nil, func(c *ClientConfig) { c.BlockLen = testBlockLen / 2 }, false},
		{"hash seed", func(c *ProducerConfig) { c.HashSeed = "0" }, nil, false},
		{"config fingerprint", func(c *ProducerConfig) { c.ConfigFingerprint = "aaaaaaaaaaaaaaaa" },
			func(c *ClientConfig) { c.ConfigFingerprint = "bbbbbbbbbbbbbbbb" }, false},
		{"agent metadata", nil, func(c *ClientConfig) { c.DataPlane = foreignPlane{NewInProcess()} }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			client := func(c *ClientConfig) {
				// A mismatch the client can tell fails on the producer's
				// connect, which must arrive although the producer rejected
				// the client: the timeout never ends it.
				c.HandshakeTimeout = time.Hour
				if tt.slow {
					c.HandshakeTimeout = fastTimeout
				}
				if tt.client != nil {
					tt.client(c)
				}
			}
			f := newFixture(t, fixtureOpts{producer: tt.producer, client: client, skipConnect: true})
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			start := time.Now()
			_, err := f.client.Connect(ctx, f.prod.ID())
			require.ErrorIs(t, err, transfer.ErrHandshake)
			require.NotErrorIs(t, err, context.DeadlineExceeded)
			if tt.slow {
				require.GreaterOrEqual(t, time.Since(start), fastTimeout, "rejection is silence until the timeout")
			} else {
				require.ErrorContains(t, err, "peer's connect rejected")
			}
			require.Eventually(t, func() bool { return f.prod.Stats().Rejected == 1 }, waitLong, 5*time.Millisecond)
			require.Zero(t, f.prod.Stats().Sessions)
		})
	}
}

// foreignPlane sends metadata no in-process agent recognises.
type foreignPlane struct{ *InProcess }

func (p foreignPlane) Register(mem []byte, bl int) ([]byte, error) {
	if _, err := p.InProcess.Register(mem, bl); err != nil {
		return nil, err
	}
	return []byte("nixl-agent-metadata"), nil
}

func TestFingerprintIsComparedOnlyWhenBothAreSet(t *testing.T) {
	f := newFixture(t, fixtureOpts{stored: 1, producer: func(c *ProducerConfig) { c.ConfigFingerprint = "0123456789abcdef" }})
	hits, err := f.session.Lookup(context.Background(), []transfer.Key{testKey(0)})
	require.NoError(t, err)
	require.Equal(t, []bool{true}, hits)
}

func TestConnectToNothingIsUnreachable(t *testing.T) {
	f := newFixture(t, fixtureOpts{skipConnect: true, client: func(c *ClientConfig) { c.HandshakeTimeout = fastTimeout }})
	addr := f.prod.ID()
	require.NoError(t, f.prod.Close())
	_, err := f.client.Connect(context.Background(), addr)
	require.ErrorIs(t, err, transfer.ErrUnreachable)
}

func TestOneSessionPerPeer(t *testing.T) {
	f := newFixture(t, fixtureOpts{})
	_, err := f.client.Connect(context.Background(), f.prod.ID())
	require.ErrorIs(t, err, transfer.ErrInvalid)
	_, err = f.client.Connect(context.Background(), "no-port")
	require.ErrorIs(t, err, transfer.ErrInvalid)
}

func TestAbortStopsAnInFlightFetch(t *testing.T) {
	plane := newGatedPlane()
	f := newFixture(t, fixtureOpts{stored: 2, producer: func(c *ProducerConfig) { c.DataPlane = plane }})
	ctx := context.Background()
	keys := []transfer.Key{testKey(0), testKey(1)}
	_, err := f.session.Lookup(ctx, keys)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() {
		_, err := f.session.Fetch(ctx, keys, []int{0, 1})
		done <- err
	}()
	plane.waitStarted(t)
	require.NoError(t, f.session.Abort(ctx))
	require.ErrorIs(t, receive(t, done), transfer.ErrAborted)
	require.Equal(t, make([]byte, 2*testBlockLen), f.dst[:2*testBlockLen], "the aborted write never happened")
	require.Equal(t, uint64(1), f.prod.Stats().Aborts)
	require.Eventually(t, func() bool { return f.store.Pinned() == 0 }, waitLong, 5*time.Millisecond)

	// The session goes on with the next round.
	close(plane.release)
	_, err = f.session.Lookup(ctx, keys)
	require.NoError(t, err)
	_, err = f.session.Fetch(ctx, keys, []int{0, 1})
	require.NoError(t, err)
	require.Equal(t, f.blocks[string(keys[1])], f.block(1))
}

func TestFetchAbortsWhenItsContextEnds(t *testing.T) {
	plane := newGatedPlane()
	f := newFixture(t, fixtureOpts{stored: 1, producer: func(c *ProducerConfig) { c.DataPlane = plane }})
	_, err := f.session.Lookup(context.Background(), []transfer.Key{testKey(0)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = f.session.Fetch(ctx, []transfer.Key{testKey(0)}, []int{0})
	require.ErrorIs(t, err, transfer.ErrAborted)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, uint64(1), f.prod.Stats().Aborts)
}

func TestAbortWithoutAFetchIsAcknowledged(t *testing.T) {
	f := newFixture(t, fixtureOpts{stored: 1})
	ctx := context.Background()
	_, err := f.session.Lookup(ctx, []transfer.Key{testKey(0)})
	require.NoError(t, err)
	require.NoError(t, f.session.Abort(ctx))
	require.Eventually(t, func() bool { return f.store.Pinned() == 0 }, waitLong, 5*time.Millisecond, "abort releases the round's pins")
}

func TestProducerClosingMidFetchLosesThePeer(t *testing.T) {
	plane := newGatedPlane()
	f := newFixture(t, fixtureOpts{stored: 1, producer: func(c *ProducerConfig) { c.DataPlane = plane }})
	ctx := context.Background()
	_, err := f.session.Lookup(ctx, []transfer.Key{testKey(0)})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := f.session.Fetch(ctx, []transfer.Key{testKey(0)}, []int{0})
		done <- err
	}()
	plane.waitStarted(t)
	require.NoError(t, f.prod.Close())
	select {
	case err := <-done:
		require.ErrorIs(t, err, transfer.ErrPeerLost)
	case <-time.After(5 * time.Second):
		t.Fatal("fetch did not notice the producer going away")
	}
	_, err = f.session.Lookup(ctx, []transfer.Key{testKey(0)})
	require.ErrorIs(t, err, transfer.ErrPeerLost)
}

func TestProducerCrashIsDetectedByTheMonitor(t *testing.T) {
	f := newFixture(t, fixtureOpts{stored: 1})
	// Close the sockets without a disconnect message, as a crash would.
	f.prod.mu.Lock()
	f.prod.closed = true
	f.prod.mu.Unlock()
	f.prod.ep.close()
	close(f.prod.stop)
	f.prod.wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.Eventually(t, func() bool {
		_, err := f.session.Lookup(ctx, []transfer.Key{testKey(0)})
		return errors.Is(err, transfer.ErrPeerLost)
	}, waitLong, 20*time.Millisecond)
}

func TestClientValidatesFetchArguments(t *testing.T) {
	f := newFixture(t, fixtureOpts{stored: 1, dstBlocks: 4})
	ctx := context.Background()
	tests := []struct {
		name string
		keys []transfer.Key
		idx  []int
	}{
		{"lengths differ", []transfer.Key{testKey(0)}, nil},
		{"index past the region", []transfer.Key{testKey(0)}, []int{4}},
		{"negative index", []transfer.Key{testKey(0)}, []int{-1}},
		{"malformed key", []transfer.Key{{1}}, []int{0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := f.session.Fetch(ctx, tt.keys, tt.idx)
			require.ErrorIs(t, err, transfer.ErrInvalid)
		})
	}
	_, err := f.session.Lookup(ctx, []transfer.Key{{1, 2, 3}})
	require.ErrorIs(t, err, transfer.ErrInvalid)
	require.Zero(t, f.prod.Stats().Lookups, "nothing invalid reached the wire")
}

// A client closing while a fetch completes may Sync and Close its data
// plane at once.
func TestInProcessSyncAndCloseMayRun(t *testing.T) {
	p := NewInProcess()
	_, err := p.Register(make([]byte, testBlockLen), testBlockLen)
	require.NoError(t, err)
	synced := make(chan struct{})
	go func() {
		p.Sync()
		close(synced)
	}()
	require.NoError(t, p.Close())
	receive(t, synced)
	p.Sync()
}

// A client that closes its session and connects again at once reuses its
// identity on both channels while the old connections may still be up: the
// new connect must replace the old session, never be dropped or taken for a
// duplicate.
func TestClientReconnectsToTheSameProducerAtOnce(t *testing.T) {
	const reconnects = 8
	f := newFixture(t, fixtureOpts{stored: 2, dstBlocks: 2 * (reconnects + 1)})
	ctx := context.Background()
	keys := []transfer.Key{testKey(0), testKey(1)}
	for i := range reconnects + 1 {
		hits, err := f.session.Lookup(ctx, keys)
		require.NoError(t, err, "session %d", i)
		require.Equal(t, []bool{true, true}, hits)
		_, err = f.session.Fetch(ctx, keys, []int{2 * i, 2*i + 1})
		require.NoError(t, err, "session %d", i)
		require.Equal(t, f.blocks[string(keys[1])], f.block(2*i+1))
		if i == reconnects {
			break
		}
		require.NoError(t, f.session.Close())
		f.session, err = f.client.Connect(ctx, f.prod.ID())
		require.NoError(t, err, "reconnect %d", i+1)
	}
	require.Equal(t, uint64(reconnects+1), f.prod.Stats().Sessions)
	require.Zero(t, f.prod.Stats().Malformed)
	require.Eventually(t, func() bool { return f.producerSessions() == 1 && f.store.Pinned() == 0 }, 2*time.Second, 5*time.Millisecond,
		"only the last session is left")
}
