package enginepub

import (
	"bufio"
	"encoding/json"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
)

// The model's keys are the engines' own: the vectors made by running
// SGLang's and TensorRT-LLM's hash code (hashing/testdata/engines).
func TestPodKeysAreTheEnginesOwn(t *testing.T) {
	f, err := os.Open("../../hashing/testdata/engines/engine_hash_vectors.jsonl")
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	checked := map[string]int{}
	for sc.Scan() {
		var v struct {
			Algo      string            `json:"algo"`
			BlockSize int               `json:"block_size"`
			Tokens    []uint32          `json:"tokens"`
			CacheSalt string            `json:"cache_salt"`
			Keys      []json.RawMessage `json:"keys"`
		}
		require.NoError(t, json.Unmarshal(sc.Bytes(), &v))
		cfg := Config{PageSize: v.BlockSize, CacheSalt: v.CacheSalt}
		switch v.Algo {
		case "sglang":
		case "sglang_eagle":
			cfg.EAGLE = true
		case "trtllm_v1_block_key":
			cfg.Engine = TRTLLM
		default:
			continue
		}
		var want []uint64
		for _, raw := range v.Keys {
			var s string
			if json.Unmarshal(raw, &s) == nil {
				k, err := strconv.ParseUint(s, 10, 64)
				require.NoError(t, err)
				want = append(want, k)
				continue
			}
			k, err := strconv.ParseInt(string(raw), 10, 64)
			require.NoError(t, err)
			want = append(want, uint64(k))
		}
		require.Equal(t, want, New(cfg).Keys(v.Tokens), "%s, page %d, %d tokens", v.Algo, v.BlockSize, len(v.Tokens))
		checked[v.Algo]++
	}
	require.NoError(t, sc.Err())
	require.Len(t, checked, 3)
}

func TestTRTLLMNumbersFromItsStartAndClearsFirst(t *testing.T) {
	p := New(Config{Engine: TRTLLM, PageSize: 2, Start: 1 << 62})
	p.Serve([]uint32{1, 2, 3, 4})
	seq, _ := p.Flush()
	require.Equal(t, uint64(1<<62), seq)
	hb, _ := p.Heartbeat()
	require.Equal(t, uint64(1<<62+1), hb)
	var got []uint64
	require.NoError(t, p.Replay(t.Context(), index.Holder{}, 0, func(seq uint64, _ []byte) bool {
		got = append(got, seq)
		return true
	}))
	require.Equal(t, []uint64{1 << 62, 1<<62 + 1}, got)
}
