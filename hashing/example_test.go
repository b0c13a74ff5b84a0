package hashing_test

import (
	"fmt"

	"github.com/kvsource/kvsource/hashing"
)

func prompt(n int) []uint32 {
	tokens := make([]uint32, n)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	return tokens
}

// The keys that vLLM's KV events carry for a 40-token prompt under vLLM's
// defaults: two full blocks; the last 8 tokens have no hash yet.
func ExampleHasher_BlockKeys() {
	h, err := hashing.New(hashing.Config{}) // sha256, "vllm-none-hash", 16-token blocks
	if err != nil {
		panic(err)
	}
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: prompt(40)})
	if err != nil {
		panic(err)
	}
	fmt.Println(keys)

	withLoRA, err := h.BlockKeys(nil, hashing.Request{Tokens: prompt(40), LoRAName: "my-lora", CacheSalt: "salt"})
	if err != nil {
		panic(err)
	}
	fmt.Println(withLoRA)
	// Output:
	// [7322446309363477352 17027874615116373601]
	// [7058934378311962856 560318924196908708]
}

// Full digests and extra keys, for logs or for engines that publish raw
// digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
func ExampleHasher_Blocks() {
	h, err := hashing.New(hashing.Config{})
	if err != nil {
		panic(err)
	}
	blocks, err := h.Blocks(nil, hashing.Request{Tokens: prompt(32), MM: []hashing.MMItem{{ID: "img-1", Offset: 10, Length: 12}}})
	if err != nil {
		panic(err)
	}
	for _, b := range blocks {
		fmt.Println(b.Extra)
	}
	fmt.Println(blocks[1].Digest.Len())
	// Output:
	// [("img-1", 10)]
	// [("img-1", -6)]
	// 32
}

// A conversation grows turn by turn; a Prefix hashes each turn's new tokens
// only, and forks share the blocks hashed before the fork.
func ExamplePrefix() {
	h, err := hashing.New(hashing.Config{})
	if err != nil {
		panic(err)
	}
	conv, err := h.NewPrefix(hashing.Request{Tokens: prompt(40)[:20]})
	if err != nil {
		panic(err)
	}
	fork := conv.Clone()
	if err := conv.Append(prompt(40)[20:]...); err != nil {
		panic(err)
	}
	fmt.Println(conv.Keys(), len(conv.Pending()))
	if err := fork.Append(7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7); err != nil {
		panic(err)
	}
	fmt.Println(fork.Keys()[0] == conv.Keys()[0], fork.Keys()[1] == conv.Keys()[1])
	// Output:
	// [7322446309363477352 17027874615116373601] 8
	// true false
}
