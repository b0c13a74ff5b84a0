//go:build cgo

package p2p

import (
	"bytes"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

var (
	fixtureKeyA = append(seqBytes(32), 0, 0, 0, 0)
	fixtureKeyB = append(bytes.Repeat([]byte{0xff}, 32), 0, 0, 0, 1)
)

func seqBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i)
	}
	return b
}

// encodeFixtures pairs each message with testdata/encode_<name>.msgpack,
// written by testdata/gen_fixtures.py from the spec's field table.
var encodeFixtures = map[string]message{
	"connect": {Type: TypeConnect, PeerID: "127.0.0.1:5710", AgentMetadata: []byte("kvsource-inproc/agent-1"),
		BaseAddr: 0x7F0000001000, NumBlocks: 300, BlockLen: 65536, ConfigFingerprint: "", HashSeed: "vllm-none-hash"},
	"connect_ack":          {Type: TypeConnectAck, PeerID: "10.0.0.2:5711"},
	"lookup":               {Type: TypeLookup, KVRequestID: "req-1", Keys: [][]byte{fixtureKeyA, fixtureKeyB}, RoundSeq: 0},
	"lookup_resp":          {Type: TypeLookupResp, KVRequestID: "req-1", Keys: [][]byte{fixtureKeyA, fixtureKeyB}, Hits: []bool{true, false}},
	"fetch":                {Type: TypeFetch, KVRequestID: "req-1", Keys: [][]byte{fixtureKeyA}, BlockIndexes: []uint64{200}, RoundSeq: 3},
	"fetch_empty":          {Type: TypeFetch, KVRequestID: "req-1", Keys: [][]byte{}, BlockIndexes: []uint64{}, RoundSeq: 1},
	"transfer_done":        {Type: TypeTransferDone, KVRequestID: "req-1", Success: true, RoundSeq: 3},
	"transfer_done_failed": {Type: TypeTransferDone, KVRequestID: "req-1", Success: false, RoundSeq: 128},
	"abort_fetch":          {Type: TypeAbortFetch, KVRequestID: "req-1", RoundSeq: 70000},
	"abort_ack":            {Type: TypeAbortAck, KVRequestID: "req-1", RoundSeq: 70000},
	"disconnect":           {Type: TypeDisconnect},
}

func readFixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name+".msgpack"))
	require.NoError(t, err)
	return b
}

func TestEncodingMatchesFixturesByteForByte(t *testing.T) {
	for name, m := range encodeFixtures {
		t.Run(name, func(t *testing.T) {
			got, err := m.encode()
			require.NoError(t, err)
			want := readFixture(t, "encode_"+name)
			require.Equal(t, hex.EncodeToString(want), hex.EncodeToString(got))
		})
	}
}

func TestEveryMessageTypeHasAFixture(t *testing.T) {
	types := map[string]bool{}
	for _, m := range encodeFixtures {
		types[m.Type] = true
	}
	for typ := range fieldCount {
		require.True(t, types[typ], "no fixture for %s", typ)
	}
}

func TestFixturesDecodeToTheirMessages(t *testing.T) {
	for name, want := range encodeFixtures {
		t.Run(name, func(t *testing.T) {
			got, err := decodeMessage(readFixture(t, "encode_"+name))
			require.NoError(t, err)
			require.Equal(t, want, got)
		})
	}
}

func TestDecodingAcceptsWhatPeersSend(t *testing.T) {
	tests := map[string]message{
		"connect_reordered": {Type: TypeConnect, PeerID: "pod-b:5710", AgentMetadata: []byte("\x00\x01md"),
			BaseAddr: 0xFFFFFFFFFFFF0000, NumBlocks: 1, BlockLen: 131072, ConfigFingerprint: "0123456789abcdef", HashSeed: "42"},
		"transfer_done_no_round": {Type: TypeTransferDone, KVRequestID: "r", Success: false, RoundSeq: 0},
		"abort_ack_extra":        {Type: TypeAbortAck, KVRequestID: "r", RoundSeq: 2},
	}
	for name, want := range tests {
		t.Run(name, func(t *testing.T) {
			got, err := decodeMessage(readFixture(t, "decode_"+name))
			require.NoError(t, err)
			require.Equal(t, want, got)
		})
	}
}

// unhex reads hex with comments: everything after '#' on a line is ignored.
func unhex(t *testing.T, s string) []byte {
	t.Helper()
	var b strings.Builder
	for line := range strings.SplitSeq(s, "\n") {
		line, _, _ = strings.Cut(line, "#")
		b.WriteString(strings.Join(strings.Fields(line), ""))
	}
	out, err := hex.DecodeString(b.String())
	require.NoError(t, err)
	return out
}

// Hand-written from the msgpack spec, independently of the Python fixtures.
func TestHandWrittenEncodings(t *testing.T) {
	tests := []struct {
		name string
		m    message
		hex  string
	}{
		{"disconnect", message{Type: TypeDisconnect}, `
			81                          # fixmap, 1 entry
			a4 74797065                 # fixstr "type"
			aa 646973636f6e6e656374     # fixstr(10) "disconnect"`},
		{"abort_ack", message{Type: TypeAbortAck, KVRequestID: "r", RoundSeq: 300}, `
			83                          # fixmap, 3 entries
			a4 74797065                 # "type"
			a9 61626f72745f61636b       # "abort_ack"
			ad 6b765f726571756573745f6964 # fixstr(13) "kv_request_id"
			a1 72                       # "r"
			a9 726f756e645f736571       # fixstr(9) "round_seq"
			cd 012c                     # uint16 300`},
		{"transfer_done", message{Type: TypeTransferDone, KVRequestID: "r", Success: true, RoundSeq: 5}, `
			84                          # fixmap, 4 entries
			a4 74797065                 # "type"
			ad 7472616e736665725f646f6e65 # fixstr(13) "transfer_done"
			ad 6b765f726571756573745f6964 # "kv_request_id"
			a1 72                       # "r"
			a7 73756363657373           # fixstr(7) "success"
			c3                          # true
			a9 726f756e645f736571       # "round_seq"
			05                          # positive fixint 5`},
		{"lookup_resp", message{Type: TypeLookupResp, KVRequestID: "q", Keys: [][]byte{{0xaa, 0, 0, 0, 2}}, Hits: []bool{false}}, `
			84                          # fixmap, 4 entries
			a4 74797065                 # "type"
			ab 6c6f6f6b75705f72657370   # fixstr(11) "lookup_resp"
			ad 6b765f726571756573745f6964 # "kv_request_id"
			a1 71                       # "q"
			a4 6b657973                 # "keys"
			91                          # fixarray, 1 item
			c4 05 aa00000002            # bin8, 5 bytes: digest aa, group 2
			a4 68697473                 # "hits"
			91 c2                       # fixarray [false]`},
		{"connect with a 64-bit base address", message{Type: TypeConnect, PeerID: "h:1", AgentMetadata: []byte{}, BaseAddr: 1 << 40,
			NumBlocks: 2, BlockLen: 256, HashSeed: "s"}, `
			88                          # fixmap, 8 entries
			a4 74797065 a7 636f6e6e656374                  # "type": "connect"
			a7 706565725f6964 a3 683a31                    # "peer_id": "h:1"
			ae 6167656e745f6d65746164617461 c4 00          # "agent_metadata": bin8 empty
			a9 626173655f61646472 cf 0000010000000000      # "base_addr": uint64 1<<40
			aa 6e756d5f626c6f636b73 02                     # "num_blocks": 2
			a9 626c6f636b5f6c656e cd 0100                  # "block_len": uint16 256
			b2 636f6e6669675f66696e6765727072696e74 a0     # "config_fingerprint": ""
			a9 686173685f73656564 a1 73                    # "hash_seed": "s"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.m.encode()
			require.NoError(t, err)
			require.Equal(t, hex.EncodeToString(unhex(t, tt.hex)), hex.EncodeToString(got))
		})
	}
}

func TestDecodingRejectsMalformedMessages(t *testing.T) {
	enc := func(m message) []byte {
		b, err := m.encode()
		require.NoError(t, err)
		return b
	}
	tests := []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "EOF"},
		{"not a map", []byte{0x91, 0x01}, "not a map"},
		{"no type", unhex(t, "81 a7 706565725f6964 a1 78"), "no type"},
		{"type not a str", unhex(t, "81 a4 74797065 01"), "not a str"},
		{"key as str", unhex(t, "83 a4 74797065 a6 6c6f6f6b7570 ad 6b765f726571756573745f6964 a1 72 a4 6b657973 91 a1 78"), "not a bin"},
		{"negative round", unhex(t, "83 a4 74797065 a9 61626f72745f61636b ad 6b765f726571756573745f6964 a1 72 a9 726f756e645f736571 ff"), "negative"},
		{"nil success", unhex(t, "83 a4 74797065 ad 7472616e736665725f646f6e65 ad 6b765f726571756573745f6964 a1 72 a7 73756363657373 c0"), "not a bool"},
		{"missing fields", unhex(t, "81 a4 74797065 a7 636f6e6e656374"), "without peer_id, agent_metadata, base_addr, num_blocks, block_len, hash_seed"},
		{"hits shorter than keys", unhex(t, "84 a4 74797065 ab 6c6f6f6b75705f72657370 ad 6b765f726571756573745f6964 a1 71 a4 6b657973 91 c4 01 aa a4 68697473 90"), "0 hits for 1 keys"},
		{"bin longer than frame", unhex(t, "82 a4 74797065 a7 636f6e6e656374 ae 6167656e745f6d65746164617461 c6 ffffffff 00"), "declared"},
		{"array longer than frame", unhex(t, "82 a4 74797065 a6 6c6f6f6b7570 a4 6b657973 dd ffffffff"), "array of"},
		{"map longer than frame", unhex(t, "df ffffffff a4 74797065"), "map of"},
		{"trailing bytes", append(enc(message{Type: TypeDisconnect}), 0), "trailing"},
		{"truncated", enc(message{Type: TypeAbortAck, KVRequestID: "abc"})[:20], "declared"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := decodeMessage(tt.data)
			require.ErrorIs(t, err, ErrMalformed)
			require.Contains(t, err.Error(), tt.want)
		})
	}
}

func TestUnknownTypesDecodeForTheCallerToIgnore(t *testing.T) {
	m, err := decodeMessage(unhex(t, "82 a4 74797065 a4 70696e67 a1 78 01"))
	require.NoError(t, err)
	require.Equal(t, "ping", m.Type)
}

func TestEncodingRefusesInconsistentMessages(t *testing.T) {
	_, err := (&message{Type: "bogus"}).encode()
	require.ErrorIs(t, err, ErrMalformed)
	_, err = (&message{Type: TypeFetch, Keys: [][]byte{{1}}}).encode()
	require.ErrorIs(t, err, ErrMalformed)
	_, err = (&message{Type: TypeLookupResp, Keys: [][]byte{{1}}}).encode()
	require.ErrorIs(t, err, ErrMalformed)
}

// FuzzDecode checks that no frame panics the decoder and that decoding
// keeps every field the encoding of an accepted message carries.
func FuzzDecode(f *testing.F) {
	entries, _ := filepath.Glob(filepath.Join("testdata", "*.msgpack"))
	for _, p := range entries {
		b, err := os.ReadFile(p)
		if err == nil {
			f.Add(b)
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := decodeMessage(data)
		if err != nil {
			return
		}
		if _, known := fieldCount[m.Type]; !known {
			return
		}
		b1, err := m.encode()
		require.NoError(t, err)
		m2, err := decodeMessage(b1)
		require.NoError(t, err)
		b2, err := m2.encode()
		require.NoError(t, err)
		require.Equal(t, b1, b2)
	})
}
