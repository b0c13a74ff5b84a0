package kvhints_test

import (
	"encoding/binary"
	"strings"
	"testing"

	"github.com/kvsource/kvsource/picker/kvhints"
)

// FuzzHintEncoders: whatever the hint's message id, endpoint, hashes,
// placement and the request's own kv_transfer_params, every encoder either
// refuses with an error or writes a body the model of KVCR's parser
// accepts, carrying exactly the hint's endpoint, hashes and message id and
// keeping the request's other members.
func FuzzHintEncoders(f *testing.F) {
	u64s := func(xs ...uint64) []byte {
		var b []byte
		for _, x := range xs {
			b = binary.LittleEndian.AppendUint64(b, x)
		}
		return b
	}
	f.Add("req-7f3a", "tcp://10.0.0.5:17771", u64s(11, 22), uint8(0), []byte(`{"existing":"kept"}`))
	f.Add("msg-123", "tcp://[2001:db8::1]:23280", u64s(1<<64-1, 1<<53+1, 1<<63), uint8(1), []byte(`null`))
	f.Add("", "tcp://0.0.0.0:1", u64s(), uint8(2), []byte(`[1]`))
	f.Add("a\"\\\x00\xff", "tcp://h:65535", u64s(0), uint8(0), []byte(`{"kv_hint":1,"x":{"y":[1.5,null]}}`))
	f.Fuzz(func(t *testing.T, id, endpoint string, raw []byte, pl uint8, existing []byte) {
		p := placements[int(pl)%len(placements)]
		h := kvhints.Hint{MessageID: id, SourceControlEndpoint: endpoint}
		for len(raw) >= 8 && len(h.BlockHashes) < 512 {
			h.BlockHashes = append(h.BlockHashes, binary.LittleEndian.Uint64(raw))
			raw = raw[8:]
		}
		body := append([]byte(`{"model":"m","kv_transfer_params":`), existing...)
		body = append(body, '}')
		if len(existing) == 0 {
			body = []byte(`{"model":"m"}`)
		}
		out, err := kvhints.MergeIntoBody(nil, body, &h, p)
		if err != nil {
			return
		}
		got, top, err := hintOf(t, out, p)
		if err != nil {
			t.Fatalf("emitted a hint KVCR refuses: %v\n%s", err, out)
		}
		if got.endpoint != endpoint {
			t.Fatalf("endpoint %q, want %q", got.endpoint, endpoint)
		}
		for _, x := range h.BlockHashes {
			if !got.hashes[x] {
				t.Fatalf("hash %d lost\n%s", x, out)
			}
		}
		if len(got.hashes) > len(h.BlockHashes) {
			t.Fatalf("more hashes than the hint's\n%s", out)
		}
		if top["model"] != "m" {
			t.Fatalf("model lost\n%s", out)
		}
		if p != kvhints.PlacementRouterHint {
			env := top["kv_hints"]
			if p == kvhints.PlacementKVHint {
				env = top["kv_transfer_params"].(map[string]any)["kv_hint"]
			}
			if mid := env.(map[string]any)["message_id"]; mid != validUTF8(id) || id == "" {
				t.Fatalf("message_id %q, want %q", mid, id)
			}
		}
	})
}

// validUTF8 is s as a JSON string written from it reads back: each byte
// that is not UTF-8 becomes U+FFFD.
func validUTF8(s string) string {
	var b strings.Builder
	for _, r := range s {
		b.WriteRune(r)
	}
	return b.String()
}
