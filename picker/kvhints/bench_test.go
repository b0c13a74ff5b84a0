package kvhints_test

import (
	"fmt"
	"testing"

	"github.com/kvsource/kvsource/picker/kvhints"
)

// The encoder on a pick's hot path: no allocation into a reused buffer,
// nanoseconds per block reported.
func BenchmarkAppendEnvelope(b *testing.B) {
	for _, n := range []int{16, 128, 1250} {
		b.Run(fmt.Sprintf("blocks=%d", n), func(b *testing.B) {
			h := kvhints.Hint{MessageID: "chatcmpl-5d3c1b7e9a", SourceControlEndpoint: "tcp://10.0.0.5:17771", BlockHashes: promptKeys(n)}
			buf, err := h.AppendEnvelope(nil)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.SetBytes(int64(len(buf)))
			for b.Loop() {
				buf, _ = h.AppendEnvelope(buf[:0])
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/block")
		})
	}
}

// Merging into a request's kv_transfer_params: without members of its own
// (the common case) it is the envelope and two braces; with some, they
// are walked with encoding/json.
func BenchmarkAppendKVTransferParams(b *testing.B) {
	h := kvhints.Hint{MessageID: "chatcmpl-5d3c1b7e9a", SourceControlEndpoint: "tcp://10.0.0.5:17771", BlockHashes: promptKeys(128)}
	for name, existing := range map[string][]byte{"none": nil, "pd": []byte(`{"do_remote_prefill":true,"remote_engine_id":"e1","remote_block_ids":[1,2,3]}`)} {
		b.Run(name, func(b *testing.B) {
			buf, err := kvhints.AppendKVTransferParams(nil, existing, &h, kvhints.PlacementKVHint)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				buf, _ = kvhints.AppendKVTransferParams(buf[:0], existing, &h, kvhints.PlacementKVHint)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/128, "ns/block")
		})
	}
}
