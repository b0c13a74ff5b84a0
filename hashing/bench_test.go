package hashing

import (
	"crypto/sha256"
	"math/rand/v2"
	"testing"
)

// benchTokens is the benchmark prompt: 32,768 tokens of a 152,064
// vocabulary from a fixed PCG stream.
func benchTokens() []uint32 {
	r := rand.New(rand.NewPCG(1, 2))
	tokens := make([]uint32, 32768)
	for i := range tokens {
		tokens[i] = uint32(r.IntN(152064))
	}
	return tokens
}

func reportBlocks(b *testing.B, blocks int) {
	per := b.Elapsed().Seconds() / float64(b.N*blocks)
	b.ReportMetric(1/per, "blocks/s")
	b.ReportMetric(per*1e9, "ns/block")
}

func BenchmarkBlockKeys(b *testing.B) {
	tokens := benchTokens()
	req := Request{Tokens: tokens}
	for _, algo := range Algos {
		b.Run(string(algo), func(b *testing.B) {
			h, err := New(Config{Algo: algo, Seed: "42"})
			if err != nil {
				b.Fatal(err)
			}
			dst, err := h.BlockKeys(nil, req)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				dst, _ = h.BlockKeys(dst, req)
			}
			reportBlocks(b, len(dst))
		})
	}
	b.Run("raw_sha256", func(b *testing.B) {
		h, err := New(Config{Algo: SHA256CBOR, Seed: "42"})
		if err != nil {
			b.Fatal(err)
		}
		payloads := make([][]byte, 0, len(tokens)/DefaultBlockSize)
		parent := h.Root()
		for i := 0; i+DefaultBlockSize <= len(tokens); i += DefaultBlockSize {
			p := appendCBORBlock(nil, &parent, false, tokens[i:i+DefaultBlockSize], &extraSource{})
			payloads = append(payloads, p)
			h.sum(&parent, p)
		}
		var sink byte
		b.ReportAllocs()
		for b.Loop() {
			for _, p := range payloads {
				s := sha256.Sum256(p)
				sink ^= s[0]
			}
		}
		reportBlocks(b, len(payloads))
		_ = sink
	})
}
