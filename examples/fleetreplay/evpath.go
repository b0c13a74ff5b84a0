package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/index"
)

// errEvents reports events the index did not apply as published.
var errEvents = errors.New("events lost or mistrusted")

// eventPath carries the pods' cache changes to the router's index as a vLLM
// fleet does: each pod's zmq.Publisher connects to the router's
// zmq.Subscriber, bound on a free loopback port, with a replay socket of
// its own; the subscriber applies the events to an index.Index.
type eventPath struct {
	idx *index.Index
	// spec, when the arm indexes routed requests speculatively, holds
	// their entries in idx and is the subscriber's sink, so that the
	// pods' own evictions take them out.
	spec    *index.Speculative
	now     func() time.Time
	sub     *zmq.Subscriber
	pubs    []*zmq.Publisher
	pods    []*pod
	sent    []uint64 // per pod: batches published
	dirty   bool
	timeout time.Duration
	cancel  context.CancelFunc
	done    chan error
	cfg     zmq.SubscriberConfig
	replays []string // per pod: its replay endpoint
	// before sums the counters of subscribers a router restart replaced.
	before eventStats
	// restarts counts router restarts.
	restarts int
}

func (e *eventPath) open(ctx context.Context, f *fleet, opt sdkOptions) error {
	e.timeout = opt.syncTimeout
	if f.spec.speculative {
		e.now = f.clk.wall
	}
	e.setIndex(index.New(index.Config{}))
	cfg := zmq.SubscriberConfig{
		Events: events.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		Bind:   []string{"tcp://127.0.0.1:0"},
		// The simulated pods' addresses are names: every pod publishes
		// from loopback, which sender verification would refuse.
		NoSenderCheck: true,
	}
	if opt.hashCheck {
		cfg.Events.Hasher = f.rtr.h
	}
	if opt.logger != nil {
		cfg.Events.Logger = opt.logger
	}
	e.cfg = cfg
	if err := e.startSubscriber(ctx, nil); err != nil {
		return err
	}
	// A restarted router binds the port the first one got: the pods'
	// publishers reconnect to it on their own.
	e.cfg.Bind = e.sub.Addrs()
	e.pods = f.pods
	for _, p := range f.pods {
		pub, err := zmq.NewPublisher(zmq.PublisherConfig{
			Connect: e.sub.Addrs()[0], ReplayEndpoint: "tcp://127.0.0.1:0",
			Topic:  fmt.Sprintf("kv@%s@%s", p.name, f.model),
			Layout: events.LayoutMap, BufferSteps: f.spec.replaySteps,
		})
		if err != nil {
			e.close()
			return err
		}
		e.pubs = append(e.pubs, pub)
		e.replays = append(e.replays, pub.ReplayAddr())
		if err := e.sub.AddPod(p.name, "", pub.ReplayAddr()); err != nil {
			e.close()
			return err
		}
	}
	e.sent = make([]uint64, len(f.pods))
	// What a publisher sends before the subscription reaches it is lost
	// (and would be recovered by replay): wait for every subscription.
	wctx, wcancel := context.WithTimeout(ctx, e.timeout)
	defer wcancel()
	for i, pub := range e.pubs {
		if err := pub.WaitSubscribed(wctx); err != nil {
			return fmt.Errorf("%w: pod %s's events never reached the subscriber: %v", errSync, e.pods[i].name, err)
		}
	}
	return nil
}

// startSubscriber starts a subscriber on e.idx with the given sequence
// numbers (from a snapshot), registering the pods known so far, and waits
// until it is bound.
func (e *eventPath) startSubscriber(ctx context.Context, seqs map[index.Holder]uint64) error {
	cfg := e.cfg
	cfg.Events.Sink, cfg.Events.InitialSeqs = e.idx, seqs
	if e.spec != nil {
		cfg.Events.Sink = e.spec
	}
	var err error
	if e.sub, err = zmq.NewSubscriber(cfg); err != nil {
		return err
	}
	for i, p := range e.pods {
		if err := e.sub.AddPod(p.name, "", e.replays[i]); err != nil {
			return err
		}
	}
	rctx, cancel := context.WithCancel(ctx)
	e.cancel, e.done = cancel, make(chan error, 1)
	go func() { e.done <- e.sub.Run(rctx) }()
	select {
	case <-e.sub.Ready():
		return nil
	case err := <-e.done:
		e.done <- err
		return fmt.Errorf("%w: the subscriber stopped: %v", errSync, err)
	}
}

// snapshot saves the index with the subscriber's sequence numbers, as a
// router does periodically.
func (e *eventPath) snapshot(ctx context.Context, path string) error {
	if err := e.sync(ctx); err != nil {
		return err
	}
	seqs := make(map[index.Holder]uint64, len(e.pods))
	for _, p := range e.pods {
		if seq, ok := e.sub.LastSeq(p.holder()); ok {
			seqs[p.holder()] = seq
		}
	}
	return e.idx.SaveFile(path, seqs)
}

// pushOutReplay publishes n empty batches from every pod and waits until
// they are applied: afterwards the pods' replay buffers of n batches hold
// nothing a new subscriber could learn a cache from, whatever the timing of
// the restart that follows (a cold router's view of a long-running fleet,
// reproducibly).
func (e *eventPath) pushOutReplay(ctx context.Context, n int) error {
	var empty events.Batch
	for _, p := range e.pods {
		for range n {
			if err := e.publish(p, &empty); err != nil {
				return err
			}
		}
	}
	return e.sync(ctx)
}

// restartRouter replaces the subscriber and the index as a restarted router
// does: cold, with an empty index that learns from the events published
// from now on, or from a snapshot file, whose sequence numbers make the new
// subscriber fetch what the pods published since it was saved from their
// replay sockets. The pods' publishers reconnect on their own.
func (e *eventPath) restartRouter(ctx context.Context, snapshot string) error {
	st := e.stats()
	e.cancel()
	<-e.done
	e.cancel = nil
	e.before = st
	var seqs map[index.Holder]uint64
	if snapshot == "" {
		e.setIndex(index.New(index.Config{}))
	} else {
		ix, s, err := index.LoadFile(snapshot, index.Config{})
		if err != nil {
			return err
		}
		e.setIndex(ix)
		seqs = s
	}
	// libzmq closes the old socket in its own thread: the new one binds
	// the same port once it is free, and tries again if it lost the race.
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		e.waitPortFree(ctx)
		if err = e.startSubscriber(ctx, seqs); err != nil {
			continue
		}
		if err = e.handshake(ctx, 50*time.Millisecond); err == nil {
			e.restarts++
			return nil
		}
		e.cancel()
		<-e.done
		e.cancel = nil
	}
	return err
}

// waitPortFree waits (bounded) until the bind endpoint's port can be
// listened on.
func (e *eventPath) waitPortFree(ctx context.Context) {
	addr := strings.TrimPrefix(e.cfg.Bind[0], "tcp://")
	for range 200 {
		l, err := net.Listen("tcp", addr)
		if err == nil {
			l.Close()
			return
		}
		if ctx.Err() != nil {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// handshake publishes an empty batch from every pod whose events the new
// subscriber has not yet applied, until it has applied each pod's last. A
// publisher's subscription state says nothing here (the old subscriber's
// may still stand), and what is published before the new subscription
// arrives is lost and must be replayed.
//
// every spaces the empty batches to one pod: each one published before the
// pod reconnects is a batch the new subscriber must replay, and the pods'
// replay buffers are bounded.
func (e *eventPath) handshake(ctx context.Context, every time.Duration) error {
	deadline := time.Now().Add(e.timeout)
	var empty events.Batch
	for {
		waiting := 0
		for i, p := range e.pods {
			if seq, ok := e.sub.LastSeq(p.holder()); ok && seq+1 >= e.sent[i] {
				continue
			}
			waiting++
			if err := e.publish(p, &empty); err != nil {
				return err
			}
		}
		if waiting == 0 {
			return e.sync(ctx)
		}
		wctx, cancel := context.WithTimeout(ctx, every)
		for i, p := range e.pods {
			_ = e.sub.WaitApplied(wctx, p.holder(), e.sent[i]-1)
		}
		cancel()
		select {
		case err := <-e.done:
			e.done <- err
			return fmt.Errorf("%w: the subscriber stopped: %v", errSync, err)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %d pods' events never reached the subscriber", errSync, waiting)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

func (e *eventPath) index() *index.Index { return e.idx }

// setIndex makes ix the router's index, with speculative entries of its own
// when the arm records them (a restarted router's guesses are gone with
// its index).
func (e *eventPath) setIndex(ix *index.Index) {
	e.idx = ix
	if e.now != nil {
		// The default TTL and byte bound, as kvsource serve and llm-d
		// have them; the virtual clock, so that entries expire in
		// replayed time.
		e.spec = index.NewSpeculative(ix, index.SpeculativeConfig{Now: e.now})
	}
}

// expireGuesses drops the speculative entries past their TTL, which a
// router's Speculative.Run does on a ticker: the replay does it before each
// decision, in virtual time.
func (e *eventPath) expireGuesses() {
	if e.spec != nil {
		e.spec.Expire()
	}
}

// speculate records a routed request's blocks on its destination at once,
// as a router does right after the pick. It does nothing for an arm without
// speculative indexing.
func (e *eventPath) speculate(model string, h index.Holder, keys []uint64) {
	if e.spec != nil {
		e.spec.Record(model, h, keys)
	}
}

// speculativeStats returns the speculative entries' counters (zero without
// speculative indexing).
func (e *eventPath) speculativeStats() index.SpeculativeStats {
	if e.spec == nil {
		return index.SpeculativeStats{}
	}
	return e.spec.Stats()
}

func (e *eventPath) publish(p *pod, b *events.Batch) error {
	if _, err := e.pubs[p.idx].Publish(b); err != nil {
		return err
	}
	e.sent[p.idx]++
	e.dirty = true
	return nil
}

// sync waits until the subscriber has applied every pod's last published
// sequence number, so the next decision reads the index the events made.
func (e *eventPath) sync(ctx context.Context) error {
	if !e.dirty {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	for i, p := range e.pods {
		if e.sent[i] == 0 {
			continue
		}
		if err := e.sub.WaitApplied(wctx, p.holder(), e.sent[i]-1); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			applied, _ := e.sub.LastSeq(p.holder())
			return fmt.Errorf("%w: pod %s published %d batches, the last applied is %d after %v",
				errSync, p.name, e.sent[i], applied, e.timeout)
		}
	}
	e.dirty = false
	return nil
}

func (e *eventPath) close() {
	for _, p := range e.pubs {
		p.Close()
	}
	if e.cancel != nil {
		e.cancel()
		<-e.done
	}
}

// stats summarises what the subscriber applied and what went wrong.
func (e *eventPath) stats() eventStats {
	return e.before.add(eventStats{e.sub.Stats()})
}

// eventStats are the subscriber's counters for one arm.
type eventStats struct{ events.Stats }

func (s eventStats) add(t eventStats) eventStats {
	for _, c := range events.Counters {
		*c.Stat(&s.Stats) += *c.Stat(&t.Stats)
	}
	return s
}

// MarshalJSON renders every counter by its events.Counters name, in the
// table's order.
func (s eventStats) MarshalJSON() ([]byte, error) {
	b := []byte{'{'}
	for i, c := range events.Counters {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendQuote(b, c.Name)
		b = append(b, ':')
		b = strconv.AppendUint(b, *c.Stat(&s.Stats), 10)
	}
	return append(b, '}'), nil
}

// trusted reports whether the index saw every event as published.
func (s eventStats) trusted() error {
	switch {
	case s.HashMismatches > 0:
		return fmt.Errorf("%w: %d hash mismatches between engines and router", errEvents, s.HashMismatches)
	case s.Unrecovered > 0, s.DecodeErrors > 0, s.QueueFull > 0:
		return fmt.Errorf("%w: %d unrecovered gaps, %d decode errors, %d dropped for full queues", errEvents, s.Unrecovered, s.DecodeErrors, s.QueueFull)
	}
	return nil
}
