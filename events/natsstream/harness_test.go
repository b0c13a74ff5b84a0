package natsstream

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// natsEnv is one in-process NATS server with JetStream, its storage in a
// test's temporary directory, restartable on the same port and storage.
type natsEnv struct {
	t    testing.TB
	dir  string
	port int
	srv  *server.Server
}

func startNATS(t testing.TB) *natsEnv {
	t.Helper()
	e := &natsEnv{t: t, dir: t.TempDir(), port: testenv.FreePort(t)}
	e.start()
	t.Cleanup(func() { e.srv.Shutdown(); e.srv.WaitForShutdown() })
	return e
}

func (e *natsEnv) start() {
	e.t.Helper()
	srv, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: e.port, JetStream: true, StoreDir: e.dir,
		NoLog: true, NoSigs: true,
	})
	require.NoError(e.t, err)
	srv.Start()
	require.True(e.t, srv.ReadyForConnections(10*time.Second), "nats server not ready")
	e.srv = srv
}

func (e *natsEnv) url() string { return fmt.Sprintf("nats://127.0.0.1:%d", e.port) }

// connect returns a JetStream client that reconnects for ever, closed when
// the test ends (or by the caller, to simulate a crash).
func (e *natsEnv) connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(e.url(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return nc, js
}

// engine models one vLLM engine: it stores and evicts prefixes of a set
// of prompts shared by the fleet (so lookups find several holders),
// publishing each step on a vLLM-compatible publisher.
type engine struct {
	pod, model string
	rng        *rand.Rand
	have       []int // blocks held of each prompt, a prefix
	pub        *zmq.Publisher
	pubEP      string
	replayEP   string
	drop       func(uint64) bool
}

const (
	prompts      = 24
	promptBlocks = 16
)

func promptKey(p, i int) uint64 { return uint64(p+1)<<20 | uint64(i+1) }

func promptKeys(p int) []uint64 {
	keys := make([]uint64, promptBlocks)
	for i := range keys {
		keys[i] = promptKey(p, i)
	}
	return keys
}

func newEngine(t *testing.T, pod, model string, seed uint64, replay bool, drop func(uint64) bool) *engine {
	e := &engine{pod: pod, model: model, rng: rand.New(rand.NewPCG(seed, 7)), have: make([]int, prompts), drop: drop,
		pubEP: fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))}
	if replay {
		e.replayEP = fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	}
	e.open(t)
	return e
}

func (e *engine) topic() string { return "kv@" + e.pod + "@" + e.model }

// open starts the engine's publisher, from sequence number 0: a new
// engine process.
func (e *engine) open(t *testing.T) {
	t.Helper()
	bind := strings.Replace(e.pubEP, "127.0.0.1", "*", 1)
	replay := ""
	if e.replayEP != "" {
		replay = e.replayEP
	}
	var p *zmq.Publisher
	// The previous process's sockets may hold the ports a moment longer.
	require.Eventually(t, func() bool {
		var err error
		p, err = zmq.NewPublisher(zmq.PublisherConfig{Bind: bind, ReplayEndpoint: replay, Topic: e.topic(), Drop: e.drop})
		return err == nil
	}, waitLong, 20*time.Millisecond)
	e.pub = p
	t.Cleanup(func() { p.Close() })
}

// restart is a new engine process: an empty cache, sequence numbers from 0.
func (e *engine) restart(t *testing.T) {
	e.pub.Close()
	clear(e.have)
	e.open(t)
}

func (e *engine) step() *events.Batch {
	b := &events.Batch{TS: float64(time.Now().UnixNano()) / 1e9, DPRank: events.Some(0)}
	for range 1 + e.rng.IntN(3) {
		p := e.rng.IntN(prompts)
		switch r := e.rng.IntN(20); {
		case r < 12 && e.have[p] < promptBlocks:
			n := min(1+e.rng.IntN(4), promptBlocks-e.have[p])
			ev := events.Event{Type: events.EventBlockStored, Medium: "GPU", BlockSize: 16}
			if e.have[p] > 0 {
				ev.Parent = events.Some(promptKey(p, e.have[p]-1))
			}
			for i := range n {
				ev.BlockHashes = append(ev.BlockHashes, promptKey(p, e.have[p]+i))
			}
			e.have[p] += n
			b.Events = append(b.Events, ev)
		case r < 19 && e.have[p] > 0:
			n := 1 + e.rng.IntN(e.have[p])
			ev := events.Event{Type: events.EventBlockRemoved, Medium: "GPU"}
			for i := e.have[p] - n; i < e.have[p]; i++ {
				ev.BlockHashes = append(ev.BlockHashes, promptKey(p, i))
			}
			e.have[p] -= n
			b.Events = append(b.Events, ev)
		case r == 19:
			b.Events = append(b.Events, events.Event{Type: events.EventAllBlocksCleared})
			clear(e.have)
		}
	}
	return b
}

// publish sends n steps, more while the last is one drop loses, and returns
// the last sequence number.
func (e *engine) publish(t *testing.T, n int) uint64 {
	t.Helper()
	var seq uint64
	for i := 0; i < n || e.drop != nil && e.drop(seq); i++ {
		// A lost last batch shows as a gap only when another follows,
		// as a real engine's next one does. Where the losses fall
		// depends on how many batches rejoin took: one run in 17 ended
		// on a loss no replay was asked for.
		var err error
		seq, err = e.pub.Publish(e.step())
		require.NoError(t, err)
	}
	return seq
}

// hello publishes empty batches until every subscriber knows the engine,
// so that the batches that matter are not lost to ZMQ's slow joiners
// (without a replay endpoint a late joiner would miss them for good).
func (e *engine) hello(t *testing.T, subs ...*zmq.Subscriber) {
	t.Helper()
	h := index.Holder{Pod: e.pod}
	require.Eventually(t, func() bool {
		_, err := e.pub.Publish(&events.Batch{DPRank: events.Some(0)})
		require.NoError(t, err)
		for _, s := range subs {
			if _, ok := s.LastSeq(h); !ok {
				return false
			}
		}
		return true
	}, waitLong, 20*time.Millisecond)
}

// rejoin, after restart, publishes empty batches until every subscriber
// saw the new process: a reconnecting subscriber misses what the new
// process sent first, and a real engine keeps publishing.
func (e *engine) rejoin(t *testing.T, subs ...*zmq.Subscriber) {
	t.Helper()
	restarts := func(s *zmq.Subscriber) uint64 {
		for _, st := range s.Status() {
			if st.Pod == e.pod {
				return st.Restarts
			}
		}
		return 0
	}
	before := make([]uint64, len(subs))
	for i, s := range subs {
		before[i] = restarts(s)
	}
	start := time.Now()
	require.Eventually(t, func() bool {
		_, err := e.pub.Publish(&events.Batch{DPRank: events.Some(0)})
		require.NoError(t, err)
		for i, s := range subs {
			if restarts(s) == before[i] {
				return false
			}
		}
		return true
	}, waitLong, 20*time.Millisecond)
	t.Logf("rejoined after %v", time.Since(start))
}

// newSub returns a connect-mode subscriber of engines into sink, running
// until the test ends.
func newSub(t *testing.T, sink events.Sink, tap func(events.TapBatch), engines ...*engine) *zmq.Subscriber {
	t.Helper()
	s, err := zmq.NewSubscriber(zmq.SubscriberConfig{Events: events.Config{Sink: sink, Tap: tap, Workers: 2}})
	require.NoError(t, err)
	for _, e := range engines {
		require.NoError(t, s.AddPod(e.pod, e.pubEP, e.replayEP))
	}
	runUntilCleanup(t, func(ctx context.Context) { _ = s.Run(ctx) })
	return s
}

// runUntilCleanup runs f on its own goroutine until the test ends.
func runUntilCleanup(t testing.TB, f func(ctx context.Context)) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

// waitSeq waits until s applied seq of h.
func waitSeq(t *testing.T, s *zmq.Subscriber, h index.Holder, seq uint64) {
	t.Helper()
	require.Eventually(t, func() bool {
		got, ok := s.LastSeq(h)
		return ok && got == seq
	}, 20*time.Second, 10*time.Millisecond, "holder %v never reached seq %d: %+v", h, seq, s.Status())
}

// view is what a router can learn from an index about the test's prompts:
// every holder's hits for each prompt of each model, and its block counts.
type view struct {
	Hits   map[string][]index.Hit
	Blocks map[string]map[string]int
}

func viewOf(ix *index.Index, models ...string) view {
	v := view{Hits: map[string][]index.Hit{}, Blocks: map[string]map[string]int{}}
	var res index.Result
	for _, m := range models {
		for p := range prompts {
			ix.Lookup(m, promptKeys(p), &res)
			hits := slices.Clone(res.Hits)
			for i := range hits {
				hits[i].Tiers = slices.Clone(hits[i].Tiers)
			}
			slices.SortFunc(hits, func(a, b index.Hit) int {
				return strings.Compare(a.Holder.Pod, b.Holder.Pod)*4 + a.Holder.Rank - b.Holder.Rank
			})
			if len(hits) > 0 {
				v.Hits[fmt.Sprintf("%s/%d", m, p)] = hits
			}
		}
	}
	for _, hm := range ix.HolderList() {
		if b := ix.HolderBlocks(hm.Model, hm.Holder); len(b) > 0 {
			v.Blocks[hm.Model+"|"+hm.Holder.Pod] = b
		}
	}
	return v
}

// openReplica opens and runs a replica until the test ends.
func openReplica(t *testing.T, js jetstream.JetStream, cfg ReplicaConfig) *Replica {
	t.Helper()
	cfg.JetStream = js
	cfg.TempDir = t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := Open(ctx, cfg)
	require.NoError(t, err)
	runUntilCleanup(t, func(ctx context.Context) { require.NoError(t, r.Run(ctx)) })
	return r
}

// streamLast returns the stream's last sequence number.
func streamLast(t *testing.T, js jetstream.JetStream) uint64 {
	t.Helper()
	s, err := js.Stream(context.Background(), DefaultStream)
	require.NoError(t, err)
	info, err := s.Info(context.Background())
	require.NoError(t, err)
	return info.State.LastSeq
}

// waitLong bounds the tests' waits for a condition: generous, since a test
// that passes returns as soon as its condition holds, and `make test` runs
// under -race on shared, loaded machines, where a replica's consumer took
// over 5 s to start.
const waitLong = 30 * time.Second

func waitApplied(t *testing.T, seq uint64, rs ...*Replica) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	defer cancel()
	for _, r := range rs {
		require.NoError(t, r.WaitApplied(ctx, seq), "replica %s at %d, want %d", r.cfg.Name, r.Status().AppliedSeq, seq)
	}
}

// waitStream waits until the stream's last batch of e is seq: the relay
// published everything up to it.
func waitStream(t *testing.T, js jetstream.JetStream, e *engine, seq uint64) {
	t.Helper()
	s, err := js.Stream(context.Background(), DefaultStream)
	require.NoError(t, err)
	subj := Config{}.Subject(e.model, e.pod)
	require.Eventually(t, func() bool {
		m, err := s.GetLastMsgForSubject(context.Background(), subj)
		return err == nil && m.Header.Get(HeaderSeq) == strconv.FormatUint(seq, 10)
	}, 20*time.Second, 10*time.Millisecond, "the stream never got %s seq %d", subj, seq)
}

// pyEngine runs ../shared/interop/vllm_publisher.py, the independent model
// of vLLM's publisher, with n steps of e's workload (e's own publisher
// stays unused) and a replay socket, dropping drop from the live stream.
// It returns the last sequence number and a wait for the script's exit.
func pyEngine(t *testing.T, e *engine, n int, drop ...uint64) (uint64, func()) {
	t.Helper()
	python := testenv.Python(t)
	var in bytes.Buffer
	for range n {
		b := e.step()
		evs := []map[string]any{}
		for _, ev := range b.Events {
			switch ev.Type {
			case events.EventBlockStored:
				var parent any
				if v, ok := ev.Parent.Get(); ok {
					parent = v
				}
				evs = append(evs, map[string]any{"type": "BlockStored", "block_hashes": ev.BlockHashes,
					"parent_block_hash": parent, "token_ids": []uint32{}, "block_size": ev.BlockSize, "medium": "GPU"})
			case events.EventBlockRemoved:
				evs = append(evs, map[string]any{"type": "BlockRemoved", "block_hashes": ev.BlockHashes, "medium": "GPU"})
			case events.EventAllBlocksCleared:
				evs = append(evs, map[string]any{"type": "AllBlocksCleared"})
			}
		}
		line, err := json.Marshal(map[string]any{"events": evs, "dp_rank": 0, "ts": b.TS})
		require.NoError(t, err)
		in.Write(append(line, '\n'))
	}
	args := []string{testenv.Data(t, "interop", "vllm_publisher.py"), "--endpoint", strings.Replace(e.pubEP, "127.0.0.1", "*", 1),
		"--topic", e.topic(), "--replay", strings.Replace(e.replayEP, "127.0.0.1", "*", 1), "--warmup", "0.5", "--linger", "3"}
	for _, d := range drop {
		args = append(args, "--drop-seq", strconv.FormatUint(d, 10))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	cmd := exec.CommandContext(ctx, python, args...)
	cmd.Stdin = &in
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	wait := func() {
		err := <-done
		cancel()
		require.NoError(t, err, "publisher output:\n%s", out.String())
	}
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
		}
	})
	return uint64(n - 1), wait
}
