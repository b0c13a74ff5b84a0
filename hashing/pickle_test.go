package hashing

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// pickleCase is a case of testdata/pickle_vectors.json (see gen_pickle.py).
type pickleCase struct {
	Name  string `json:"name"`
	Value struct {
		Str    *string         `json:"str"`
		Parent string          `json:"parent"`
		Tokens json.RawMessage `json:"tokens"`
		Extra  []any           `json:"extra"`
	} `json:"value"`
	Len    int    `json:"len"`
	SHA256 string `json:"sha256"`
	Hex    string `json:"hex"`
}

func loadPickleCases(t testing.TB) []pickleCase {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", "pickle_vectors.json"))
	require.NoError(t, err)
	var f struct{ Cases []pickleCase }
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	require.NoError(t, d.Decode(&f))
	require.NotEmpty(t, f.Cases)
	return f.Cases
}

func (c pickleCase) tokens(t testing.TB) []uint32 {
	var list []uint32
	if json.Unmarshal(c.Value.Tokens, &list) == nil {
		return list
	}
	var g struct{ N, A, B, M uint64 }
	require.NoError(t, json.Unmarshal(c.Value.Tokens, &g))
	list = make([]uint32, g.N)
	for i := range list {
		list[i] = uint32((g.A*uint64(i) + g.B) % g.M)
	}
	return list
}

func pickleKey(t testing.TB, v any) ExtraKey {
	switch v := v.(type) {
	case string:
		return Str(v)
	case json.Number:
		i, err := v.Int64()
		require.NoError(t, err)
		return Int(i)
	case []any:
		elems := make([]ExtraKey, len(v))
		for i, e := range v {
			elems[i] = pickleKey(t, e)
		}
		return Tuple(elems...)
	case map[string]any:
		if h, ok := v["hex"].(string); ok {
			b, err := hex.DecodeString(h)
			require.NoError(t, err)
			return Bytes(b)
		}
		if r, ok := v["str_repeat"].([]any); ok {
			n, err := r[1].(json.Number).Int64()
			require.NoError(t, err)
			return Str(strings.Repeat(r[0].(string), int(n)))
		}
		if r, ok := v["bytes_repeat"].([]any); ok {
			b, err := hex.DecodeString(r[0].(string))
			require.NoError(t, err)
			n, err := r[1].(json.Number).Int64()
			require.NoError(t, err)
			return Bytes(bytes.Repeat(b, int(n)))
		}
	}
	t.Fatalf("unknown key %#v", v)
	return ExtraKey{}
}

func TestPickleMatchesCPython(t *testing.T) {
	for _, c := range loadPickleCases(t) {
		t.Run(c.Name, func(t *testing.T) {
			var got []byte
			if c.Value.Str != nil {
				got = appendPickleValue(nil, *c.Value.Str)
			} else {
				pb, err := hex.DecodeString(c.Value.Parent)
				require.NoError(t, err)
				parent, err := DigestOf(pb)
				require.NoError(t, err)
				ex := &extraSource{explicit: true}
				for _, k := range c.Value.Extra {
					ex.keys = append(ex.keys, pickleKey(t, k))
				}
				got = appendPickleBlock(nil, &parent, c.tokens(t), ex)
			}
			if c.Hex != "" {
				require.Equal(t, c.Hex, hex.EncodeToString(got))
			}
			require.Equal(t, c.Len, len(got))
			sum := sha256.Sum256(got)
			require.Equal(t, c.SHA256, hex.EncodeToString(sum[:]))
		})
	}
}

func TestPickleAppendsAfterExistingBytes(t *testing.T) {
	prefix := []byte("keep")
	got := appendPickleValue(prefix, "12345")
	require.Equal(t, "keep", string(got[:4]))
	require.Equal(t, "80059509000000000000008c053132333435942e", hex.EncodeToString(got[4:]))
}
