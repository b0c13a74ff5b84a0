package hashing

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/internal/testenv"
)

// vector is one line of ../shared/conformance/hash_vectors.jsonl.
type vector struct {
	Algo      Algo   `json:"algo"`
	Seed      string `json:"seed"`
	BlockSize int    `json:"block_size"`
	Tokens    []uint32
	LoRAName  *string `json:"lora_name"`
	CacheSalt *string `json:"cache_salt"`
	MM        []struct {
		ID     string `json:"id"`
		Offset int    `json:"offset"`
		Length int    `json:"length"`
	} `json:"mm"`
	NoneHash string `json:"none_hash"`
	Blocks   []struct {
		Digest    *string         `json:"digest"`
		Event     string          `json:"event"`
		ExtraKeys json.RawMessage `json:"extra_keys"`
	} `json:"blocks"`
}

func (v vector) name(i int) string {
	return fmt.Sprintf("%d/%s/bs%d/%dtok", i, v.Algo, v.BlockSize, len(v.Tokens))
}

func (v vector) request() Request {
	r := Request{Tokens: v.Tokens}
	if v.LoRAName != nil {
		r.LoRAName = *v.LoRAName
	}
	if v.CacheSalt != nil {
		r.CacheSalt = *v.CacheSalt
	}
	for _, m := range v.MM {
		r.MM = append(r.MM, MMItem{ID: m.ID, Offset: m.Offset, Length: m.Length})
	}
	return r
}

func vectorsPath(t testing.TB) string {
	return testenv.Data(t, "conformance", "hash_vectors.jsonl")
}

func loadVectors(t testing.TB) []vector {
	t.Helper()
	f, err := os.Open(vectorsPath(t))
	require.NoError(t, err)
	defer f.Close()
	var out []vector
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		var v vector
		require.NoError(t, json.Unmarshal(sc.Bytes(), &v))
		out = append(out, v)
	}
	require.NoError(t, sc.Err())
	require.NotEmpty(t, out)
	return out
}

// parseExtraJSON turns a vector's extra_keys (JSON arrays for tuples) into
// extra keys, nil for null.
func parseExtraJSON(t testing.TB, raw json.RawMessage) []ExtraKey {
	t.Helper()
	var v any
	require.NoError(t, json.Unmarshal(raw, &v))
	if v == nil {
		return nil
	}
	arr, ok := v.([]any)
	require.True(t, ok, "extra_keys %s is not an array", raw)
	return jsonKeys(t, arr)
}

func jsonKeys(t testing.TB, arr []any) []ExtraKey {
	out := make([]ExtraKey, 0, len(arr))
	for _, e := range arr {
		switch e := e.(type) {
		case string:
			out = append(out, Str(e))
		case float64:
			require.Equal(t, float64(int64(e)), e)
			out = append(out, Int(int64(e)))
		case []any:
			out = append(out, Tuple(jsonKeys(t, e)...))
		default:
			t.Fatalf("unexpected extra key %#v", e)
		}
	}
	return out
}

func TestConformanceVectorsThroughAPI(t *testing.T) {
	vs := loadVectors(t)
	seen := map[Algo]int{}
	for i, v := range vs {
		t.Run(v.name(i), func(t *testing.T) {
			h, err := New(Config{Algo: v.Algo, Seed: v.Seed, BlockSize: v.BlockSize})
			require.NoError(t, err)
			if v.Algo == SHA256CBOR64 {
				require.Equal(t, v.NoneHash, strconv.FormatUint(h.Root().Key(), 10), "none_hash")
			} else {
				require.Equal(t, v.NoneHash, h.Root().String(), "none_hash")
			}
			req := v.request()
			blocks, err := h.Blocks(nil, req)
			require.NoError(t, err)
			require.Len(t, blocks, len(v.Blocks))
			keys, err := h.BlockKeys(nil, req)
			require.NoError(t, err)
			require.Len(t, keys, len(v.Blocks))
			explicit := Request{Tokens: v.Tokens, Extra: make([][]ExtraKey, len(v.Blocks))}
			for j, want := range v.Blocks {
				b := blocks[j]
				require.Equal(t, want.Event, strconv.FormatUint(b.Key, 10), "block %d event", j)
				require.Equal(t, b.Key, keys[j], "block %d BlockKeys", j)
				if want.Digest == nil {
					require.Equal(t, SHA256CBOR64, v.Algo)
					require.Equal(t, 8, b.Digest.Len())
				} else {
					require.Equal(t, *want.Digest, b.Digest.String(), "block %d digest", j)
				}
				wantExtra := parseExtraJSON(t, want.ExtraKeys)
				require.True(t, EqualKeys(wantExtra, b.Extra), "block %d extra keys: want %v, got %v", j, wantExtra, b.Extra)
				js, err := json.Marshal(b.Extra)
				require.NoError(t, err)
				require.JSONEq(t, string(want.ExtraKeys), string(js), "block %d extra keys JSON", j)
				explicit.Extra[j] = wantExtra
			}
			fromExtra, err := h.BlockKeys(nil, explicit)
			require.NoError(t, err)
			require.Equal(t, keys, fromExtra, "explicit extra keys hash as the derived ones")
			seen[v.Algo]++
		})
	}
	for _, a := range Algos[:5] {
		require.Positive(t, seen[a], "no vector for %s", a)
	}
}
