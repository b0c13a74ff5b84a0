// Command replicas shows router replicas sharing one event stream on NATS
// JetStream, all in one process on loopback: an embedded NATS server with
// JetStream, three simulated vLLM engines publishing KV events over ZMQ, a
// relay appending them to the stream, and three replicas each consuming it
// into its own index. One replica is killed and restarted, a fourth starts
// after the stream was purged behind a shared snapshot, and every replica
// answers the same probes with the same holders and prefixes.
//
//	go run ./examples/replicas
//
// The deployment it models, and how to run it against a real NATS server,
// is in README.md beside this file.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/natsstream"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/index"
)

const model = "meta-llama/Llama-3.1-8B"

func main() {
	if err := run(context.Background(), os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "replicas: %v\n", err)
		os.Exit(1)
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// engine is a simulated vLLM engine: it caches prefixes of a few shared
// prompts and publishes each step.
type engine struct {
	pod  string
	pub  *zmq.Publisher
	ep   string
	rng  *rand.Rand
	have [8]int
}

func key(p, i int) uint64 { return uint64(p+1)<<20 | uint64(i+1) }

func (e *engine) step() (uint64, error) {
	p := e.rng.IntN(len(e.have))
	ev := events.Event{Medium: "GPU", BlockSize: 16}
	if e.have[p] < 16 && e.rng.IntN(2) == 0 {
		ev.Type = events.EventBlockStored
		if e.have[p] > 0 {
			ev.Parent = events.Some(key(p, e.have[p]-1))
		}
		n := min(1+e.rng.IntN(4), 16-e.have[p])
		for i := range n {
			ev.BlockHashes = append(ev.BlockHashes, key(p, e.have[p]+i))
		}
		e.have[p] += n
	} else if e.have[p] > 0 {
		ev.Type = events.EventBlockRemoved
		ev.BlockHashes = append(ev.BlockHashes, key(p, e.have[p]-1))
		e.have[p]--
	}
	return e.pub.Publish(&events.Batch{TS: float64(time.Now().UnixNano()) / 1e9, DPRank: events.Some(0), Events: []events.Event{ev}})
}

// replica is one router replica: its connection, which a kill drops.
type replica struct {
	name   string
	nc     *nats.Conn
	r      *natsstream.Replica
	cancel context.CancelFunc
	done   chan struct{}
}

func startReplica(ctx context.Context, url, name string, snapshots bool, log *slog.Logger) (*replica, error) {
	nc, err := nats.Connect(url, nats.MaxReconnects(-1))
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	cfg := natsstream.ReplicaConfig{JetStream: js, Name: name, Logger: log}
	if snapshots {
		cfg.SnapshotInterval = 200 * time.Millisecond
	}
	r, err := natsstream.Open(ctx, cfg)
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	rep := &replica{name: name, nc: nc, r: r, cancel: cancel, done: make(chan struct{})}
	go func() { defer close(rep.done); _ = r.Run(rctx) }()
	return rep, r.WaitReady(ctx)
}

// kill drops the replica's connection without a goodbye, as kill -9 does.
func (r *replica) kill() {
	r.nc.Close()
	r.cancel()
	<-r.done
}

func run(ctx context.Context, out io.Writer) error {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	dir, err := os.MkdirTemp("", "kvsource-replicas-*")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		return err
	}
	srv.Start()
	defer srv.Shutdown()
	if !srv.ReadyForConnections(10 * time.Second) {
		return fmt.Errorf("nats server not ready")
	}
	url := srv.ClientURL()
	fmt.Fprintf(out, "NATS with JetStream at %s (storage %s)\n", url, dir)

	// The relay: engines' events in, the stream out.
	nc, err := nats.Connect(url, nats.MaxReconnects(-1))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	relay, err := natsstream.NewRelay(ctx, natsstream.RelayConfig{JetStream: js, Name: "relay", Logger: log})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go relay.Run(ctx)
	relayIndex := index.New(index.Config{})
	sub, err := zmq.NewSubscriber(zmq.SubscriberConfig{Events: events.Config{Sink: relayIndex, Tap: relay.Tap, Logger: log}})
	if err != nil {
		return err
	}
	var engines []*engine
	for i := range 3 {
		port, err := freePort()
		if err != nil {
			return err
		}
		e := &engine{pod: fmt.Sprintf("10.0.0.%d:8000", i+1), ep: fmt.Sprintf("tcp://127.0.0.1:%d", port), rng: rand.New(rand.NewPCG(uint64(i), 1))}
		if e.pub, err = zmq.NewPublisher(zmq.PublisherConfig{Bind: fmt.Sprintf("tcp://*:%d", port), Topic: "kv@" + e.pod + "@" + model}); err != nil {
			return err
		}
		defer e.pub.Close()
		if err := sub.AddPod(e.pod, e.ep, ""); err != nil {
			return err
		}
		engines = append(engines, e)
	}
	go sub.Run(ctx)
	for !relay.Stats().Leader {
		time.Sleep(10 * time.Millisecond)
	}
	// Let every engine's first message arrive before the steps that count
	// (no replay endpoints here, so nothing sent earlier could be fetched).
	for _, e := range engines {
		for {
			if _, err := e.pub.Publish(&events.Batch{DPRank: events.Some(0)}); err != nil {
				return err
			}
			if _, ok := sub.LastSeq(index.Holder{Pod: e.pod}); ok {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}

	s, err := js.Stream(ctx, natsstream.DefaultStream)
	if err != nil {
		return err
	}
	// steps runs n steps of every engine, then waits until the relay's
	// subscriber applied them and the stream holds them all.
	steps := func(n int) error {
		var last []uint64
		for _, e := range engines {
			var seq uint64
			for range n {
				if seq, err = e.step(); err != nil {
					return err
				}
			}
			last = append(last, seq)
		}
		wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
		defer wcancel()
		for i, e := range engines {
			subj := natsstream.Config{}.Subject(model, e.pod)
			for {
				m, err := s.GetLastMsgForSubject(wctx, subj)
				if err == nil && m.Header.Get(natsstream.HeaderSeq) == strconv.FormatUint(last[i], 10) {
					break
				}
				if wctx.Err() != nil {
					return fmt.Errorf("the stream never got %s's batch %d", e.pod, last[i])
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
		return nil
	}
	// waitSnapshot waits until r stored a snapshot of everything in the
	// stream; from the second on, each purges the stream behind the
	// previous one.
	waitSnapshot := func(r *replica) error {
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		for r.r.Status().SnapshotSeq < info.State.LastSeq {
			time.Sleep(10 * time.Millisecond)
		}
		return nil
	}
	var reps []*replica
	for i := range 3 {
		r, err := startReplica(ctx, url, fmt.Sprintf("replica-%d", i), i == 0, log)
		if err != nil {
			return err
		}
		reps = append(reps, r)
	}
	fmt.Fprintln(out, "three replicas consuming; engines publishing")
	if err := steps(200); err != nil {
		return err
	}
	if err := waitSnapshot(reps[0]); err != nil {
		return err
	}
	fmt.Fprintln(out, "replica-2 killed (connection dropped, no goodbye)")
	reps[2].kill()
	if err := steps(200); err != nil {
		return err
	}
	if reps[2], err = startReplica(ctx, url, "replica-2", false, log); err != nil {
		return err
	}
	st := reps[2].r.Status()
	fmt.Fprintf(out, "replica-2 restarted from the snapshot at stream seq %d, then the stream\n", st.SnapshotSeq)
	if err := steps(200); err != nil {
		return err
	}
	if err := waitSnapshot(reps[0]); err != nil {
		return err
	}
	// By now replica-0 has stored snapshots and purged the stream behind
	// them: a new replica cannot rebuild from the stream alone.
	late, err := startReplica(ctx, url, "replica-3", false, log)
	if err != nil {
		return err
	}
	reps = append(reps, late)
	info, err := s.Info(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "replica-3 warm-started from the snapshot at stream seq %d; the stream now starts at seq %d\n",
		late.r.Status().SnapshotSeq, info.State.FirstSeq)

	// Wait until the relay's subscriber and every replica applied it all.
	last := info.State.LastSeq
	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	for _, r := range reps {
		if err := r.r.WaitApplied(wctx, last); err != nil {
			return fmt.Errorf("%s: %w", r.name, err)
		}
	}

	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprint(tw, "prompt\trelay's own index")
	for _, r := range reps {
		fmt.Fprintf(tw, "\t%s", r.name)
	}
	fmt.Fprintln(tw)
	same := true
	var res index.Result
	describe := func(ix *index.Index, p int) string {
		keys := make([]uint64, 16)
		for i := range keys {
			keys[i] = key(p, i)
		}
		ix.Lookup(model, keys, &res)
		var parts []string
		for _, h := range res.Hits {
			parts = append(parts, fmt.Sprintf("%s:%d", strings.TrimSuffix(strings.TrimPrefix(h.Holder.Pod, "10.0.0."), ":8000"), h.Prefix))
		}
		slices.Sort(parts)
		return strings.Join(parts, " ")
	}
	for p := range 8 {
		want := describe(relayIndex, p)
		fmt.Fprintf(tw, "%d\t%s", p, want)
		for _, r := range reps {
			got := describe(r.r.Index(), p)
			same = same && got == want
			fmt.Fprintf(tw, "\t%s", got)
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	fmt.Fprintln(out, "(pod:prefix blocks held of each prompt's 16)")
	if !same {
		for _, r := range reps {
			fmt.Fprintf(out, "%s: %+v\n", r.name, r.r.Status())
		}
		return fmt.Errorf("replicas disagree")
	}
	fmt.Fprintln(out, "every replica answers as the relay's own index does")
	return nil
}
