package render_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/render"
)

// engineRequest is what the engine itself hashes for a chat body: its own
// template's tokens and items, as its KV events report the blocks. It runs
// the fake's template in-process, not through the client.
func engineRequest(t *testing.T, body string) hashing.Request {
	t.Helper()
	var req struct {
		Messages  []any  `json:"messages"`
		CacheSalt string `json:"cache_salt"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &req))
	tokens, feats, err := chatTemplate(req.Messages, true)
	require.NoError(t, err)
	r := hashing.Request{Tokens: tokens, CacheSalt: req.CacheSalt}
	if feats != nil {
		for i, h := range feats.hashes["image"] {
			p := feats.placeholders["image"][i]
			r.MM = append(r.MM, hashing.MMItem{ID: h, Offset: p["offset"], Length: p["length"]})
		}
	}
	return r
}

func chatBody(image, question, salt string) string {
	return fmt.Sprintf(`{"model":"vl","cache_salt":%q,"messages":[`+
		`{"role":"system","content":"You are a careful assistant."},`+
		`{"role":"user","content":[{"type":"text","text":"What is in this picture?"},{"type":"image_url","image_url":{"url":%q}}]},`+
		`{"role":"assistant","content":"A cat on a mat."},`+
		`{"role":"user","content":%q}]}`, salt, image, question)
}

// TestAChatBodyScoresTheSameAsItsRenderedTokens is the SDK end to end: an
// engine stored a conversation's blocks (keys from its own tokens, image
// items and salt), and a router holding only the OpenAI body scores the
// engine's pods through render, hashing, index and picker exactly as it
// would from the engine's tokens.
func TestAChatBodyScoresTheSameAsItsRenderedTokens(t *testing.T) {
	f := newFakeVLLM(t, "vl")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "vl"})
	h, err := hashing.New(hashing.Config{BlockSize: 8})
	require.NoError(t, err)
	idx := index.New(index.Config{})
	p, err := picker.New(picker.Config{Index: idx, Hasher: h})
	require.NoError(t, err)

	const img = "https://example.test/cat.png"
	stored := chatBody(img, "And the colour of the mat?", "tenant-1")
	engine := engineRequest(t, stored)
	keys, err := h.BlockKeys(nil, engine)
	require.NoError(t, err)
	require.Greater(t, len(keys), 12)
	full := index.Holder{Pod: "10.0.0.1:8000"}
	part := index.Holder{Pod: "10.0.0.2:8000"}
	idx.Store(index.Blocks{Model: "vl", Holder: full, Tier: index.TierGPU, Keys: keys})
	idx.Store(index.Blocks{Model: "vl", Holder: part, Tier: index.TierGPU, Keys: keys[:3]})

	score := func(req hashing.Request) []picker.Score {
		t.Helper()
		s, err := p.Score(picker.Request{Model: "vl", Prompt: req}, nil)
		require.NoError(t, err)
		return s
	}
	blocks := func(s []picker.Score, h index.Holder) int {
		for _, x := range s {
			if x.Holder == h {
				return x.Blocks
			}
		}
		return 0
	}
	imageBlock := engine.MM[0].Offset / 8

	for _, tc := range []struct {
		name string
		body string
		full int // blocks of the stored conversation the full holder has; -1: the full blocks of the tokens in common
	}{
		{"the stored conversation", stored, len(keys)},
		{"its next turn", stored[:len(stored)-2] + `,{"role":"assistant","content":"Blue."},{"role":"user","content":"Thanks"}]}`, -1},
		{"another question on the same image", chatBody(img, "Is the cat asleep?", "tenant-1"), -1},
		{"another image", chatBody("https://example.test/dog.png", "And the colour of the mat?", "tenant-1"), imageBlock},
		{"another tenant's salt", chatBody(img, "And the colour of the mat?", "tenant-2"), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := c.Chat(context.Background(), []byte(tc.body))
			require.NoError(t, err)
			require.Equal(t, "vl", r.Model)
			want := engineRequest(t, tc.body)
			require.Equal(t, want, r.Request, "the render is the engine's own request")

			got := score(r.Request)
			require.Equal(t, score(want), got)
			wantFull := tc.full
			if wantFull < 0 {
				common := 0
				for common < min(len(want.Tokens), len(engine.Tokens)) && want.Tokens[common] == engine.Tokens[common] {
					common++
				}
				wantFull = common / 8
				require.Greater(t, wantFull, imageBlock, "the image's blocks match")
				require.LessOrEqual(t, wantFull, len(keys))
			}
			require.Equal(t, wantFull, blocks(got, full))
			require.Equal(t, min(3, blocks(got, full)), blocks(got, part))
		})
	}

	// The control: the same conversation's tokens without the image items
	// (what a router that tokenizes text itself would hash) lose the
	// stored blocks from the image on.
	r, err := c.Chat(context.Background(), []byte(stored))
	require.NoError(t, err)
	textOnly := r.Request
	textOnly.MM = nil
	require.Equal(t, imageBlock, blocks(score(textOnly), full))
}

// TestRenderedItemsGiveVLLMsExtraKeys checks the extra keys a rendered chat
// with two images and a salt gets, block by block, against a reference
// written from vLLM's rule (kv_cache_utils: each item overlapping the
// block as (identifier, offset - block start), then the salt on block 0),
// independently of package hashing's cursor.
func TestRenderedItemsGiveVLLMsExtraKeys(t *testing.T) {
	f := newFakeVLLM(t, "vl")
	c := newClient(t, render.Config{URL: f.srv.URL, Model: "vl"})
	body := `{"cache_salt":"tenant-9","messages":[{"role":"user","content":[{"type":"text","text":"two:"},` +
		`{"type":"image_url","image_url":{"url":"a.png"}},{"type":"image_url","image_url":{"url":"b.png"}},{"type":"text","text":"compare"}]}]}`
	r, err := c.Chat(context.Background(), []byte(body))
	require.NoError(t, err)
	require.Len(t, r.Request.MM, 2)
	const bs = 16
	h, err := hashing.New(hashing.Config{BlockSize: bs})
	require.NoError(t, err)
	blocks, err := h.Blocks(nil, r.Request)
	require.NoError(t, err)
	require.Len(t, blocks, len(r.Request.Tokens)/bs)
	for i, b := range blocks {
		start, end := i*bs, (i+1)*bs
		var want []hashing.ExtraKey
		for _, it := range r.Request.MM {
			if it.Offset < end && it.Offset+it.Length > start {
				want = append(want, hashing.Tuple(hashing.Str(it.ID), hashing.Int(int64(it.Offset-start))))
			}
		}
		if i == 0 {
			want = append(want, hashing.Str("tenant-9"))
		}
		require.True(t, hashing.EqualKeys(want, b.Extra), "block %d: want %v, got %v", i, want, b.Extra)
	}
}
