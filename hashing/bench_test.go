package hashing

import (
	"crypto/sha256"
	"math/rand/v2"
	"testing"
	"time"
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

// BenchmarkCachedBlockKeys hashes the 32,768-token prompt through a
// Cache: "cold" a prompt the cache has never seen, "warm" one whose first
// 30,720 tokens an earlier call hashed (a next turn: each iteration's last
// 2,048 tokens are new). Each iteration also hashes the same prompt with
// Hasher.BlockKeys, the baseline, right after: the machine's load falls on
// both alike, and x-uncached is the ratio of their times.
func BenchmarkCachedBlockKeys(b *testing.B) {
	const shared = 30720
	h, err := New(Config{})
	if err != nil {
		b.Fatal(err)
	}
	run := func(name string, vary int) {
		b.Run(name, func(b *testing.B) {
			c := NewCache(CacheConfig{})
			req := Request{Tokens: benchTokens()}
			dst, _ := c.BlockKeys(h, nil, req)
			base, _ := h.BlockKeys(nil, req)
			var cached, uncached time.Duration
			b.ReportAllocs()
			i := uint32(0)
			for b.Loop() {
				i++
				req.Tokens[vary] = 1<<31 | i // a prompt no earlier call sent
				t0 := time.Now()
				dst, _ = c.BlockKeys(h, dst, req)
				t1 := time.Now()
				base, _ = h.BlockKeys(base, req)
				uncached += time.Since(t1)
				cached += t1.Sub(t0)
			}
			b.ReportMetric(float64(cached.Nanoseconds())/float64(b.N), "ns/cached")
			b.ReportMetric(float64(uncached.Nanoseconds())/float64(b.N), "ns/uncached")
			b.ReportMetric(float64(cached)/float64(uncached), "x-uncached")
			st := c.Stats()
			b.ReportMetric(float64(st.HitBlocks)/float64(st.HitBlocks+st.MissBlocks), "hit-rate")
		})
	}
	run("cold", 0)
	run("warm", shared)
}
