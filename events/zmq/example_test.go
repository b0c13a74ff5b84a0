//go:build cgo

package zmq_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// A router binds one socket the engines connect to (port 0: any free port),
// checks that the engines hash like it does, and waits until an engine's
// batch is in the index.
func ExampleSubscriber() {
	ix := index.New(index.Config{})
	hasher, err := hashing.New(hashing.Config{Algo: hashing.SHA256, BlockSize: 16})
	if err != nil {
		log.Fatal(err)
	}
	sub, err := zmq.NewSubscriber(zmq.SubscriberConfig{
		Events:      events.Config{Sink: ix, Hasher: hasher},
		Bind:        []string{"tcp://127.0.0.1:0"},
		TopicPrefix: "kv@",
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- sub.Run(ctx) }()
	<-sub.Ready()

	// An engine configured to connect to the router.
	pub, err := zmq.NewPublisher(zmq.PublisherConfig{
		Connect: sub.Addrs()[0],
		Topic:   "kv@127.0.0.1:8000@llama",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	if err := pub.WaitSubscribed(ctx); err != nil {
		log.Fatal(err)
	}
	seq, err := pub.Publish(&events.Batch{Events: []events.Event{{
		Type: events.EventBlockStored, BlockHashes: []uint64{0x1234}, BlockSize: 16, Medium: "GPU",
	}}})
	if err != nil {
		log.Fatal(err)
	}
	if err := sub.WaitApplied(ctx, index.Holder{Pod: "127.0.0.1:8000"}, seq); err != nil {
		log.Fatal(err)
	}
	fmt.Println(ix.Holders("llama", 0x1234, nil))
	for _, st := range sub.Status() {
		fmt.Println(st.Holder(), st.State)
	}
	cancel()
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	// Output:
	// [127.0.0.1:8000]
	// 127.0.0.1:8000 live
}

// A test or demo engine binds its PUB socket (port 0: any free port) and a
// replay socket, and publishes one step's events as vLLM would.
func ExamplePublisher() {
	pub, err := zmq.NewPublisher(zmq.PublisherConfig{
		Bind:           "tcp://127.0.0.1:0",
		ReplayEndpoint: "tcp://127.0.0.1:0",
		Topic:          "kv@127.0.0.1:8000@meta-llama/Llama-3.1-8B",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	batch := events.Batch{TS: 1.5, Events: []events.Event{{
		Type:        events.EventBlockStored,
		BlockHashes: []uint64{0x1234, 0x5678},
		TokenIDs:    make([]uint32, 32),
		BlockSize:   16,
		Medium:      "GPU",
	}}}
	// Published before any subscriber: a subscriber that registers the
	// replay endpoint (AddPod) still fetches it.
	seq, err := pub.Publish(&batch)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("published seq", seq)
	// Output: published seq 0
}
