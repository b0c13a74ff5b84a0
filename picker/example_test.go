package picker_test

import (
	"context"
	"fmt"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/transfer"
	"github.com/kvsource/kvsource/transfer/fake"
)

func ExamplePicker_Pick() {
	h, _ := hashing.New(hashing.Config{}) // vLLM's defaults: sha256, block size 16
	prompt := hashing.Request{Tokens: make([]uint32, 10*16+3)}
	keys, _ := h.BlockKeys(nil, prompt)

	// What the events say: the router's choice holds the first 2 blocks, a
	// peer has offloaded 8 to its CPU tier.
	idx := index.New(index.Config{})
	chosen := index.Holder{Pod: "10.0.0.1:8000"}
	peer := index.Holder{Pod: "10.0.0.2:8000"}
	idx.Store(index.Blocks{Model: "llama", Holder: chosen, Tier: index.TierGPU, Keys: keys[:2]})
	idx.Store(index.Blocks{Model: "llama", Holder: peer, Tier: index.TierCPU, Keys: keys[:8]})

	p, _ := picker.New(picker.Config{Index: idx, Hasher: h, MinCachedTokenDelta: 64})
	d, _ := p.Pick(picker.Request{ID: "req-42", Model: "llama", Prompt: prompt, Destination: chosen})
	defer d.Done()

	name, value := d.Header()
	src := d.KVTransferParams("req-42").RemoteKVSource
	fmt.Println(d.Reason, "from", d.Source, "blocks", d.Cached, "to", d.Cached+d.Gain, "recompute", d.Recompute)
	fmt.Println(name+":", value)
	fmt.Println("remote_kv_source:", src.RemoteHost, src.RemotePort)
	// Output:
	// pull from 10.0.0.2:8000 blocks 2 to 8 recompute 2
	// x-kv-cache-source-host-port: 10.0.0.2:8000
	// remote_kv_source: 10.0.0.2 5710
}

// A router that moves the blocks itself pulls the decision's keys from its
// source over a transfer.Session.
func ExampleDecision_TransferKeys() {
	h, _ := hashing.New(hashing.Config{})
	prompt := hashing.Request{Tokens: make([]uint32, 10*16)}
	blocks, _ := h.Blocks(nil, prompt) // full digests, as vLLM names blocks to peers
	keys := make([]uint64, len(blocks))
	for i, b := range blocks {
		keys[i] = b.Key
	}
	idx := index.New(index.Config{})
	chosen := index.Holder{Pod: "10.0.0.1:8000"}
	peer := index.Holder{Pod: "10.0.0.2:8000"}
	idx.Store(index.Blocks{Model: "llama", Holder: chosen, Tier: index.TierGPU, Keys: keys[:4]})
	idx.Store(index.Blocks{Model: "llama", Holder: peer, Tier: index.TierCPU, Keys: keys})

	// The peer's offload tier, simulated.
	net := fake.New(fake.Config{})
	src := net.AddPeer(peer.Pod)
	for _, b := range blocks {
		src.Hold(transfer.NewKey(b.Digest.Bytes(), 0))
	}

	p, _ := picker.New(picker.Config{Index: idx, Hasher: h})
	d, _ := p.Pick(picker.Request{ID: "req-7", Model: "llama", Keys: keys, Destination: chosen})
	defer d.Done()
	tk, err := d.TransferKeys(blocks, 0)
	if err != nil {
		fmt.Println(err)
		return
	}

	ctx := context.Background()
	sess, _ := net.Client(make([]byte, len(tk)*net.BlockLen())).Connect(ctx, d.Source.Pod)
	defer sess.Close()
	hits, _ := sess.Lookup(ctx, tk)
	n := transfer.Prefix(hits)
	idxs := make([]int, n)
	for i := range idxs {
		idxs[i] = i
	}
	st, err := sess.Fetch(ctx, tk[:n], idxs)
	fmt.Println(d.Reason, "blocks", d.Cached, "to", d.Cached+d.Gain, "from", d.Source)
	fmt.Println("pulled", st.Blocks, "blocks, err", err)
	// Output:
	// pull blocks 4 to 10 from 10.0.0.2:8000
	// pulled 6 blocks, err <nil>
}

func ExampleFit() {
	// gpt-oss-120b on H200: recomputing a cold prefix against pulling it
	// from a peer's CPU tier.
	tokens := []int{2048, 8192, 16384, 32768, 49152}
	recompute := []float64{78, 250, 510, 1173, 1988}
	pull := []float64{35, 57, 86, 165, 235}
	var rs, ps []transfer.Sample
	for i, t := range tokens {
		rs = append(rs, transfer.Sample{Tokens: t, Millis: recompute[i]})
		ps = append(ps, transfer.Sample{Tokens: t, Millis: pull[i]})
	}
	cal, err := picker.Fit(rs, ps, picker.DefaultMargin)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("pull floor %.0f ms, %.1f ms per 1K tokens\n", cal.Pull.Floor, cal.Pull.PerToken*1000)
	fmt.Printf("at 8K: recompute %.0f ms, pull %.0f ms\n", cal.Recompute.At(8192), cal.Pull.At(8192))
	fmt.Println("threshold:", cal.Threshold, "tokens")
	// Output:
	// pull floor 22 ms, 4.3 ms per 1K tokens
	// at 8K: recompute 249 ms, pull 57 ms
	// threshold: 1 tokens
}
