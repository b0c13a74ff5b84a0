package events_test

import (
	"context"
	"fmt"
	"log"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/index"
)

// A transport of its own (NATS, a file, a pure-Go ZMQ) hands each received
// message to a Processor, which decodes it and applies it to the index in
// sequence order; Sync waits until what was handed is applied.
func ExampleProcessor() {
	ix := index.New(index.Config{})
	proc, err := events.NewProcessor(events.Config{Sink: ix})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	if err := proc.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer proc.Close()

	batch := events.Batch{TS: 1.5, Events: []events.Event{{
		Type:        events.EventBlockStored,
		BlockHashes: []uint64{0x1234, 0x5678},
		BlockSize:   16,
		Medium:      "GPU",
	}}}
	payload := events.AppendBatch(nil, &batch, events.LayoutMap, 0)
	proc.Handle(ctx, events.Message{Pod: "10.0.0.7:8000", Model: "llama", Seq: 0, Payload: payload})
	if err := proc.Sync(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println(ix.Holders("llama", 0x5678, nil))
	// Output: [10.0.0.7:8000]
}
