package service

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	zmq4 "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// The attacks of issue 12, each against the built kvsource serve on
// loopback. Linux routes all of 127.0.0.0/8 to the loopback interface, so
// a publisher whose connection leaves from 127.0.0.2 is a second host on
// the network: the spoofer.

// attacker is an XPUB socket that sends whatever frames it is told,
// with any topic and sequence number, from source address src to the
// service's --events-bind port.
type attacker struct {
	t    *testing.T
	sock *zmq4.Socket
	buf  []byte
}

func newServeAttacker(t *testing.T, src string, port int) *attacker {
	t.Helper()
	sock, err := zmq4.NewSocket(zmq4.XPUB)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sock.Close() })
	require.NoError(t, sock.SetSndhwm(1_000_000))
	require.NoError(t, sock.SetLinger(0))
	require.NoError(t, sock.SetRcvtimeo(15*time.Second))
	require.NoError(t, sock.Connect(fmt.Sprintf("tcp://%s:0;127.0.0.1:%d", src, port)))
	// The service subscribes once the connection is up; until then a PUB
	// socket drops what it sends.
	sub, err := sock.RecvBytes(0)
	require.NoError(t, err, "the service never subscribed")
	require.Equal(t, byte(1), sub[0])
	return &attacker{t: t, sock: sock}
}

func (a *attacker) send(topic string, seq uint64, b *events.Batch) {
	a.t.Helper()
	a.buf = events.AppendBatch(a.buf[:0], b, events.LayoutMap, 0)
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], seq)
	_, err := a.sock.SendMessage(topic, sb[:], a.buf)
	require.NoError(a.t, err)
}

// metricAt is the value of the unlabelled metric name in the
// service's /metrics, 0 when absent.
func metricAt(t *testing.T, base, name string) uint64 {
	t.Helper()
	code, body := call(t, "GET", base+"/metrics", nil)
	require.Equal(t, http.StatusOK, code)
	v := metricValue(body, name)
	if v == "" {
		return 0
	}
	f, err := strconv.ParseFloat(v, 64)
	require.NoError(t, err)
	return uint64(f)
}

func waitMetric(t *testing.T, base, name string, atLeast uint64) {
	t.Helper()
	require.Eventually(t, func() bool { return metricAt(t, base, name) >= atLeast }, 15*time.Second, 10*time.Millisecond,
		"%s never reached %d", name, atLeast)
}

func pickOf(t *testing.T, base string, req map[string]any) (PickResponse, []byte) {
	t.Helper()
	code, body := call(t, "POST", base+"/v1/pick", req)
	require.Equal(t, http.StatusOK, code, "%s", body)
	var d PickResponse
	require.NoError(t, json.Unmarshal(body, &d))
	return d, body
}

func warnLines(b *binaryService) int { return strings.Count(b.stderr.String(), "level=WARN") }

func TestServeBinaryRefusesSpoofedEventsAndKeepsTheVictimIntact(t *testing.T) {
	bin := buildServeBinary(t)
	const victim, model = "127.0.0.1:8007", "m"
	eng := newServeBinaryEngine(t, victim, model, 3)
	// 127.0.0.2 plays a remote host: pods named by DNS names are allowed
	// from this host's own address only.
	srv := startServeBinary(t, bin, append(eng.args, "--events-allow", "127.0.0.1/32")...)
	tokens, keys := eng.tokens, eng.keys
	st := eng.storePrompt(srv.base)
	vh := index.Holder{Pod: victim}
	bindPort := eng.bind
	spoofer := newServeAttacker(t, "127.0.0.2", bindPort)
	all := &events.Batch{Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: keys, TokenIDs: tokens, BlockSize: 16, Medium: "CPU"}}}
	pickReq := map[string]any{"model": model, "tokens": tokens, "destination": "127.0.0.1:8008", "request_id": "r"}
	const mismatch, badTopic = "kvsource_events_sender_mismatch_total", "kvsource_events_bad_topic_total"
	intact := func(what string) {
		t.Helper()
		p := podsByHolder(t, srv.base)[vh]
		require.Equal(t, map[string]int{"GPU": 8, "CPU": 6}, p.Blocks, what)
		require.Equal(t, "live", p.State, what)
		require.Equal(t, st.LastSeq, p.LastSeq, what)
		require.Zero(t, p.Counters["restarts"], what)
		require.Zero(t, p.Counters["gaps"], what)
	}

	t.Run("a fake holder never becomes a source", func(t *testing.T) {
		// Every block of the prompt, offered in CPU (longer than the
		// victim's 6), by a DNS name and by an IP the spoofer does not have.
		before := metricAt(t, srv.base, mismatch)
		spoofer.send("kv@evil2.attacker.example:7777@"+model, 0, all)
		spoofer.send("kv@127.0.0.9:7777@"+model, 0, all)
		waitMetric(t, srv.base, mismatch, before+2)
		for range 20 {
			d, body := pickOf(t, srv.base, pickReq)
			require.Equal(t, "pull", string(d.Reason), "%s", body)
			require.Equal(t, victim, *d.Source)
			require.NotContains(t, string(body), "attacker")
			require.NotContains(t, string(body), "127.0.0.9")
		}
		require.Len(t, podsByHolder(t, srv.base), 1)
		intact("after the fake holders")
	})
	t.Run("an empty batch with seq 0 under the victim's name", func(t *testing.T) {
		before := metricAt(t, srv.base, mismatch)
		spoofer.send("kv@"+victim+"@"+model, 0, &events.Batch{TS: 1, DPRank: events.Some(0)})
		waitMetric(t, srv.base, mismatch, before+1)
		intact("after the spoofed restart")
	})
	t.Run("seq+1000 under the victim's name", func(t *testing.T) {
		before := metricAt(t, srv.base, mismatch)
		spoofer.send("kv@"+victim+"@"+model, st.LastSeq+1000, &events.Batch{Events: []events.Event{{Type: events.EventAllBlocksCleared}}})
		waitMetric(t, srv.base, mismatch, before+1)
		intact("after the spoofed jump")
	})
	t.Run("a pod name with CR LF", func(t *testing.T) {
		before := metricAt(t, srv.base, badTopic)
		spoofer.send("kv@127.0.0.2:80\r\nx-evil: 1@"+model, 0, all)
		waitMetric(t, srv.base, badTopic, before+1)
		require.Len(t, podsByHolder(t, srv.base), 1)
		d, body := pickOf(t, srv.base, pickReq)
		require.Equal(t, victim, *d.Source)
		require.NotContains(t, string(body), `\r`)
		require.NotContains(t, string(body), "x-evil")
		intact("after the bad name")
	})
	t.Run("6,000 made-up pod names do not lock a new pod out", func(t *testing.T) {
		before := metricAt(t, srv.base, mismatch)
		for i := range 6000 {
			spoofer.send(fmt.Sprintf("kv@127.0.0.2:%d@%s", 10000+i, model), 0, all)
		}
		// --events-max-pods-per-sender (64) of them are followed; the
		// rest are refused.
		waitMetric(t, srv.base, mismatch, before+6000-64)
		// The 64 followed are applied by the workers, maybe still now.
		require.Eventually(t, func() bool { return len(podsByHolder(t, srv.base)) == 1+64 }, 15*time.Second, 10*time.Millisecond)
		for h := range podsByHolder(t, srv.base) {
			require.True(t, h == vh || strings.HasPrefix(h.Pod, "127.0.0.2:"), h.Pod)
		}
		// On a host of its own: when its publisher closes at the end of
		// this step, the victim on 127.0.0.1 stays connected.
		newcomer := newServeBinaryPod(t, "127.0.0.4:8009", model, bindPort)
		newcomer.publishUntil(srv.base, all, func(p Pod) bool { return p.Blocks["CPU"] == 8 && p.State == "live" })
		intact("after the flood")
	})
	t.Run("20,000 alternating seq 0 and 1 write a bounded number of lines", func(t *testing.T) {
		// From another address: the spoofer's 64 names are taken.
		alternator := newServeAttacker(t, "127.0.0.3", bindPort)
		warns := warnLines(srv)
		name := "kv@127.0.0.3:9000@" + model
		one := &events.Batch{Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: keys[:1], TokenIDs: tokens[:16], BlockSize: 16, Medium: "GPU"}}}
		for i := range 20000 {
			alternator.send(name, uint64(i%2), one)
		}
		h := index.Holder{Pod: "127.0.0.3:9000"}
		waitMetric(t, srv.base, "kvsource_events_conflict_dropped_total", 19000)
		p := podsByHolder(t, srv.base)[h]
		require.Equal(t, "conflict", p.State)
		require.LessOrEqual(t, p.Counters["restarts"], uint64(10), "a holder in conflict stops counting restarts")
		lines := warnLines(srv) - warns
		t.Logf("%d WARN lines for 20,000 alternating messages", lines)
		require.LessOrEqual(t, lines, 10)
		intact("after the alternating stream")
	})
	srv.stop(t)
}

// newServeBinaryPod is an engine publishing under pod, an IP and port on
// 127.0.0.0/8, from that IP into the --events-bind port, without replay.
func newServeBinaryPod(t *testing.T, pod, model string, bindPort int) *binaryEngine {
	t.Helper()
	host, _, err := net.SplitHostPort(pod)
	require.NoError(t, err)
	pub, err := zmq.NewPublisher(zmq.PublisherConfig{Connect: fmt.Sprintf("tcp://%s:0;127.0.0.1:%d", host, bindPort), Topic: "kv@" + pod + "@" + model})
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })
	return &binaryEngine{t: t, pub: pub, pod: pod}
}

func TestServeBinaryEvictsTheLeastRecentlyHeardAtTheHolderBoundAndExpiresSnapshotHolders(t *testing.T) {
	bin := buildServeBinary(t)
	const model = "m"
	bindPort := testenv.FreePort(t)
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: make([]uint32, 4*16)})
	require.NoError(t, err)
	batch := &events.Batch{Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: keys, BlockSize: 16, Medium: "CPU"}}}
	snapshot := t.TempDir() + "/index.snap"
	args := []string{"--events-bind", fmt.Sprintf("tcp://127.0.0.1:%d", bindPort), "--events-max-holders", "16", "--snapshot", snapshot}

	srv := startServeBinary(t, bin, args...)
	srv.waitLog(t, "no snapshot yet")
	// Made-up names from four senders, 64 each: far past the bound.
	for _, src := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"} {
		a := newServeAttacker(t, src, bindPort)
		for i := range 64 {
			a.send(fmt.Sprintf("kv@%s:%d@%s", src, 10000+i, model), 0, batch)
		}
	}
	waitMetric(t, srv.base, "kvsource_events_holders_evicted_total", 256-16)
	require.LessOrEqual(t, len(podsByHolder(t, srv.base)), 16)
	real := newServeBinaryPod(t, "127.0.0.1:8007", model, bindPort)
	real.publishUntil(srv.base, batch, func(p Pod) bool { return p.Blocks["CPU"] == 4 && p.State == "live" })
	require.LessOrEqual(t, len(podsByHolder(t, srv.base)), 16)
	srv.stop(t)

	// After a restart the made-up holders are snapshot-only: stale, never
	// sources, and gone after --snapshot-expiry; the real pod that
	// publishes again is live.
	second := startServeBinary(t, bin, append(args, "--snapshot-expiry", "1s")...)
	second.waitLog(t, "snapshot loaded")
	real.publishUntil(second.base, batch, func(p Pod) bool { return p.State == "live" })
	require.Eventually(t, func() bool { return len(podsByHolder(t, second.base)) == 1 }, 15*time.Second, 20*time.Millisecond,
		"snapshot-only holders never expired")
	require.GreaterOrEqual(t, metricAt(t, second.base, "kvsource_events_snapshot_expired_total"), uint64(1))
	second.stop(t)
}

func TestServeBinaryPutsTwoEnginesUnderOneNameInConflict(t *testing.T) {
	bin := buildServeBinary(t)
	const pod, model = "127.0.0.1:8010", "m"
	bindPort := testenv.FreePort(t)
	tokens, keys := binaryPrompt(t, 11)
	srv := startServeBinary(t, bin, "--events-bind", fmt.Sprintf("tcp://127.0.0.1:%d", bindPort))
	first := newServeBinaryPod(t, pod, model, bindPort)
	stored := &events.Batch{Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: keys, TokenIDs: tokens, BlockSize: 16, Medium: "CPU"}}}
	first.publishUntil(srv.base, stored, func(p Pod) bool { return p.Blocks["CPU"] == 8 && p.State == "live" })
	hd := index.Holder{Pod: pod}
	d, body := pickOf(t, srv.base, map[string]any{"model": model, "tokens": tokens, "destination": "127.0.0.1:8008"})
	require.Equal(t, "pull", string(d.Reason), "%s", body)

	// A second engine starts under the same name: its sequence numbers
	// start again from 0 while the first's go on.
	second := newServeBinaryPod(t, pod, model, bindPort)
	require.NoError(t, second.pub.WaitSubscribed(t.Context()))
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		for _, e := range []*binaryEngine{first, second} {
			_, err := e.pub.Publish(stored)
			require.NoError(t, err)
		}
		time.Sleep(time.Millisecond)
	}
	require.Eventually(t, func() bool { return podsByHolder(t, srv.base)[hd].State == "conflict" }, 10*time.Second, 10*time.Millisecond)
	p := podsByHolder(t, srv.base)[hd]
	t.Logf("in conflict: restarts %d, gaps %d", p.Counters["restarts"], p.Counters["gaps"])
	require.LessOrEqual(t, p.Counters["restarts"], uint64(10), "no flapping")
	require.Positive(t, metricAt(t, srv.base, "kvsource_events_conflict_dropped_total"))
	require.Equal(t, uint64(1), metricAt(t, srv.base, "kvsource_events_conflicts_total"))
	d, body = pickOf(t, srv.base, map[string]any{"model": model, "tokens": tokens, "destination": "127.0.0.1:8008"})
	require.Equal(t, "no_holder", string(d.Reason), "a holder in conflict has its entries cleared: %s", body)
	srv.stop(t)
}

func TestServeBinaryDropsAStoppedOrKilledEngineFromThePullSources(t *testing.T) {
	testenv.Python(t)
	bin := buildServeBinary(t)
	const pod, model = "127.0.0.1:8011", "m"
	bindPort := testenv.FreePort(t)
	tokens, keys := binaryPrompt(t, 13)
	srv := startServeBinary(t, bin, "--events-bind", fmt.Sprintf("tcp://127.0.0.1:%d", bindPort))
	// vLLM's publisher model, its own process, connecting to the bind
	// socket; it stays up (--linger) until killed. Its first batches may
	// meet no subscription yet: it sends the same store a few times.
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	store := map[string]any{"events": []map[string]any{pyStoredEvent(keys, tokens, 0, 8, "CPU", "")}, "ts": 1.0}
	// After its first stores it is quiet for 14 s (stopped and resumed
	// meanwhile), then publishes once more.
	eng := pyPublisher{[]string{"--endpoint", fmt.Sprintf("tcp://127.0.0.1:%d", bindPort), "--topic", "kv@" + pod + "@" + model,
		"--warmup", "1", "--linger", "120"}, []map[string]any{store, store, store, {"sleep": 14}, store}}.start(t, ctx)
	started := time.Now()
	hd := index.Holder{Pod: pod}
	require.Eventually(t, func() bool {
		p, ok := podsByHolder(t, srv.base)[hd]
		return ok && p.Blocks["CPU"] == 8 && p.State == "live"
	}, 15*time.Second, 20*time.Millisecond)
	req := map[string]any{"model": model, "tokens": tokens, "destination": "127.0.0.1:8008"}
	d, body := pickOf(t, srv.base, req)
	require.Equal(t, "pull", string(d.Reason), "%s", body)
	// outOfSources waits, at most within, until picks skip the engine as
	// disconnected, and says how long that took.
	outOfSources := func(within time.Duration, what string) time.Duration {
		t.Helper()
		from := time.Now()
		require.Eventually(t, func() bool {
			d, _ := pickOf(t, srv.base, req)
			return d.Reason == "no_live_source" && d.SkippedState == "disconnected"
		}, within, 10*time.Millisecond, what)
		return time.Since(from).Round(time.Millisecond)
	}

	// Stopped (SIGSTOP), the engine's kernel still acknowledges TCP but
	// the engine answers no ZMTP heartbeat: the service closes the
	// connection after three 1 s heartbeats.
	require.NoError(t, eng.Process.Signal(syscall.SIGSTOP))
	t.Logf("a stopped engine was out of the pull sources %v after SIGSTOP", outOfSources(10*time.Second, "a silent engine still serves pulls"))
	// Resumed, it reconnects, but a reconnect cannot tell a blip from a
	// new process: it is no source until a message shows which (issue 22),
	// here its next store, which continues its sequence.
	require.NoError(t, eng.Process.Signal(syscall.SIGCONT))
	require.Eventually(t, func() bool { return podsByHolder(t, srv.base)[hd].State == "reconnected" }, 10*time.Second, 10*time.Millisecond)
	if time.Since(started) < 14*time.Second {
		d, body := pickOf(t, srv.base, req)
		require.NotEqual(t, "pull", string(d.Reason), "a reconnected engine served a pull before it published: %s", body)
	}
	require.Eventually(t, func() bool {
		d, _ := pickOf(t, srv.base, req)
		return d.Reason == "pull"
	}, 25*time.Second, 10*time.Millisecond, "a resumed engine never became a source again after it published")
	require.Zero(t, podsByHolder(t, srv.base)[hd].Counters["restarts"], "a continuing sequence is no restart")

	require.NoError(t, eng.Process.Kill())
	_ = eng.Wait()
	t.Logf("out of the pull sources %v after kill -9", outOfSources(5*time.Second, "a killed engine still serves pulls"))
	p := podsByHolder(t, srv.base)[hd]
	require.Equal(t, "disconnected", p.State)
	require.Equal(t, 8, p.Blocks["CPU"], "its entries stay, for scoring")
	srv.stop(t)
}
