package fake_test

import (
	"context"
	"testing"

	"github.com/kvsource/kvsource/transfer/fake"
)

// BenchmarkPull measures the fake's own cost per pull (lookup then fetch of
// 32 blocks, no simulated latency), which a fleet simulation pays per
// decision.
func BenchmarkPull(b *testing.B) {
	const blocks = 32
	n := fake.New(fake.Config{BlockLen: 4096})
	ks := keys(blocks, 0)
	n.AddPeer("p").Hold(ks...)
	for _, tc := range []struct {
		name string
		dst  []byte
	}{{"copy", make([]byte, blocks*4096)}, {"nocopy", nil}} {
		b.Run(tc.name, func(b *testing.B) {
			s, err := n.Client(tc.dst).Connect(context.Background(), "p")
			if err != nil {
				b.Fatal(err)
			}
			idx := seq(blocks)
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if _, err := s.Lookup(ctx, ks); err != nil {
					b.Fatal(err)
				}
				if _, err := s.Fetch(ctx, ks, idx); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/blocks, "ns/block")
		})
	}
}
