package natsfleet

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/index"
)

// fakeStatus is a relay's holder states the test changes.
type fakeStatus struct {
	mu sync.Mutex
	hs []events.HolderStatus
}

func (f *fakeStatus) set(hs ...events.HolderStatus) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hs = hs
}

func (f *fakeStatus) get() []events.HolderStatus {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]events.HolderStatus(nil), f.hs...)
}

func TestSourcesCarryTheLeadingRelaysHolderStatesToReplicas(t *testing.T) {
	env := startNATS(t)
	const interval = 100 * time.Millisecond
	_, js := env.connect(t)
	relay := startLeadingRelay(t, js)
	relaySide, err := NewSources(context.Background(), SourcesConfig{JetStream: js, Interval: interval, Relay: relay})
	require.NoError(t, err)
	_, js2 := env.connect(t)
	replicaSide, err := NewSources(context.Background(), SourcesConfig{JetStream: js2, Interval: interval})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { require.NoError(t, replicaSide.Watch(ctx)) })

	a, b, c := index.Holder{Pod: "10.0.0.1:8000"}, index.Holder{Pod: "10.0.0.2:8000", Rank: 1}, index.Holder{Pod: "10.0.0.3:8000"}
	st := &fakeStatus{}
	st.set(events.HolderStatus{Pod: a.Pod, State: events.StateLive}, events.HolderStatus{Pod: b.Pod, Rank: 1, State: events.StateDisconnected})
	var leader atomic.Bool
	var asked atomic.Int64
	leads := func() bool { asked.Add(1); return leader.Load() }
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relaySide.Publish(ctx, st.get, leads) }()
	t.Cleanup(func() { stop(); <-done })

	// A relay that does not lead writes nothing: no holder is a source.
	require.Eventually(t, func() bool { return asked.Load() >= 3 }, waitLong, time.Millisecond)
	require.Zero(t, relaySide.Stats().Written)
	state, ok := replicaSide.Source(a)
	require.False(t, ok)
	require.Equal(t, events.StateStale, state)

	leader.Store(true)
	require.Eventually(t, func() bool { _, ok := replicaSide.Source(a); return ok }, waitLong, 5*time.Millisecond)
	state, ok = replicaSide.Source(b)
	require.False(t, ok)
	require.Equal(t, events.StateDisconnected, state)
	state, ok = replicaSide.Source(c)
	require.False(t, ok, "a holder the table does not list")
	require.Equal(t, events.StateStale, state)

	// The engine of a is killed: the replica knows within an interval or two.
	st.set(events.HolderStatus{Pod: a.Pod, State: events.StateDisconnected}, events.HolderStatus{Pod: b.Pod, Rank: 1, State: events.StateLive})
	require.Eventually(t, func() bool {
		sa, okA := replicaSide.Source(a)
		_, okB := replicaSide.Source(b)
		return !okA && sa == events.StateDisconnected && okB
	}, waitLong, 5*time.Millisecond)

	// The relay dies: after the bucket's TTL no holder is a source.
	stop()
	require.NoError(t, <-done)
	done <- nil
	died := time.Now()
	require.Eventually(t, func() bool { _, ok := replicaSide.Source(b); return !ok }, waitLong, 5*time.Millisecond)
	require.GreaterOrEqual(t, time.Since(died), interval, "the table lasts its TTL")
	require.Equal(t, -1, replicaSide.Stats().Holders)
}

// A client with publish rights on the sources bucket (and none on the
// lease) writes a table calling its own pod live: replicas drop it, as
// they drop one from a relay that lost the lease, and take the lease
// holder's.
func TestReplicasTakeSourcesTablesOnlyFromTheRelayLeasesHolder(t *testing.T) {
	env := startNATS(t)
	const interval = 100 * time.Millisecond
	_, js := env.connect(t)
	relay := startLeadingRelay(t, js)
	_, js2 := env.connect(t)
	replicaSide, err := NewSources(context.Background(), SourcesConfig{JetStream: js2, Interval: interval, TTL: time.Minute})
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { require.NoError(t, replicaSide.Watch(ctx)) })

	_, injector := env.connect(t)
	kv, err := injector.KeyValue(context.Background(), natsstream.DefaultStream+"_SOURCES")
	require.NoError(t, err)
	injected := index.Holder{Pod: "10.6.6.6:8000"}
	for _, table := range []string{
		"live 0 10.6.6.6:8000\n",                       // as tables were
		"owner someone-else/1\nlive 0 10.6.6.6:8000\n", // another owner
	} {
		before := replicaSide.Stats()
		_, err = kv.Put(context.Background(), sourcesKey, []byte(table))
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			st := replicaSide.Stats()
			return st.NotHolder+st.Malformed > before.NotHolder+before.Malformed
		}, waitLong, 5*time.Millisecond)
		_, ok := replicaSide.Source(injected)
		require.False(t, ok, "the injected pod is a source: %q", table)
	}
	require.Equal(t, uint64(1), replicaSide.Stats().NotHolder)
	require.Equal(t, uint64(1), replicaSide.Stats().Malformed)

	// The holder's table is taken. (Without SourcesConfig.Relay, as
	// kvsource serve runs it, the table names the lease bucket's holder.)
	relaySide, err := NewSources(context.Background(), SourcesConfig{JetStream: js, Interval: interval})
	require.NoError(t, err)
	st := &fakeStatus{}
	st.set(events.HolderStatus{Pod: "10.0.0.1:8000", State: events.StateLive})
	runUntilCleanup(t, func(ctx context.Context) { require.NoError(t, relaySide.Publish(ctx, st.get, relay.Leader)) })
	require.Eventually(t, func() bool { _, ok := replicaSide.Source(index.Holder{Pod: "10.0.0.1:8000"}); return ok }, waitLong, 5*time.Millisecond)
	_, ok := replicaSide.Source(injected)
	require.False(t, ok)
}

func TestSourcesTableRoundTripsAndRefusesMalformedLines(t *testing.T) {
	hs := []events.HolderStatus{{Pod: "10.0.0.1:8000", State: events.StateLive}, {Pod: "[fd00::1]:8000", Rank: 3, State: events.StateConflict},
		{Pod: "vllm-0.vllm.svc:8000", State: events.StateStale}}
	owner, got, err := parseSourcesTable(appendSourcesTable(nil, "relay-a/0123abcd", hs))
	require.NoError(t, err)
	require.Equal(t, "relay-a/0123abcd", owner)
	require.Equal(t, map[index.Holder]string{{Pod: "10.0.0.1:8000"}: "live", {Pod: "[fd00::1]:8000", Rank: 3}: "conflict",
		{Pod: "vllm-0.vllm.svc:8000"}: "stale"}, got)
	for _, bad := range []string{"live 0 10.0.0.1:8000", "owner \nlive 0 10.0.0.1:8000"} {
		_, _, err := parseSourcesTable([]byte(bad + "\n"))
		require.ErrorIs(t, err, errSourcesTable, "no owner: %q", bad)
	}
	for _, bad := range []string{"live", "live 0", "live x 10.0.0.1:8000", "live -1 10.0.0.1:8000", "live 0 bad\tname:1", "live 0 10.0.0.1:8000 extra"} {
		_, _, err := parseSourcesTable([]byte("owner r\n" + bad + "\n"))
		require.ErrorIs(t, err, errSourcesTable, bad)
	}
}

func FuzzParseSourcesTable(f *testing.F) {
	f.Add([]byte("owner r/1\nlive 0 10.0.0.1:8000\nstale 2 vllm-0:8000\n"))
	f.Add([]byte("live 99999999999999999999 a:1\n"))
	f.Add([]byte("\n\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		owner, tbl, err := parseSourcesTable(b)
		if err != nil {
			return
		}
		var hs []events.HolderStatus
		for h, st := range tbl {
			hs = append(hs, events.HolderStatus{Pod: h.Pod, Rank: h.Rank, State: st})
		}
		owner2, again, err := parseSourcesTable(appendSourcesTable(nil, owner, hs))
		require.NoError(t, err)
		require.Equal(t, tbl, again)
		require.Equal(t, owner, owner2)
	})
}

func TestSourcesTableIsWrittenAtOnceWhenTheLeaseIsTaken(t *testing.T) {
	env := startNATS(t)
	// An interval far longer than the test waits: only the write on
	// taking the lease can come in time.
	const interval = time.Minute
	_, js := env.connect(t)
	relaySide, err := NewSources(context.Background(), SourcesConfig{JetStream: js, Interval: interval, Relay: startLeadingRelay(t, js)})
	require.NoError(t, err)
	var leader atomic.Bool
	var asked atomic.Int64
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- relaySide.Publish(ctx, (&fakeStatus{}).get, func() bool { asked.Add(1); return leader.Load() })
	}()
	t.Cleanup(func() { stop(); <-done })
	require.Eventually(t, func() bool { return asked.Load() >= 1 }, waitLong, time.Millisecond)
	leader.Store(true)
	require.Eventually(t, func() bool { return relaySide.Stats().Written == 1 }, waitLong, 5*time.Millisecond)
	// Losing the lease and taking it again writes again at once.
	leader.Store(false)
	seen := asked.Load()
	require.Eventually(t, func() bool { return asked.Load() > seen }, waitLong, time.Millisecond)
	leader.Store(true)
	require.Eventually(t, func() bool { return relaySide.Stats().Written == 2 }, waitLong, 5*time.Millisecond)
}
