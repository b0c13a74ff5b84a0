package service

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/index"
)

// feeder publishes blocks to an in-process service the way engines
// do, over its --events-bind socket, so that its holders are heard from
// and connected: pull sources. A holder stored straight into the index,
// or known only from a snapshot, scores but never serves a pull.
type feeder struct {
	t    testing.TB
	s    *Service
	pubs map[string]*zmq.Publisher
}

// newServeFeeder feeds s, which must have been started with an
// --events-bind on 127.0.0.1 (the feeder's pods are named 127.0.0.1:PORT
// so that they pass sender verification). Its publishers stay connected
// until the test ends.
func newServeFeeder(t testing.TB, s *Service) *feeder {
	t.Helper()
	select {
	case <-s.sub.Ready():
	case <-time.After(15 * time.Second):
		t.Fatal("the service's subscriber never bound its sockets")
	}
	require.NotEmpty(t, s.sub.Addrs(), "start the service with --events-bind tcp://127.0.0.1:0")
	return &feeder{t: t, s: s, pubs: map[string]*zmq.Publisher{}}
}

// store has pod publish that it holds keys in medium ("GPU", "CPU") for
// model, and waits until the service applied it.
func (f *feeder) store(pod, model, medium string, keys []uint64) {
	f.t.Helper()
	topic := "kv@" + pod + "@" + model
	pub := f.pubs[topic]
	if pub == nil {
		var err error
		pub, err = zmq.NewPublisher(zmq.PublisherConfig{Connect: f.s.sub.Addrs()[0], Topic: topic})
		require.NoError(f.t, err)
		f.t.Cleanup(func() { _ = pub.Close() })
		f.pubs[topic] = pub
	}
	batch := &events.Batch{Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: keys, BlockSize: 16, Medium: medium}}}
	h := index.Holder{Pod: pod}
	// A PUB socket drops what it sends before the subscription reaches
	// it: publish (stores are idempotent) until one is applied.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	// Each try waits twice as long as the last: a batch of a million
	// tokens can take longer than a try to apply under -race, and
	// publishing it again at a fixed pace only queues more of it.
	for try := 200 * time.Millisecond; ; try *= 2 {
		seq, err := pub.Publish(batch)
		require.NoError(f.t, err)
		wait, waitCancel := context.WithTimeout(ctx, try)
		err = f.s.sub.WaitApplied(wait, h, seq)
		waitCancel()
		if err == nil {
			break
		}
		require.NoError(f.t, ctx.Err(), "service never applied %s's batch %d", pod, seq)
	}
	require.Eventually(f.t, func() bool { _, ok := f.s.sub.Source(h); return ok }, 5*time.Second, 5*time.Millisecond,
		fmt.Sprintf("%s is no pull source after its batch", pod))
}
