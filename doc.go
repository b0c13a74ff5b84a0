// Package kvsource is an embeddable SDK that lets an LLM router move KV cache
// instead of recomputing it.
//
// A fleet of vLLM pods caches the KV of prompt prefixes per pod, on GPU and in
// a CPU offload tier. A router that knows which pod holds which blocks can send
// a request where its prefix is cached, or, when load or the prefill/decode
// split sends it elsewhere, tell the chosen pod which peer to pull the missing
// prefix from instead of recomputing it. The rule: local hits first; a peer
// pull when locality breaks and the pull is cheaper than recompute; nothing
// when it is not.
//
// The packages follow the data flow:
//
//	hashing   block keys of a prompt, bit-identical to vLLM
//	events    vLLM's KV events, with gap detection and replay, any transport
//	          (events/zmq: vLLM's ZMQ stream; events/natsstream: router
//	          replicas sharing one stream on NATS JetStream)
//	index     which holder (pod, rank) holds which block in which tier
//	picker    prefix scores and the pull decision
//	transfer  moving blocks: vLLM's P2P protocol, NIXL, an in-memory fake
//
// A router hashes the prompt, asks the picker, and applies the decision:
//
//	h, _ := hashing.New(hashing.Config{})           // vLLM's defaults
//	ix := index.New(index.Config{})
//	sub, _ := zmq.NewSubscriber(zmq.SubscriberConfig{Events: events.Config{Sink: ix, Hasher: h}, Bind: []string{"tcp://*:5557"}})
//	go sub.Run(ctx)
//	p, _ := picker.New(picker.Config{Index: ix, Hasher: h, Sources: sub.Source}) // only live holders serve pulls
//	d, _ := p.Pick(picker.Request{ID: id, Model: model, Prompt: hashing.Request{Tokens: tokens}, Destination: chosen})
//	if d.Reason == picker.ReasonPull {
//		name, value := d.Header() // x-kv-cache-source-host-port: host:port
//		// forward the request with the header; d.Done() when the pull is over
//	}
//
// Only holders with the prefix in the CPU offload tier are pull sources by
// default, because vLLM's P2P producers serve pulls from it: a holder with
// the prefix on GPU alone scores, but is not pulled from. A transport that
// reads GPU memory sets picker.Config.PullTiers to
// []string{index.TierGPU, index.TierCPU}. A router that moves the blocks
// itself fetches d.TransferKeys(blocks, 0) over a transfer.Session, blocks
// being the prompt's h.Blocks. A reason of unknown_model rather than
// no_holder says the index knows other models but not this one, typically
// a misspelled model name.
//
// The examples folder holds a fleet replay (make demo), an HTTP router and an
// llm-d endpoint-picker plugin built on these packages.
package kvsource
