package events

import (
	"fmt"
	"log/slog"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

func TestValidPodNameAcceptsAddressesAndRefusesTheRest(t *testing.T) {
	for _, tc := range []struct {
		pod string
		ok  bool
	}{
		{"10.0.0.1:8000", true},
		{"[fd00::2]:8000", true},
		{"vllm-0.vllm.ns.svc.cluster.local:8000", true},
		{"pod", true},
		{"prefill_1:8000", true},
		{strings.Repeat("a", 63) + "." + strings.Repeat("b", 63) + ":1", true},
		{"", false},
		{"evil:80\r\nx-injected: 1", false},
		{"evil\n:80", false},
		{"a b:80", false},
		{"pod:0", false},
		{"pod:65536", false},
		{"pod:+80", false},
		{"pod:", false},
		{"fd00::2", false},
		{"[fd00::2]", false},
		{"[10.0.0.1]:80", false},
		{"[fd00::2:80", false},
		{"-pod:80", false},
		{"a..b:80", false},
		{"caf\xc3\xa9:80", false},
		{strings.Repeat("a", 64) + ":80", false},
		{strings.Repeat("a.", 127) + "a:80", false},
		// Other spellings of an IPv4 address, as inet_aton reads them.
		{"127.0.0.05:80", false},
		{"2130706437:80", false},
		{"0x7f.0.0.5:80", false},
		{"0X7F.0.0.5:80", false},
		{"0177.0.0.5:80", false},
		{"127.5:80", false},
		{"127.0.5:80", false},
		{"127.0.0.5.:80", false},
		{"127.0.0.5.", false},
		{"0x7f000005", false},
		{"2130706437", false},
		{"vllm.0x1f:80", false},
		{"vllm.8000:80", false},
		{"256.0.0.1:80", false},
		{"[fe80::1%lo]:80", false},
		{"[fe80::1%25lo]:80", false},
		{"[::ffff:127.0.0.5]:80", true},
		{"0x7f.svc:80", true},
		{"vllm-0.1a:80", true},
		{"127.0.0.5:80", true},
	} {
		err := ValidPodName(tc.pod)
		if tc.ok {
			require.NoError(t, err, "%q", tc.pod)
		} else {
			require.ErrorIs(t, err, ErrBadPodName, "%q", tc.pod)
		}
	}
}

// inetAton is a reference model of glibc's inet_aton: 1 to 4 parts, each
// decimal, octal (leading 0) or hex (0x), the last filling the bytes left.
func inetAton(s string) (netip.Addr, bool) {
	parts := strings.Split(s, ".")
	if len(parts) > 4 {
		return netip.Addr{}, false
	}
	var vals []uint64
	for _, p := range parts {
		base, digits := 10, p
		switch {
		case len(p) >= 2 && (p[:2] == "0x" || p[:2] == "0X"):
			base, digits = 16, p[2:]
			if digits == "" {
				digits = "0"
			}
		case len(p) > 1 && p[0] == '0':
			base, digits = 8, p[1:]
		}
		v, err := strconv.ParseUint(digits, base, 32)
		if p == "" || err != nil {
			return netip.Addr{}, false
		}
		vals = append(vals, v)
	}
	var ip uint64
	for i, v := range vals[:len(vals)-1] {
		if v > 0xff {
			return netip.Addr{}, false
		}
		ip |= v << (24 - 8*i)
	}
	last := vals[len(vals)-1]
	if last >= 1<<(8*(5-len(vals))) {
		return netip.Addr{}, false
	}
	ip |= last
	return netip.AddrFrom4([4]byte{byte(ip >> 24), byte(ip >> 16), byte(ip >> 8), byte(ip)}), true
}

// FuzzValidPodName checks that a name the C resolver reads as an IPv4
// address is accepted only when PodAddr reads the same address from it,
// so that every address a pod is reachable at passes the sender check.
func FuzzValidPodName(f *testing.F) {
	for _, s := range []string{"127.0.0.1:80", "127.0.0.05:80", "2130706437", "0x7f.0.0.5:1", "[fe80::1%lo]:80",
		"[::1]:80", "vllm-0.svc:8000", "127.1", "a.0x10:9"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, pod string) {
		if ValidPodName(pod) != nil {
			return
		}
		host := pod
		if i := strings.LastIndexByte(pod, ':'); i >= 0 && !strings.HasPrefix(pod, "[") {
			host = pod[:i]
		}
		got, named := PodAddr(pod)
		if want, isAddr := inetAton(host); isAddr {
			require.True(t, named, "%q reads as %v but PodAddr takes it for a DNS name", pod, want)
			require.Equal(t, want, got, "%q", pod)
		}
		if strings.HasPrefix(pod, "[") {
			require.True(t, named, "%q", pod)
		}
	})
}

func TestPodAddrNamesOnlyIPLiterals(t *testing.T) {
	a, ok := PodAddr("10.0.0.1:8000")
	require.True(t, ok)
	require.Equal(t, "10.0.0.1", a.String())
	a, ok = PodAddr("[fd00::2]:8000")
	require.True(t, ok)
	require.Equal(t, "fd00::2", a.String())
	_, ok = PodAddr("vllm-0.svc:8000")
	require.False(t, ok)
}

func TestBadPodNamesAreDroppedAndCountedBeforeTheIndex(t *testing.T) {
	sink := eventstest.NewRecSink()
	var logs testenv.SyncBuffer
	p := startProcessor(t, Config{Sink: sink, Logger: testenv.TextLogger(&logs)})
	for i := range 100 {
		p.Handle(t.Context(), Message{Pod: "evil:80\r\nx: " + strings.Repeat("y", i), Model: "m", Payload: storedPayload(t, 1)})
	}
	require.NoError(t, p.Sync(t.Context()))
	require.Equal(t, uint64(100), p.Stats().BadTopic)
	require.Empty(t, p.Status())
	require.Zero(t, sink.Stores())
	require.Equal(t, 1, strings.Count(logs.String(), "invalid pod name"), "rate-limited across names")
	require.NotContains(t, logs.String(), "\r")
}

// TestTwoInterleavedStreamsPutTheHolderInConflictInsteadOfFlapping feeds
// one holder two engines' numbers in turn, and then one engine's alone.
func TestTwoInterleavedStreamsPutTheHolderInConflictInsteadOfFlapping(t *testing.T) {
	sink := eventstest.NewRecSink()
	var logs testenv.SyncBuffer
	const window = 300 * time.Millisecond
	p := startProcessor(t, Config{Sink: sink, ConflictWindow: window, Logger: testenv.TextLogger(&logs)})
	h := index.Holder{Pod: "a:1"}
	for i := range uint64(2000) {
		p.Handle(t.Context(), Message{Pod: "a:1", Model: "m", Seq: 1000 + i, Payload: storedPayload(t, 1000+i)})
		p.Handle(t.Context(), Message{Pod: "a:1", Model: "m", Seq: i, Payload: storedPayload(t, i)})
	}
	require.NoError(t, p.Sync(t.Context()))
	st := statusOf(p, h)
	require.Equal(t, StateConflict, st.State)
	require.Equal(t, uint64(1), st.Conflicts)
	require.LessOrEqual(t, st.Restarts, uint64(2), "cleared once, not on every message")
	require.Greater(t, p.Stats().ConflictDropped, uint64(3900))
	require.Empty(t, sink.Keys("m", h, "GPU"))
	state, ok := p.Source(h)
	require.False(t, ok)
	require.Equal(t, StateConflict, state)
	require.Less(t, strings.Count(logs.String(), "level=WARN")+strings.Count(logs.String(), "level=ERROR"), 10)

	// One stream alone for a window: the holder starts again from it.
	next := uint64(5000)
	require.Eventually(t, func() bool {
		p.Handle(t.Context(), Message{Pod: "a:1", Model: "m", Seq: next, Payload: storedPayload(t, next)})
		next++
		require.NoError(t, p.Sync(t.Context()))
		return statusOf(p, h).State == StateLive
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, []uint64{next - 1}, sink.Keys("m", h, "GPU"))
}

func TestSourceIsOnlyALiveHolderHeardFromSinceStart(t *testing.T) {
	ix := index.New(index.Config{})
	snap := index.Holder{Pod: "snap:1"}
	ix.Store(index.Blocks{Model: "m", Holder: snap, Tier: "GPU", Keys: []uint64{1}})
	p := startProcessor(t, Config{Sink: ix, InitialSeqs: map[index.Holder]uint64{snap: 7}})
	live := index.Holder{Pod: "live:1"}
	p.Handle(t.Context(), Message{Pod: "live:1", Model: "m", Payload: storedPayload(t, 2)})
	require.NoError(t, p.Sync(t.Context()))

	state, ok := p.Source(snap)
	require.False(t, ok, "a snapshot alone scores but never serves")
	require.Equal(t, StateStale, state)
	state, ok = p.Source(live)
	require.True(t, ok)
	require.Equal(t, StateLive, state)

	p.PodConnected("live:1", false)
	state, ok = p.Source(live)
	require.False(t, ok)
	require.Equal(t, StateDisconnected, state)
	require.Equal(t, StateDisconnected, statusOf(p, live).State)
	require.Equal(t, uint64(1), p.Stats().Disconnects)
	p.PodConnected("live:1", false)
	require.Equal(t, uint64(1), p.Stats().Disconnects, "counted once per transition")
	p.PodConnected("live:1", true)
	state, ok = p.Source(live)
	require.False(t, ok, "a reconnect alone does not say whether the engine restarted")
	require.Equal(t, StateReconnected, state)
	p.Handle(t.Context(), Message{Pod: "live:1", Model: "m", Seq: 1, Payload: storedPayload(t, 3)})
	require.NoError(t, p.Sync(t.Context()))
	_, ok = p.Source(live)
	require.True(t, ok)
}

func TestSnapshotHoldersNeverHeardFromExpire(t *testing.T) {
	ix := index.New(index.Config{})
	gone, back := index.Holder{Pod: "gone:1"}, index.Holder{Pod: "back:1"}
	for _, h := range []index.Holder{gone, back} {
		ix.Store(index.Blocks{Model: "m", Holder: h, Tier: "GPU", Keys: []uint64{1}})
	}
	p := startProcessor(t, Config{Sink: ix, SnapshotExpiry: 100 * time.Millisecond,
		InitialSeqs: map[index.Holder]uint64{gone: 3, back: 5}})
	p.Handle(t.Context(), Message{Pod: "back:1", Model: "m", Seq: 6, Payload: storedPayload(t, 2)})
	require.NoError(t, p.WaitApplied(t.Context(), back, 6))
	require.Eventually(t, func() bool { return p.Stats().SnapshotExpired == 1 }, 10*time.Second, 5*time.Millisecond)
	require.Empty(t, ix.HolderBlocks("m", gone))
	require.Equal(t, 2, ix.HolderBlocks("m", back)["GPU"])
	_, known := p.LastSeq(gone)
	require.False(t, known)

	// Heard from after the expiry, it joins as a new holder, not as a gap
	// after the snapshot's number.
	p.Handle(t.Context(), Message{Pod: "gone:1", Model: "m", Seq: 9, Payload: storedPayload(t, 4)})
	require.NoError(t, p.WaitApplied(t.Context(), gone, 9))
	require.Zero(t, statusOf(p, gone).Gaps)
}

func TestANewHolderAtTheBoundEvictsAStaleOneFirst(t *testing.T) {
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink, MaxHolders: 2, Gap: GapKeep})
	stale, live := index.Holder{Pod: "stale:1"}, index.Holder{Pod: "live:1"}
	p.Handle(t.Context(), Message{Pod: "live:1", Model: "m", Payload: storedPayload(t, 1)})
	p.Handle(t.Context(), Message{Pod: "stale:1", Model: "m", Payload: storedPayload(t, 2)})
	p.Handle(t.Context(), Message{Pod: "stale:1", Model: "m", Seq: 5, Payload: storedPayload(t, 3)}) // a gap: stale
	require.NoError(t, p.Sync(t.Context()))
	require.Equal(t, StateStale, statusOf(p, stale).State)
	p.Handle(t.Context(), Message{Pod: "new:1", Model: "m", Payload: storedPayload(t, 4)})
	require.NoError(t, p.Sync(t.Context()))
	require.Eventually(t, func() bool { return len(sink.Keys("m", stale, "GPU")) == 0 }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, []uint64{1}, sink.Keys("m", live, "GPU"))
	require.Equal(t, []uint64{4}, sink.Keys("m", index.Holder{Pod: "new:1"}, "GPU"))
	require.Equal(t, uint64(1), p.Stats().Evicted)
}

// A flood of made-up pods, each evicted in turn at the holder bound, does
// not use up the pod states: a real pod after it has a state of its own,
// not the shared overflow.
func TestEvictedPodsGiveBackTheirPodState(t *testing.T) {
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink, MaxHolders: 4})
	for i := range 40 {
		p.Handle(t.Context(), Message{Pod: fmt.Sprintf("10.9.0.%d:8000", i), Model: "m", Payload: storedPayload(t, uint64(i+1))})
		require.NoError(t, p.Sync(t.Context()))
	}
	require.GreaterOrEqual(t, p.Stats().Evicted, uint64(36))
	require.Eventually(t, func() bool { return p.pods.Len() <= 4 }, 10*time.Second, 5*time.Millisecond)
	p.Handle(t.Context(), Message{Pod: "10.0.0.1:8000", Model: "m", Payload: storedPayload(t, 99)})
	require.NoError(t, p.Sync(t.Context()))
	_, tracked := p.pods.Load("10.0.0.1:8000")
	require.True(t, tracked, "the real pod got the shared overflow state")
	require.Equal(t, []uint64{99}, sink.Keys("m", index.Holder{Pod: "10.0.0.1:8000"}, "GPU"))
}

func TestRefusalsKeptForWaitAppliedAreBoundedByPodCount(t *testing.T) {
	p, err := NewProcessor(Config{Sink: eventstest.NewRecSink(), Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	for i := range 3 * maxRefusedPods {
		p.SenderMismatch(fmt.Sprintf("10.0.%d.%d:8000", i/256, i%256), "127.0.0.1", uint64(i))
	}
	require.LessOrEqual(t, p.refused.Len(), maxRefusedPods)
	n := 0
	p.refused.Range(func(string, *atomic.Pointer[refusal]) bool { n++; return true })
	require.Equal(t, p.refused.Len(), n)
	require.Equal(t, uint64(3*maxRefusedPods), p.Stats().SenderMismatch)
}

func TestMessagesWithAnOverlongModelNameAreDroppedAndCounted(t *testing.T) {
	sink := eventstest.NewRecSink()
	p := startProcessor(t, Config{Sink: sink})
	b := batchOf(storedTokens(nil, seqTokens(0, 4), 1))
	for i := range 50 {
		model := fmt.Sprintf("%d-%s", i, strings.Repeat("m", 1<<20)) // 1 MiB names, each new
		p.Handle(t.Context(), Message{Pod: "127.0.0.1:8000", Model: model, Seq: uint64(i), Payload: AppendBatch(nil, &b, LayoutArray, 0)})
	}
	ok := strings.Repeat("m", MaxModelBytes)
	p.Handle(t.Context(), Message{Pod: "127.0.0.1:8000", Model: ok, Seq: 50, Payload: AppendBatch(nil, &b, LayoutArray, 0)})
	require.NoError(t, p.Sync(t.Context()))
	require.Equal(t, uint64(50), p.Stats().BadTopic)
	require.Len(t, p.Status(), 1, "no holder of a dropped model")
	require.Equal(t, []uint64{1}, sink.Keys(ok, index.Holder{Pod: "127.0.0.1:8000"}, "GPU"))
}
