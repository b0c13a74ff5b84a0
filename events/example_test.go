package events_test

import (
	"context"
	"log"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// A router binds one socket the engines connect to, also connects to a pod
// its discovery found, and checks that the engines hash like it does.
func ExampleSubscriber() {
	ix := index.New(index.Config{})
	hasher, err := hashing.New(hashing.Config{Algo: hashing.SHA256, BlockSize: 16})
	if err != nil {
		log.Fatal(err)
	}
	sub, err := events.NewSubscriber(events.Config{
		Sink:        ix,
		Bind:        []string{"tcp://*:5557"},
		TopicPrefix: "kv@",
		Hasher:      hasher,
	})
	if err != nil {
		log.Fatal(err)
	}
	// Pod discovery: an engine with its PUB socket bound on 5557 and its
	// replay socket on 5558.
	if err := sub.AddPod("10.0.0.7:8000", "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558"); err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		if err := sub.Run(ctx); err != nil {
			log.Print(err)
		}
	}()
	for _, st := range sub.Status() {
		if st.HashMismatches > 0 || st.State != "live" {
			log.Printf("do not trust %s: %+v", st.Holder(), st)
		}
	}
}

// A test or demo engine: publish one step's events as vLLM would.
func ExamplePublisher() {
	pub, err := events.NewPublisher(events.PublisherConfig{
		Endpoint:       "tcp://127.0.0.1:5557", // connected: the router binds
		ReplayEndpoint: "tcp://*:5558",
		Topic:          "kv@10.0.0.7:8000@meta-llama/Llama-3.1-8B",
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
	if _, err := pub.Publish(&batch); err != nil {
		log.Fatal(err)
	}
}
