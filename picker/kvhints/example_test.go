package kvhints_test

import (
	"fmt"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/picker/kvhints"
)

func ExampleHinter_Hint() {
	h, _ := hashing.New(hashing.Config{}) // vLLM's defaults: sha256, block size 16
	prompt := hashing.Request{Tokens: make([]uint32, 4*16)}
	keys, _ := h.BlockKeys(nil, prompt) // the engines' event hashes

	chosen := index.Holder{Pod: "10.0.0.1:8000"}
	peer := index.Holder{Pod: "10.0.0.2:8000"}
	idx := index.New(index.Config{})
	idx.Store(index.Blocks{Model: "llama", Holder: peer, Tier: index.TierCPU, Keys: keys[:2]})

	// Each pod's KVCR control endpoint, from its --kv-transfer-config.
	var eps kvhints.Endpoints
	for pod, host := range map[string]string{chosen.Pod: "10.0.0.1", peer.Pod: "10.0.0.2"} {
		cfg := `{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{
		  "secondary_tiers":[{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[17771],
		  "control_advertise_host":"` + host + `"}]}}`
		got, err := kvhints.FromKVTransferConfig(pod, 0, kvhints.Aggregated, []byte(cfg))
		if err != nil {
			panic(err)
		}
		for _, ep := range got {
			_ = eps.Add(ep)
		}
	}

	p, _ := picker.New(picker.Config{Index: idx, Hasher: h})
	d, _ := p.Pick(picker.Request{ID: "req-7f3a", Model: "llama", Keys: keys, Destination: chosen})
	defer d.Done()
	hint, reason, _ := kvhints.New(kvhints.Config{Endpoints: &eps}).Hint(&d, keys, "req-7f3a")
	fmt.Println(d.Reason, reason, hint.SourceControlEndpoint, len(hint.BlockHashes), "blocks")
	body, _ := kvhints.MergeIntoBody(nil, []byte(`{"model":"llama","prompt":"...","max_tokens":8}`), &hint, kvhints.PlacementKVHint)
	fmt.Println(len(body) > 0)
	// Output:
	// pull hinted tcp://10.0.0.2:17771 2 blocks
	// true
}
