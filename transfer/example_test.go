package transfer_test

import (
	"context"
	"fmt"
	"time"

	"github.com/kvsource/kvsource/transfer"
	"github.com/kvsource/kvsource/transfer/fake"
)

// A router verifies that a peer still holds a prefix before naming it as
// the source of a pull, then times pulls for calibration.
func Example() {
	net := fake.New(fake.Config{BlockLen: 1 << 16, Latency: time.Millisecond, Bandwidth: 1 << 30})
	keys := make([]transfer.Key, 8)
	for i := range keys {
		keys[i] = transfer.KeyFromUint64(uint64(1000+i), 0)
	}
	net.AddPeer("pod-b").Hold(keys[:6]...)

	ctx := context.Background()
	s, err := net.Client(nil).Connect(ctx, "pod-b")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close()

	r, err := transfer.Probe(ctx, s, keys)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("pod-b holds a prefix of", r.Prefix, "blocks")

	samples, err := transfer.MeasurePull(ctx, s, keys[:r.Prefix], []int{0, 1, 2, 3, 4, 5}, transfer.PullPlan{TokensPerKey: 16})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, sm := range samples {
		fmt.Println(sm.Tokens, "tokens")
	}
	// Output:
	// pod-b holds a prefix of 6 blocks
	// 16 tokens
	// 32 tokens
	// 64 tokens
	// 96 tokens
}
