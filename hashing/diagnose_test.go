package hashing

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDiagnoseNamesTheSettingThatDiffers(t *testing.T) {
	tokens := make([]uint32, 128)
	for i := range tokens {
		tokens[i] = uint32(1000 + 7*i)
	}
	tests := []struct {
		name     string
		engine   Config
		router   Config
		found    bool
		contains []string
	}{
		{name: "block size", engine: Config{BlockSize: 64}, router: Config{},
			found: true, contains: []string{"block size: the engine uses 64, the router 16", "--block-size 64"}},
		{name: "algorithm", engine: Config{Algo: SHA256CBOR}, router: Config{},
			found: true, contains: []string{"the engine hashes with sha256_cbor", "--algo sha256_cbor"}},
		{name: "empty seed", engine: Config{SeedSet: true}, router: Config{},
			found: true, contains: []string{`PYTHONHASHSEED=""`, "--seed ''"}},
		{name: "llm-d guide seed and block size", engine: Config{Seed: "0", BlockSize: 64}, router: Config{},
			found: true, contains: []string{`PYTHONHASHSEED="0"`, "--seed 0", "--block-size 64"}},
		{name: "router seed with another algorithm", engine: Config{Algo: XXHash, Seed: "s3cret"}, router: Config{Seed: "s3cret"},
			found: true, contains: []string{"--algo xxhash"}},
		{name: "random seed of an older engine", engine: Config{Seed: "\x8f\x11 random per-process bytes"}, router: Config{},
			found: false, contains: []string{DefaultSeedChange, "--keys content"}},
		{name: "settings agree", engine: Config{}, router: Config{},
			found: true, contains: []string{"extra keys"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			eh, err := New(tt.engine)
			require.NoError(t, err)
			bs := eh.Config().BlockSize
			keys, err := eh.BlockKeys(nil, Request{Tokens: tokens})
			require.NoError(t, err)
			keys = keys[:2]
			d := Diagnose(tt.router, bs, Request{Tokens: tokens[:2*bs]}, keys)
			require.Equal(t, tt.found, d.Reproduced)
			if tt.found {
				require.Equal(t, eh.Config(), d.Found)
			}
			msg := d.Explain("--keys content")
			for _, c := range tt.contains {
				require.Contains(t, msg, c)
			}
		})
	}
}

func TestDiagnoseWithoutKeysOrBlockSizeReproducesNothing(t *testing.T) {
	require.False(t, Diagnose(Config{}, 16, Request{Tokens: make([]uint32, 16)}, nil).Reproduced)
	require.False(t, Diagnose(Config{}, 0, Request{}, []uint64{1}).Reproduced)
	d := Diagnose(Config{Algo: "md5"}, 16, Request{Tokens: make([]uint32, 16)}, []uint64{1})
	require.False(t, d.Reproduced)
	require.Contains(t, d.Explain("--keys content"), "--keys content")
}

func TestDiagnoseNamesTheEngineWhoseKeysTheStreamCarries(t *testing.T) {
	tokens := make([]uint32, 129)
	for i := range tokens {
		tokens[i] = uint32(1000 + 7*i)
	}
	tests := []struct {
		engine   Config
		router   Config
		contains []string
	}{
		{Config{Algo: SGLang, BlockSize: 1}, Config{}, []string{"SGLang's sglang keys (block size 1), not vLLM's", "--algo sglang", "--block-size 1", "--keys content"}},
		{Config{Algo: SGLang, BlockSize: 16}, Config{}, []string{"SGLang's sglang keys", "--algo sglang "}},
		{Config{Algo: SGLangEAGLE, BlockSize: 16}, Config{}, []string{"SGLang's sglang_eagle keys", "--algo sglang_eagle"}},
		{Config{Algo: TRTV1, BlockSize: 32}, Config{}, []string{"TensorRT-LLM's trtllm_v1_block_key keys (block size 32)", "--algo trtllm_v1_block_key"}},
		{Config{Algo: TRTV2SHA256_64, BlockSize: 16}, Config{}, []string{"TensorRT-LLM's trtllm_v2_sha256_64 keys"}},
		{Config{Algo: SGLang, BlockSize: 16}, Config{Algo: SGLang, BlockSize: 1}, []string{"block size: the engine uses 16, the router 1"}},
		{Config{}, Config{Algo: SGLang, BlockSize: 16}, []string{"vLLM's sha256 keys (block size 16), not SGLang's"}},
	}
	for _, tt := range tests {
		t.Run(string(tt.engine.Algo)+"/"+string(tt.router.Algo), func(t *testing.T) {
			eh, err := New(tt.engine)
			require.NoError(t, err)
			bs := eh.Config().BlockSize
			keys, err := eh.BlockKeys(nil, Request{Tokens: tokens})
			require.NoError(t, err)
			d := Diagnose(tt.router, bs, Request{Tokens: tokens[:2*bs+1]}, keys[:2])
			require.True(t, d.Reproduced)
			require.Equal(t, eh.Config(), d.Found)
			msg := d.Explain("--keys content")
			for _, c := range tt.contains {
				require.Contains(t, msg, c)
			}
		})
	}
}
