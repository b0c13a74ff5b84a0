package kvhints_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/picker/kvhints"
)

// compact is the spec's example text without its line breaks.
func compact(t *testing.T, s string) string {
	t.Helper()
	var b bytes.Buffer
	require.NoError(t, json.Compact(&b, []byte(s)))
	return b.String()
}

// The spec's §7 examples, as the spec prints them.
const (
	goldenE1 = `{"caller":"kept",
 "kv_transfer_params":{"existing":"kept",
   "router_hint":{"source_control_endpoint":"tcp://127.0.0.1:23280","block_hashes":[11,22]}}}`
	goldenE2 = `{"protocol_version":"0.1","message_id":"msg-123",
 "actions":[{"action_id":"a1","action_type":"kv.fetch","action_version":"1.0",
   "payload":{"block_hashes":[11,22],"source_control_endpoint":"tcp://127.0.0.1:23280"}}]}`
	goldenE3 = `{"model":"Qwen/Qwen3-0.6B","prompt":"...","max_tokens":8,
 "kv_transfer_params":{"kv_hint":{"protocol_version":"0.1","message_id":"req-7f3a",
   "actions":[{"action_id":"a1","action_type":"kv.fetch","action_version":"1.0",
     "payload":{"block_hashes":[11,22],"source_control_endpoint":"tcp://10.0.0.5:17771"}}]}}}`
)

func TestEncodersMatchTheSpecsExamplesByteForByte(t *testing.T) {
	t.Run("E2 envelope", func(t *testing.T) {
		h := kvhints.Hint{MessageID: "msg-123", SourceControlEndpoint: "tcp://127.0.0.1:23280", BlockHashes: []uint64{11, 22}}
		got, err := h.AppendEnvelope(nil)
		require.NoError(t, err)
		require.Equal(t, compact(t, goldenE2), string(got))
	})
	t.Run("E1 legacy router_hint in extra_args", func(t *testing.T) {
		h := kvhints.Hint{SourceControlEndpoint: "tcp://127.0.0.1:23280", BlockHashes: []uint64{11, 22}}
		got, err := kvhints.MergeIntoBody(nil, []byte(`{"caller":"kept","kv_transfer_params":{"existing":"kept"}}`), &h, kvhints.PlacementRouterHint)
		require.NoError(t, err)
		require.Equal(t, compact(t, goldenE1), string(got))
		params, err := kvhints.AppendKVTransferParams(nil, []byte(`{"existing":"kept"}`), &h, kvhints.PlacementRouterHint)
		require.NoError(t, err)
		require.Equal(t, `{"existing":"kept","router_hint":{"source_control_endpoint":"tcp://127.0.0.1:23280","block_hashes":[11,22]}}`, string(params))
	})
	t.Run("E3 kv_hint in a vLLM body", func(t *testing.T) {
		h := kvhints.Hint{MessageID: "req-7f3a", SourceControlEndpoint: "tcp://10.0.0.5:17771", BlockHashes: []uint64{11, 22}}
		got, err := kvhints.MergeIntoBody(nil, []byte(`{"model":"Qwen/Qwen3-0.6B","prompt":"...","max_tokens":8}`), &h, kvhints.PlacementKVHint)
		require.NoError(t, err)
		require.Equal(t, compact(t, goldenE3), string(got))
	})
	t.Run("native kv_hints beside the body's members", func(t *testing.T) {
		h := kvhints.Hint{MessageID: "msg-123", SourceControlEndpoint: "tcp://127.0.0.1:23280", BlockHashes: []uint64{11, 22}}
		got, err := kvhints.MergeIntoBody(nil, []byte(`{"model":"m","kv_transfer_params":{"do_remote_prefill":true}}`), &h, kvhints.PlacementKVHints)
		require.NoError(t, err)
		require.Equal(t, `{"model":"m","kv_transfer_params":{"do_remote_prefill":true},"kv_hints":`+compact(t, goldenE2)+`}`, string(got))
	})
}

// hintOf finds the hint where p puts it in a body MergeIntoBody wrote, and
// parses it with the model of KVCR's parser.
func hintOf(t *testing.T, body []byte, p kvhints.Placement) (kvcrHint, map[string]any, error) {
	t.Helper()
	v, err := decodeNumbers(body)
	require.NoError(t, err, "%s", body)
	top := v.(map[string]any)
	switch p {
	case kvhints.PlacementKVHints:
		h, err := kvcrParseEnvelope(top["kv_hints"])
		return h, top, err
	case kvhints.PlacementRouterHint:
		h, err := kvcrParsePayload(top["kv_transfer_params"].(map[string]any)["router_hint"])
		return h, top, err
	}
	// What vLLM's KVCR adapter hands KVCR: kv_transfer_params[ROUTER_HINT_KEY].
	h, err := kvcrParseEnvelope(top["kv_transfer_params"].(map[string]any)["kv_hint"])
	return h, top, err
}

var placements = []kvhints.Placement{kvhints.PlacementKVHint, kvhints.PlacementKVHints, kvhints.PlacementRouterHint}

// The hashes JSON floats cannot carry (u64 max, 2^53+1, i64 min read as
// u64) reach KVCR exactly, in every placement.
func TestEveryPlacementCarriesExactU64HashesTheParserModelAccepts(t *testing.T) {
	hashes := []uint64{0, 1, math.MaxUint64, 1<<53 + 1, 1 << 63, math.MaxInt64}
	for _, p := range placements {
		t.Run(string(p), func(t *testing.T) {
			h := kvhints.Hint{MessageID: "r1", SourceControlEndpoint: "tcp://[2001:db8::1]:23280", BlockHashes: hashes}
			body, err := kvhints.MergeIntoBody(nil, []byte(`{"model":"m","kv_transfer_params":{"do_remote_decode":true}}`), &h, p)
			require.NoError(t, err)
			got, top, err := hintOf(t, body, p)
			require.NoError(t, err, "%s", body)
			require.Empty(t, got.warnings)
			require.Equal(t, "tcp://[2001:db8::1]:23280", got.endpoint)
			require.Len(t, got.hashes, len(hashes))
			for _, x := range hashes {
				require.True(t, got.hashes[x], "hash %d", x)
			}
			require.Equal(t, true, top["kv_transfer_params"].(map[string]any)["do_remote_decode"])

			// And into []uint64 without UseNumber.
			var typed struct {
				KVHints          *kvhints.Envelope `json:"kv_hints"`
				KVTransferParams struct {
					KVHint     *kvhints.Envelope   `json:"kv_hint"`
					RouterHint *kvhints.RouterHint `json:"router_hint"`
				} `json:"kv_transfer_params"`
			}
			require.NoError(t, json.Unmarshal(body, &typed))
			var payload []byte
			switch p {
			case kvhints.PlacementKVHints:
				payload = typed.KVHints.Actions[0].Payload
			case kvhints.PlacementKVHint:
				payload = typed.KVTransferParams.KVHint.Actions[0].Payload
			default:
				require.Equal(t, hashes, typed.KVTransferParams.RouterHint.BlockHashes)
				return
			}
			var fp kvhints.FetchPayload
			require.NoError(t, json.Unmarshal(payload, &fp))
			require.Equal(t, hashes, fp.BlockHashes)
		})
	}
}

// What the parser model refuses, the encoders refuse to emit, leaving the
// buffer as it was; the hand-written envelope with the same fault shows the
// model does refuse it.
func TestEncodersRefuseWhatKVCRsParserRefuses(t *testing.T) {
	ok := kvhints.Hint{MessageID: "r", SourceControlEndpoint: "tcp://10.0.0.5:17771", BlockHashes: []uint64{7}}
	tests := []struct {
		name  string
		edit  func(h *kvhints.Hint)
		model string // the faulty payload, for the model; "" for none of its rules
	}{
		{"nil block hashes", func(h *kvhints.Hint) { h.BlockHashes = nil }, `{"source_control_endpoint":"tcp://10.0.0.5:17771","block_hashes":null}`},
		{"empty block hashes", func(h *kvhints.Hint) { h.BlockHashes = []uint64{} }, `{"source_control_endpoint":"tcp://10.0.0.5:17771","block_hashes":[]}`},
		{"empty endpoint", func(h *kvhints.Hint) { h.SourceControlEndpoint = "" }, `{"source_control_endpoint":"","block_hashes":[7]}`},
		{"wildcard IPv4 endpoint", func(h *kvhints.Hint) { h.SourceControlEndpoint = "tcp://0.0.0.0:17771" }, ""},
		{"wildcard IPv6 endpoint", func(h *kvhints.Hint) { h.SourceControlEndpoint = "tcp://[::]:17771" }, ""},
		{"unbracketed IPv6", func(h *kvhints.Hint) { h.SourceControlEndpoint = "tcp://2001:db8::1:17771" }, ""},
		{"not tcp", func(h *kvhints.Hint) { h.SourceControlEndpoint = "ipc:///tmp/kvcr" }, ""},
		{"no port", func(h *kvhints.Hint) { h.SourceControlEndpoint = "tcp://10.0.0.5" }, ""},
		{"port 0", func(h *kvhints.Hint) { h.SourceControlEndpoint = "tcp://10.0.0.5:0" }, ""},
		{"empty message id", func(h *kvhints.Hint) { h.MessageID = "" }, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := ok
			tc.edit(&h)
			prefix := []byte("kept")
			got, err := h.AppendEnvelope(prefix)
			require.ErrorIs(t, err, kvhints.ErrInvalid)
			require.Equal(t, "kept", string(got))
			if tc.name != "empty message id" {
				got, err = h.AppendRouterHint(prefix)
				require.ErrorIs(t, err, kvhints.ErrInvalid)
				require.Equal(t, "kept", string(got))
			}
			for _, p := range placements {
				if p == kvhints.PlacementRouterHint && tc.name == "empty message id" {
					continue // the legacy payload has no message id
				}
				_, err := kvhints.MergeIntoBody(nil, []byte(`{"model":"m"}`), &h, p)
				require.ErrorIs(t, err, kvhints.ErrInvalid, "%s", p)
			}
			if tc.model != "" {
				v, err := decodeNumbers([]byte(tc.model))
				require.NoError(t, err)
				_, err = kvcrParsePayload(v)
				require.Error(t, err)
			}
		})
	}
}

// The model itself follows the spec's rules: it is the test's oracle.
func TestKVCRParserModelFollowsTheSpecsRules(t *testing.T) {
	const fetch = `{"action_id":"a1","action_type":"kv.fetch","action_version":"1.0","payload":%s}`
	env := func(actions string) string {
		return `{"protocol_version":"0.1","message_id":"m","actions":[` + actions + `]}`
	}
	payload := func(p string) string { return env(fmt.Sprintf(fetch, p)) }
	good := `{"block_hashes":[1,2],"source_control_endpoint":"tcp://h:1"}`
	tests := []struct {
		name     string
		in       string
		ok       bool
		warnings []string
	}{
		{"rule 1: not a mapping", `[1]`, false, nil},
		{"rule 2: another protocol version warns", `{"protocol_version":"0.2","message_id":"m","actions":[` + fmt.Sprintf(fetch, good) + `]}`, true, []string{"protocol_version"}},
		{"rule 3: actions not a list", `{"protocol_version":"0.1","actions":{}}`, false, nil},
		{"rule 3: an unknown action and a non-mapping before kv.fetch are skipped", env(`1,{"action_id":"x","action_type":"vllm.set_priority","action_version":"1.0","payload":{}},` + fmt.Sprintf(fetch, good)), true, nil},
		{"rule 3: the first kv.fetch is used", env(fmt.Sprintf(fetch, good) + "," + fmt.Sprintf(fetch, `{}`)), true, nil},
		{"rule 3: another action version warns", env(`{"action_id":"a1","action_type":"kv.fetch","action_version":"2.0","payload":` + good + `}`), true, []string{"action_version"}},
		{"rule 4: no kv.fetch", env(`{"action_type":"kv.retain","payload":{}}`), false, nil},
		{"rule 4: payload not a mapping", payload(`[1]`), false, nil},
		{"rule 5: no_retain false is still an error", payload(`{"no_retain":false,"block_hashes":[1],"source_control_endpoint":"tcp://h:1"}`), false, nil},
		{"rule 6: mode copy", payload(`{"mode":"copy","block_hashes":[1],"source_control_endpoint":"tcp://h:1"}`), true, nil},
		{"rule 6: mode move", payload(`{"mode":"move","block_hashes":[1],"source_control_endpoint":"tcp://h:1"}`), false, nil},
		{"rule 7: no endpoint", payload(`{"block_hashes":[1]}`), false, nil},
		{"rule 7: null endpoint", payload(`{"block_hashes":[1],"source_control_endpoint":null}`), false, nil},
		{"rule 8: empty list", payload(`{"block_hashes":[],"source_control_endpoint":"tcp://h:1"}`), false, nil},
		{"rule 8: a float", payload(`{"block_hashes":[1.0],"source_control_endpoint":"tcp://h:1"}`), false, nil},
		{"rule 8: an exponent", payload(`{"block_hashes":[1e3],"source_control_endpoint":"tcp://h:1"}`), false, nil},
		{"rule 8: a bool", payload(`{"block_hashes":[true],"source_control_endpoint":"tcp://h:1"}`), false, nil},
		{"rule 8: a string", payload(`{"block_hashes":["ff"],"source_control_endpoint":"tcp://h:1"}`), false, nil},
		{"rule 8: negative", payload(`{"block_hashes":[-1],"source_control_endpoint":"tcp://h:1"}`), false, nil},
		{"rule 8: 2^64", payload(`{"block_hashes":[18446744073709551616],"source_control_endpoint":"tcp://h:1"}`), false, nil},
		{"rule 8: u64 max", payload(`{"block_hashes":[18446744073709551615],"source_control_endpoint":"tcp://h:1"}`), true, nil},
		{"rule 9: other keys ignored", payload(`{"extension":{"x":1},"block_hashes":[1],"source_control_endpoint":"tcp://h:1"}`), true, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v, err := decodeNumbers([]byte(tc.in))
			require.NoError(t, err)
			h, err := kvcrParseEnvelope(v)
			if !tc.ok {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.warnings, h.warnings)
		})
	}
}

func TestMergingKeepsEveryOtherMemberOfKVTransferParams(t *testing.T) {
	h := kvhints.Hint{MessageID: "r", SourceControlEndpoint: "tcp://10.0.0.5:17771", BlockHashes: []uint64{7}}
	env, err := h.AppendEnvelope(nil)
	require.NoError(t, err)
	existing := `{ "do_remote_prefill": true, "remote_engine_id": "e\u00e9", "kv_hint": {"stale": 1}, "nested": {"a": [1, 2.5, null]} }`
	got, err := kvhints.AppendKVTransferParams(nil, []byte(existing), &h, kvhints.PlacementKVHint)
	require.NoError(t, err)
	// The hint takes the old one's place; everything else is as it was.
	require.Equal(t, `{"do_remote_prefill":true,"remote_engine_id":"e\u00e9","kv_hint":`+string(env)+`,"nested":{"a":[1,2.5,null]}}`, string(got))

	got, err = kvhints.AppendKVTransferParams(nil, []byte(existing), &h, kvhints.PlacementKVHints)
	require.NoError(t, err)
	require.Equal(t, compact(t, existing), string(got), "the native placement leaves kv_transfer_params alone")

	got, err = kvhints.AppendKVTransferParams(nil, nil, nil, kvhints.PlacementKVHint)
	require.NoError(t, err)
	require.Equal(t, `{}`, string(got), "no params and no hint: an empty object, never null")
	got, err = kvhints.AppendKVTransferParams(nil, []byte("null"), &h, kvhints.PlacementKVHint)
	require.NoError(t, err)
	require.Equal(t, `{"kv_hint":`+string(env)+`}`, string(got))

	for _, bad := range []string{`[1]`, `"s"`, `3`, `{"a":}`, `{"a":1} {}`, `{"kv_hint":1,"kv_hint":2}`} {
		got, err := kvhints.AppendKVTransferParams([]byte("kept"), []byte(bad), &h, kvhints.PlacementKVHint)
		require.Error(t, err, bad)
		require.Equal(t, "kept", string(got), bad)
	}
}

func TestStringsAreEscapedAsPythonReadsThemBack(t *testing.T) {
	for _, id := range []string{`a"b\c`, "tab\tnl\n\x00\x1f", "é中文🙂", "<&>", "\u2028"} {
		h := kvhints.Hint{MessageID: id, SourceControlEndpoint: "tcp://h:1", BlockHashes: []uint64{1}}
		b, err := h.AppendEnvelope(nil)
		require.NoError(t, err)
		var e kvhints.Envelope
		require.NoError(t, json.Unmarshal(b, &e))
		require.Equal(t, id, e.MessageID)
	}
	h := kvhints.Hint{MessageID: "bad\xffutf8", SourceControlEndpoint: "tcp://h:1", BlockHashes: []uint64{1}}
	b, err := h.AppendEnvelope(nil)
	require.NoError(t, err)
	require.Contains(t, string(b), `"bad\ufffdutf8"`)
}

// Strings are escaped as encoding/json escapes them, so that a JSON
// answer embedding the envelope matches encoding/json's byte for byte.
func TestStringsAreEscapedAsEncodingJSONEscapesThem(t *testing.T) {
	for _, id := range []string{`a"b\c`, "\b\f\n\r\t\x00\x1f\x7f", "<script>&amp;", "é中文🙂", "bad\xffutf8\xc3", "\u2028\u2029"} {
		h := kvhints.Hint{MessageID: id, SourceControlEndpoint: "tcp://h:1", BlockHashes: []uint64{1}}
		got, err := h.AppendEnvelope(nil)
		require.NoError(t, err)
		want, err := json.Marshal(id)
		require.NoError(t, err)
		require.Contains(t, string(got), `"message_id":`+string(want)+`,`, "%q", id)
	}
}

func TestTypedEnvelopeMarshalsAsTheEncoderWrites(t *testing.T) {
	h := kvhints.Hint{MessageID: "bad\xff<id>", SourceControlEndpoint: "tcp://[fd00::1]:2", BlockHashes: []uint64{math.MaxUint64, 0}}
	env, err := h.Envelope()
	require.NoError(t, err)
	typed, err := json.Marshal(env)
	require.NoError(t, err)
	got, err := h.AppendEnvelope(nil)
	require.NoError(t, err)
	require.Equal(t, string(typed), string(got))
	_, err = (&kvhints.Hint{MessageID: "r", SourceControlEndpoint: "tcp://h:1"}).Envelope()
	require.ErrorIs(t, err, kvhints.ErrInvalid)
}
