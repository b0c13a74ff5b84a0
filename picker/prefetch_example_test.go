package picker_test

import (
	"encoding/json"
	"fmt"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

func ExamplePrefetcher_Prefetch() {
	h, _ := hashing.New(hashing.Config{})
	// The agent's history so far: its next prompt starts with it.
	history := make([]uint32, 4*16)
	keys, _ := h.BlockKeys(nil, hashing.Request{Tokens: history})

	// The pod that ran the last turn offloaded the history to its CPU tier;
	// the next turn will go to another pod.
	idx := index.New(index.Config{})
	last := index.Holder{Pod: "10.0.0.2:8000"}
	next := index.Holder{Pod: "10.0.0.1:8000"}
	idx.Store(index.Blocks{Model: "llama", Holder: last, Tier: index.TierCPU, Keys: keys})

	p, _ := picker.New(picker.Config{Index: idx, Hasher: h})
	pf := picker.NewPrefetcher(p, picker.PrefetchConfig{})
	req := picker.PrefetchRequest{Session: "agent-7", Request: picker.Request{
		Model: "llama", Prompt: hashing.Request{Tokens: history}, Destination: next,
	}}
	got, _ := pf.Prefetch(req)
	fmt.Println(got.State, "from", got.Decision.Source, "blocks", got.Decision.Gain)

	// The warm-up the router posts to the next pod's /v1/completions.
	body, _ := got.Warmup("llama", history, "", "prefetch-agent-7-3")
	b, _ := json.Marshal(body.KVTransferParams)
	fmt.Println("max_tokens", body.MaxTokens, string(b))

	again, _ := pf.Prefetch(req)
	fmt.Println("asked again:", again.State)
	got.Complete() // the warm-up returned
	// Output:
	// started from 10.0.0.2:8000 blocks 4
	// max_tokens 1 {"remote_kv_source":{"kv_request_id":"prefetch-agent-7-3","remote_host":"10.0.0.2","remote_port":5710}}
	// asked again: duplicate
}
