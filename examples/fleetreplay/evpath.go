package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
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
	idx     *index.Index
	sub     *zmq.Subscriber
	pubs    []*zmq.Publisher
	pods    []*pod
	sent    []uint64 // per pod: batches published
	dirty   bool
	timeout time.Duration
	cancel  context.CancelFunc
	done    chan error
}

func (e *eventPath) open(ctx context.Context, f *fleet, opt sdkOptions) error {
	e.timeout = opt.syncTimeout
	e.idx = index.New(index.Config{})
	cfg := zmq.SubscriberConfig{
		Events: events.Config{Sink: e.idx, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		Bind:   []string{"tcp://127.0.0.1:0"},
	}
	if opt.hashCheck {
		cfg.Events.Hasher = f.rtr.h
	}
	if opt.logger != nil {
		cfg.Events.Logger = opt.logger
	}
	var err error
	if e.sub, err = zmq.NewSubscriber(cfg); err != nil {
		return err
	}
	rctx, cancel := context.WithCancel(ctx)
	e.cancel, e.done = cancel, make(chan error, 1)
	go func() { e.done <- e.sub.Run(rctx) }()
	select {
	case <-e.sub.Ready():
	case err := <-e.done:
		e.done <- err
		return fmt.Errorf("%w: the subscriber stopped: %v", errSync, err)
	}
	e.pods = f.pods
	for _, p := range f.pods {
		pub, err := zmq.NewPublisher(zmq.PublisherConfig{
			Connect: e.sub.Addrs()[0], ReplayEndpoint: "tcp://127.0.0.1:0",
			Topic:  fmt.Sprintf("kv@%s@%s", p.name, f.model),
			Layout: events.LayoutMap,
		})
		if err != nil {
			e.close()
			return err
		}
		e.pubs = append(e.pubs, pub)
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

func (e *eventPath) index() *index.Index { return e.idx }

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
	st := e.sub.Stats()
	return eventStats{
		Batches: st.Batches, Events: st.Events, Blocks: st.Blocks,
		Gaps: st.Gaps, Replayed: st.Replayed, Unrecovered: st.Unrecovered, DecodeErrors: st.DecodeErrors,
		QueueFull: st.QueueFull, HashChecks: st.HashChecks, HashMismatches: st.HashMismatches,
	}
}

// eventStats are the subscriber's counters for one arm.
type eventStats struct {
	Batches        uint64 `json:"batches"`
	Events         uint64 `json:"events"`
	Blocks         uint64 `json:"blocks"`
	Gaps           uint64 `json:"gaps"`
	Replayed       uint64 `json:"replayed"`
	Unrecovered    uint64 `json:"unrecovered"`
	DecodeErrors   uint64 `json:"decode_errors"`
	QueueFull      uint64 `json:"queue_full"`
	HashChecks     uint64 `json:"hash_checks"`
	HashMismatches uint64 `json:"hash_mismatches"`
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
