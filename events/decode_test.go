package events

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvsource/kvsource/internal/testenv"
)

type conformanceCase struct {
	Name       string          `json:"name"`
	Note       string          `json:"note"`
	PayloadHex string          `json:"payload_hex"`
	Expected   json.RawMessage `json:"expected"`
	Error      *string         `json:"error"`
	// Payload is PayloadHex decoded.
	Payload []byte `json:"-"`
}

func loadPayloadCases(t testing.TB) []conformanceCase {
	t.Helper()
	raw, err := os.ReadFile(testenv.Data(t, "conformance", "events", "payloads.json"))
	require.NoError(t, err)
	var file struct {
		Cases []conformanceCase `json:"cases"`
	}
	require.NoError(t, json.Unmarshal(raw, &file))
	require.NotEmpty(t, file.Cases)
	for i := range file.Cases {
		file.Cases[i].Payload, err = hex.DecodeString(file.Cases[i].PayloadHex)
		require.NoError(t, err, file.Cases[i].Name)
	}
	return file.Cases
}

// batchJSON renders a decoded batch in the conformance file's notation.
func batchJSON(t *testing.T, b *Batch) string {
	t.Helper()
	hashes := func(hs []uint64) []string {
		out := make([]string, len(hs))
		for i, h := range hs {
			out[i] = strconv.FormatUint(h, 10)
		}
		return out
	}
	optInt := func(o Opt[int]) any {
		v, ok := o.Get()
		if !ok {
			return nil
		}
		return v
	}
	optStr := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	var evs []any
	for i := range b.Events {
		e := &b.Events[i]
		switch e.Type {
		case EventBlockStored:
			var parent any
			if p, ok := e.Parent.Get(); ok {
				parent = strconv.FormatUint(p, 10)
			}
			var extra any
			if raws, ok := e.ExtraKeys.Get(); ok {
				keys := make([]any, len(raws))
				for j, raw := range raws {
					if raw == nil {
						continue
					}
					var v any
					require.NoError(t, msgpack.Unmarshal(raw, &v))
					keys[j] = v
				}
				extra = keys
			}
			tokens := e.TokenIDs
			if tokens == nil {
				tokens = []uint32{}
			}
			evs = append(evs, map[string]any{
				"type": "BlockStored", "block_hashes": hashes(e.BlockHashes),
				"parent_block_hash": parent, "token_ids": tokens, "block_size": e.BlockSize,
				"lora_id": optInt(e.LoRAID), "medium": e.Medium,
				"lora_name": optStr(e.LoRAName), "extra_keys": extra,
				"group_idx": optInt(e.GroupIdx),
			})
		case EventBlockRemoved:
			evs = append(evs, map[string]any{
				"type": "BlockRemoved", "block_hashes": hashes(e.BlockHashes),
				"medium": e.Medium, "group_idx": optInt(e.GroupIdx),
			})
		case EventAllBlocksCleared:
			evs = append(evs, map[string]any{"type": "AllBlocksCleared"})
		default:
			evs = append(evs, map[string]any{"type": e.TypeName, "skipped": true})
		}
	}
	var rank any
	if r, ok := b.DPRank.Get(); ok {
		rank = r
	}
	out, err := json.Marshal(map[string]any{"ts": b.TS, "dp_rank": rank, "events": evs})
	require.NoError(t, err)
	return string(out)
}

func TestDecodeConformancePayloads(t *testing.T) {
	d := NewDecoder()
	var b Batch // shared across cases: recycled slices must not leak state
	for _, c := range loadPayloadCases(t) {
		t.Run(c.Name, func(t *testing.T) {
			err := d.Decode(c.Payload, &b)
			if c.Error != nil {
				require.ErrorIs(t, err, ErrMalformed, "case says: %s", *c.Error)
				require.Empty(t, b.Events, "a failed decode leaves no events to apply")
				return
			}
			require.NoError(t, err, c.Note)
			require.JSONEq(t, string(c.Expected), batchJSON(t, &b), c.Note)
		})
	}
}

func TestDecodeRejectsEveryTruncationOfValidPayloads(t *testing.T) {
	d := NewDecoder()
	var b Batch
	for _, c := range loadPayloadCases(t) {
		if c.Error != nil {
			continue
		}
		for n := range len(c.Payload) {
			require.ErrorIs(t, d.Decode(c.Payload[:n], &b), ErrMalformed, "%s cut at %d", c.Name, n)
		}
		require.NoError(t, d.Decode(c.Payload, &b), c.Name)
	}
}

func TestDecodeRejectsHostileInput(t *testing.T) {
	tests := []struct {
		name    string
		payload []byte
	}{
		{"huge event count", []byte{0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff}},
		{"huge token array", slices.Concat([]byte{0x93, 0x00, 0x91, 0x94}, storedTag, []byte{0x90, 0xc0, 0xdd, 0xff, 0xff, 0xff, 0xff})},
		{"huge hash array", slices.Concat([]byte{0x93, 0x00, 0x91, 0x94}, storedTag, []byte{0xdd, 0x7f, 0xff, 0xff, 0xff})},
		{"huge string length", []byte{0x93, 0x00, 0x91, 0x92, 0xdb, 0xff, 0xff, 0xff, 0xff}},
		{"deep nesting in unknown field", append([]byte{0x93, 0x00, 0x91, 0x82, 0xa4, 't', 'y', 'p', 'e', 0xa1, 'X', 0xa1, 'z'}, bytes.Repeat([]byte{0x91}, 100)...)},
		{"negative rank", []byte{0x93, 0x00, 0x90, 0xff}},
		{"nil ts", []byte{0x93, 0xc0, 0x90, 0x00}},
		{"trailing bytes", []byte{0x93, 0x00, 0x90, 0x00, 0x00}},
		{"one-element batch", []byte{0x91, 0x00}},
		{"event without tag", []byte{0x93, 0x00, 0x91, 0x90, 0x00}},
		{"map event without type", []byte{0x93, 0x00, 0x91, 0x81, 0xa1, 'a', 0x00, 0x00}},
		{"stored without hashes", []byte{0x93, 0x00, 0x91, 0x91, 0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd', 0x00}},
		{"token id above uint32", []byte{0x93, 0x00, 0x91, 0x95, 0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd', 0x91, 0x01, 0xc0, 0x91, 0xcf, 1, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x00}},
		{"negative token id", []byte{0x93, 0x00, 0x91, 0x95, 0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd', 0x91, 0x01, 0xc0, 0x91, 0xff, 0x01, 0x00}},
		{"empty digest", []byte{0x93, 0x00, 0x91, 0x92, 0xac, 'B', 'l', 'o', 'c', 'k', 'R', 'e', 'm', 'o', 'v', 'e', 'd', 0x91, 0xc4, 0x00, 0x00}},
	}
	d := NewDecoder()
	var b Batch
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.ErrorIs(t, d.Decode(tc.payload, &b), ErrMalformed)
		})
	}
}

func TestDecodeReadsABatchEncodedAsAMap(t *testing.T) {
	stored := map[string]any{"type": "BlockStored", "block_hashes": []uint64{1 << 63, 5}, "parent_block_hash": nil,
		"token_ids": []uint32{1, 2, 3, 4, 5, 6, 7, 8}, "block_size": 4, "medium": "CPU"}
	removed := map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{5}}
	tests := []struct {
		name  string
		batch map[string]any
		rank  any // nil: no rank
		err   bool
	}{
		{"all fields", map[string]any{"ts": 1.5, "events": []any{stored, removed}, "data_parallel_rank": 2}, 2, false},
		{"rank omitted as its default", map[string]any{"ts": 1.5, "events": []any{stored, removed}}, nil, false},
		{"nil rank and an unknown field", map[string]any{"ts": 1.5, "events": []any{stored, removed}, "data_parallel_rank": nil, "locality": []int{1}}, nil, false},
		{"without events", map[string]any{"ts": 1.5}, nil, true},
		{"without ts", map[string]any{"events": []any{stored}}, nil, true},
		{"events not an array", map[string]any{"ts": 1.5, "events": "x"}, nil, true},
	}
	d := NewDecoder()
	var got, want Batch
	arrayForm, err := msgpack.Marshal([]any{1.5, []any{stored, removed}})
	require.NoError(t, err)
	require.NoError(t, d.Decode(arrayForm, &want))
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			payload, err := msgpack.Marshal(tc.batch)
			require.NoError(t, err)
			err = d.Decode(payload, &got)
			if tc.err {
				require.ErrorIs(t, err, ErrMalformed)
				require.Empty(t, got.Events)
				return
			}
			require.NoError(t, err)
			rank, ok := got.DPRank.Get()
			require.Equal(t, tc.rank != nil, ok)
			if tc.rank != nil {
				require.Equal(t, tc.rank, rank)
			}
			// Apart from the rank, the same batch as the array form.
			got.DPRank = Opt[int]{}
			require.JSONEq(t, batchJSON(t, &want), batchJSON(t, &got))
		})
	}
}

func TestDecodeSkipsExtensionValuesInUnknownFields(t *testing.T) {
	removed := []byte{0xac, 'B', 'l', 'o', 'c', 'k', 'R', 'e', 'm', 'o', 'v', 'e', 'd'}
	payload := slices.Concat([]byte{0x93, 0x00, 0x91, 0x84, 0xa4, 't', 'y', 'p', 'e'}, removed,
		[]byte{0xac}, []byte("block_hashes"), []byte{0x91, 0x07},
		// A msgpack timestamp, as msgspec encodes a datetime.
		[]byte{0xa2, 'a', 't', 0xd7, 0xff, 1, 2, 3, 4, 5, 6, 7, 8},
		[]byte{0xa1, 'x', 0xc7, 0x03, 0x05, 'a', 'b', 'c'},
		[]byte{0x00})
	d := NewDecoder()
	var b Batch
	require.NoError(t, d.Decode(payload, &b))
	require.Len(t, b.Events, 1)
	require.Equal(t, EventBlockRemoved, b.Events[0].Type)
	require.Equal(t, []uint64{7}, b.Events[0].BlockHashes)
	for n := range len(payload) {
		require.ErrorIs(t, d.Decode(payload[:n], &b), ErrMalformed, "cut at %d", n)
	}
}

func TestDecodeOfHostileExtensionLengthsDoesNotGrowMemory(t *testing.T) {
	// An extension value claiming 4 GiB in a field the decoder skips. Each
	// such payload once grew the Decoder's buffer by a megabyte or more,
	// for good.
	payload := []byte{0x93, 0x00, 0x91, 0x82, 0xa4, 't', 'y', 'p', 'e', 0xa1, 'X', 0xa1, 'z', 0xc9, 0xff, 0xff, 0xff, 0xff, 0x01, 0x00}
	d := NewDecoder()
	var b Batch
	require.ErrorIs(t, d.Decode(payload, &b), ErrMalformed)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range 50 {
		require.ErrorIs(t, d.Decode(payload, &b), ErrMalformed)
	}
	runtime.ReadMemStats(&after)
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20), "bytes allocated by 50 decodes")
}

var storedTag = []byte{0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd'}

func FuzzDecode(f *testing.F) {
	for _, c := range loadPayloadCases(f) {
		f.Add(c.Payload)
	}
	// The layouts the conformance data lacks: a batch as a map, and an
	// extension value in a field the decoder skips.
	mapBatch, err := msgpack.Marshal(map[string]any{"ts": 1.5, "data_parallel_rank": 1, "events": []any{
		map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{7}, "at": time.Unix(1, 2)}}})
	require.NoError(f, err)
	f.Add(mapBatch)
	// SGLang's: signed hashes, metadata, EAGLE pairs, the host tier.
	sglang, err := msgpack.Marshal([]any{1.5, []any{
		[]any{"BlockStored", []int64{-5, 9}, int64(-1), [][]int{{1, 2}, {2, 3}}, 1, nil, "CPU_PINNED", map[string]any{"cache_salt": "s"}},
		[]any{"BlockRemoved", []int64{-5}, "GPU"}}, 0})
	require.NoError(f, err)
	f.Add(sglang)
	d := NewDecoder()
	var b Batch
	f.Fuzz(func(t *testing.T, payload []byte) {
		err := d.Decode(payload, &b)
		if err != nil {
			require.ErrorIs(t, err, ErrMalformed)
			require.Empty(t, b.Events)
			return
		}
		for i := range b.Events {
			e := &b.Events[i]
			if e.Type == EventBlockStored && len(e.TokenIDs) > 0 {
				require.GreaterOrEqual(t, len(e.TokenIDs), len(e.BlockHashes)*e.BlockSize)
			}
			require.NotEmpty(t, e.Medium)
			for _, raw := range e.ExtraKeys.Or(nil) {
				if _, err := ExtraKeys(raw); err != nil {
					require.ErrorIs(t, err, ErrMalformed)
				}
			}
		}
	})
}

func TestDecodeReadsSignedHashesAsTheirBitPattern(t *testing.T) {
	// SGLang, TensorRT-LLM and Dynamo send int64 hashes: negative ones in
	// every integer width msgpack picks.
	hashes := []int64{-1, -32, -33, -129, -32769, -1 << 31, -1<<31 - 1, math.MinInt64, 5, math.MaxInt64}
	want := make([]uint64, len(hashes))
	for i, h := range hashes {
		want[i] = uint64(h)
	}
	array := []any{1.5, []any{
		[]any{"BlockStored", hashes, int64(-7), nil, 16, nil, "GPU"},
		[]any{"BlockRemoved", hashes},
	}}
	maps := []any{1.5, []any{
		map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": int64(math.MinInt64)},
		map[string]any{"type": "BlockRemoved", "block_hashes": hashes},
	}}
	tests := []struct {
		name   string
		batch  any
		parent uint64
	}{
		{"array layout", array, uint64(1<<64 - 7)},
		{"map layout", maps, 1 << 63},
	}
	d := NewDecoder()
	var b Batch
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			payload, err := msgpack.Marshal(tc.batch)
			require.NoError(t, err)
			require.NoError(t, d.Decode(payload, &b))
			require.Len(t, b.Events, 2)
			require.Equal(t, want, b.Events[0].BlockHashes)
			require.Equal(t, Some(tc.parent), b.Events[0].Parent)
			require.Equal(t, want, b.Events[1].BlockHashes)
		})
	}
}

func TestDecodeRefusesSignedValuesOutsideHashes(t *testing.T) {
	// Only hashes are bit patterns: a negative block size stays an error.
	payload, err := msgpack.Marshal([]any{1.5, []any{[]any{"BlockStored", []int64{-1}, nil, []int{1}, -1}}})
	require.NoError(t, err)
	require.ErrorIs(t, NewDecoder().Decode(payload, &Batch{}), ErrMalformed)
}

func TestDecodeReadsSGLangLayouts(t *testing.T) {
	// SGLang's msgspec structs, array_like: BlockStored is [tag, hashes,
	// parent, tokens, block_size, lora_id, medium], with metadata after
	// medium in BlockStoredWithMetadata; the batch is [ts, events, attn_dp_rank].
	salted := []any{"BlockStored", []int64{-5}, int64(-6), []int{1, 2}, 2, nil, "GPU", map[string]any{"cache_salt": "tenant-a"}}
	eagle := []any{"BlockStored", []int64{-5, 9}, nil, [][]int{{1, 2}, {2, 3}, {3, 4}, {4, 5}}, 2, nil, "GPU"}
	host := []any{"BlockStored", []int64{7}, nil, []int{1}, 1, nil, "CPU_PINNED"}
	removedHost := []any{"BlockRemoved", []int64{7}, "CPU_PINNED"}
	tests := []struct {
		name  string
		event any
		check func(t *testing.T, e *Event)
	}{
		{"BlockStoredWithMetadata", salted, func(t *testing.T, e *Event) {
			require.Equal(t, "tenant-a", e.CacheSalt)
			require.Empty(t, e.LoRAName)
			require.Equal(t, []uint32{1, 2}, e.TokenIDs)
		}},
		{"BlockStoredWithMetadata by name", map[string]any{"type": "BlockStored", "block_hashes": []int64{-5}, "token_ids": []int{1, 2},
			"block_size": 2, "metadata": map[string]any{"other": []int{1}, "cache_salt": "tenant-b"}}, func(t *testing.T, e *Event) {
			require.Equal(t, "tenant-b", e.CacheSalt)
		}},
		{"EAGLE token pairs", eagle, func(t *testing.T, e *Event) {
			require.True(t, e.Bigram)
			require.Equal(t, []uint32{1, 2, 3, 4}, e.TokenIDs)
			require.Equal(t, uint32(5), e.BigramNext)
		}},
		{"CPU_PINNED is the CPU tier", host, func(t *testing.T, e *Event) {
			require.Equal(t, "CPU", e.Medium)
		}},
		{"CPU_PINNED removal", removedHost, func(t *testing.T, e *Event) {
			require.Equal(t, "CPU", e.Medium)
			require.Equal(t, []uint64{7}, e.BlockHashes)
		}},
		{"a TensorRT-LLM v2_sha256 hex hash is its first 8 bytes", map[string]any{"type": "BlockRemoved",
			"block_hashes": []string{"80112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"}}, func(t *testing.T, e *Event) {
			require.Equal(t, []uint64{0x8011223344556677}, e.BlockHashes)
		}},
	}
	d := NewDecoder()
	var b Batch
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			payload, err := msgpack.Marshal([]any{1.5, []any{tc.event}, 1})
			require.NoError(t, err)
			require.NoError(t, d.Decode(payload, &b))
			require.Equal(t, Some(1), b.DPRank)
			require.Len(t, b.Events, 1)
			tc.check(t, &b.Events[0])
		})
	}
	// The next decode into the same batch starts clean.
	payload, err := msgpack.Marshal([]any{1.5, []any{[]any{"BlockStored", []int64{1}, nil, []int{1}, 1}}})
	require.NoError(t, err)
	require.NoError(t, d.Decode(payload, &b))
	require.False(t, b.Events[0].Bigram)
	require.Empty(t, b.Events[0].CacheSalt)
}

func TestDecodeRefusesMalformedSGLangFields(t *testing.T) {
	tests := []struct {
		name  string
		event any
	}{
		{"pairs that do not chain", []any{"BlockStored", []int64{1, 2}, nil, [][]int{{1, 2}, {3, 4}}, 1}},
		{"a pair of three", []any{"BlockStored", []int64{1}, nil, [][]int{{1, 2, 3}}, 1}},
		{"a pair with a negative token", []any{"BlockStored", []int64{1}, nil, [][]int{{1, -2}}, 1}},
		{"pairs mixed with tokens", []any{"BlockStored", []int64{1, 2}, nil, []any{[]int{1, 2}, 2}, 1}},
		{"a cache_salt that is no string", []any{"BlockStored", []int64{1}, nil, []int{1}, 1, nil, "GPU", map[string]any{"cache_salt": 5}}},
		{"a metadata map with a non-string key", []any{"BlockStored", []int64{1}, nil, []int{1}, 1, nil, "GPU", map[int]any{1: "x"}}},
	}
	d := NewDecoder()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			payload, err := msgpack.Marshal([]any{1.5, []any{tc.event}})
			require.NoError(t, err)
			require.ErrorIs(t, d.Decode(payload, &Batch{}), ErrMalformed)
		})
	}
}
