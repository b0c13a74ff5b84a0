package render_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/render"
)

func Example() {
	// A stand-in for `vllm launch render Qwen/Qwen2.5-VL-3B-Instruct`: it
	// answers every chat render with vLLM's GenerateRequest JSON, here 20
	// tokens of which 4 are an image's placeholder.
	vllm := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, `{"request_id":"chatcmpl-1","model":"Qwen/Qwen2.5-VL-3B-Instruct","cache_salt":"tenant-7",`+
			`"token_ids":[151644,8948,198,151655,151655,151655,151655,151645,198,151644,872,198,3838,374,419,30,151645,198,151644,77091],`+
			`"features":{"mm_hashes":{"image":["4f3c9a"]},"mm_placeholders":{"image":[{"offset":3,"length":4}]}},`+
			`"sampling_params":{"max_tokens":16}}`)
	}))
	defer vllm.Close()

	c, err := render.New(render.Config{URL: vllm.URL, Model: "Qwen/Qwen2.5-VL-3B-Instruct"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()
	body := []byte(`{"model":"qwen-vl","cache_salt":"tenant-7","messages":[{"role":"user","content":[` +
		`{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}},{"type":"text","text":"What is this?"}]}]}`)
	r, err := c.Chat(context.Background(), body)
	switch {
	case errors.Is(err, render.ErrUnavailable):
		fmt.Println("503:", err)
		return
	case err != nil:
		fmt.Println(err)
		return
	}
	fmt.Println(r.Model, len(r.Request.Tokens), "tokens, salt", r.Request.CacheSalt, "items", r.Request.MM)

	h, _ := hashing.New(hashing.Config{BlockSize: 4})
	keys, _ := h.BlockKeys(nil, r.Request) // what to look up in the index
	fmt.Println(len(keys), "block keys")
	// Output:
	// Qwen/Qwen2.5-VL-3B-Instruct 20 tokens, salt tenant-7 items [{4f3c9a 3 4}]
	// 5 block keys
}
