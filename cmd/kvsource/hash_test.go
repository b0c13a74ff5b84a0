package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/internal/testenv"
)

func runHashWith(args []string, stdin string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = runHash(args, strings.NewReader(stdin), &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestHashRejectsBadInputWithOneLineAndNoOutput(t *testing.T) {
	tests := []struct {
		name  string
		args  []string
		stdin string
		want  string // in the message
	}{
		{name: "word among tokens", stdin: "1 2 three", want: `token 3: "three" is not an integer`},
		{name: "fraction", stdin: "1.5", want: `token 1: "1.5" is not an integer`},
		{name: "exponent in JSON", stdin: "[1e3]", want: `token 1: "1e3" is not an integer`},
		{name: "negative", stdin: "5, -1", want: "token 2: -1 is negative"},
		{name: "negative in JSON", stdin: "[-7]", want: "token 1: -7 is negative"},
		{name: "above uint32", stdin: "4294967296", want: "token 1: 4294967296 is above the uint32 maximum 4294967295"},
		{name: "far above uint32", stdin: "[99999999999999999999999]", want: "is above the uint32 maximum"},
		{name: "string in JSON", stdin: `[1, "2"]`, want: `token 2: "\"2\"" is not an integer`},
		{name: "null in JSON", stdin: `[null]`, want: `token 1: "null" is not an integer`},
		{name: "nested JSON", stdin: `[[1]]`, want: `token 1: "[1]" is not an integer`},
		{name: "unterminated JSON", stdin: `[1, 2`, want: "not a JSON array of integers"},
		{name: "JSON object", stdin: `{"tokens": [1]}`, want: `token 1: "{\"tokens\":" is not an integer`},
		{name: "trailing data after JSON", stdin: `[1] 2`, want: "more after the JSON array"},
		{name: "two commas", stdin: "1,,2", want: "empty value after token 1"},
		{name: "trailing comma", stdin: "1, 2,", want: "empty value after token 2"},
		{name: "unknown algorithm", args: []string{"--algo", "md5"}, stdin: "1", want: `unknown --algo "md5"`},
		{name: "xxhash without seed", args: []string{"--algo", "xxhash"}, stdin: "1", want: "--algo xxhash needs --seed"},
		{name: "xxhash_cbor without seed", args: []string{"--algo", "xxhash_cbor"}, stdin: "1", want: "--algo xxhash_cbor needs --seed"},
		{name: "zero block size", args: []string{"--block-size", "0"}, stdin: "1", want: "--block-size 0: must be at least 1"},
		{name: "negative block size", args: []string{"--block-size", "-4"}, stdin: "1", want: "--block-size -4: must be at least 1"},
		{name: "block size not a number", args: []string{"--block-size", "x"}, stdin: "1", want: `invalid value "x" for flag -block-size`},
		{name: "mm without fields", args: []string{"--mm", "img"}, stdin: "1", want: `"img" is not ID:OFFSET:LENGTH`},
		{name: "mm with one field", args: []string{"--mm", "img:3"}, stdin: "1", want: `"img:3" is not ID:OFFSET:LENGTH`},
		{name: "mm empty id", args: []string{"--mm", ":1:2"}, stdin: "1", want: "empty identifier"},
		{name: "mm negative offset", args: []string{"--mm", "img:-1:2"}, stdin: "1", want: `offset "-1" is not a non-negative integer`},
		{name: "mm bad length", args: []string{"--mm", "img:1:two"}, stdin: "1", want: `length "two" is not a non-negative integer`},
		{name: "unknown output", args: []string{"--output", "hex"}, stdin: "1", want: `unknown --output "hex"`},
		{name: "unknown flag", args: []string{"--colour"}, stdin: "1", want: "flag provided but not defined: -colour"},
		{name: "positional argument", args: []string{"1", "2"}, stdin: "", want: `unexpected argument "1"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// With one-token blocks, the valid tokens before a bad one
			// would show as partial output if any were written.
			args := append([]string{"--block-size", "1"}, tt.args...)
			code, stdout, stderr := runHashWith(args, tt.stdin)
			require.NotZero(t, code)
			require.Empty(t, stdout)
			require.Contains(t, stderr, tt.want)
			require.True(t, strings.HasPrefix(stderr, "kvsource hash: "), stderr)
			require.Equal(t, 1, strings.Count(stderr, "\n"), "one line: %q", stderr)
			require.True(t, strings.HasSuffix(stderr, "\n"))
		})
	}
}

func TestHashAcceptsEveryTokenSyntax(t *testing.T) {
	args := []string{"--algo", "content", "--seed", "x", "--block-size", "1", "--output", "json"}
	code, want, stderr := runHashWith(args, "[1,2,3]")
	require.Zero(t, code, stderr)
	require.Equal(t, 3, strings.Count(want, "\n"))
	for _, stdin := range []string{"1 2 3", "1,2,3", "1, 2,\n3\n", "\t1\n2\r\n3", "[1,2,3]", " [ 1 , 2 , 3 ] \n", "1 2 3 4"} {
		t.Run(strconv.Quote(stdin), func(t *testing.T) {
			code, stdout, stderr := runHashWith(args, stdin)
			require.Zero(t, code, stderr)
			require.True(t, strings.HasPrefix(stdout, want), stdout)
		})
	}
}

func TestHashEmptySeedIsPythonHashSeedEmptyNotTheDefault(t *testing.T) {
	tokens := "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16"
	_, unset, _ := runHashWith(nil, tokens)
	_, deflt, _ := runHashWith([]string{"--seed", "vllm-none-hash"}, tokens)
	code, empty, stderr := runHashWith([]string{"--seed", ""}, tokens)
	require.Zero(t, code, stderr)
	require.Equal(t, deflt, unset)
	// CPython: sha256(pickle.dumps((sha256(pickle.dumps("", 5)), (1..16), None), 5)),
	// last 8 bytes; see hashing's TestEmptySeedHashesTheEmptyStringAsVLLMDoes.
	require.Equal(t, "16399262387974089072\n", empty)

	code, _, stderr = runHashWith([]string{"--algo", "xxhash"}, tokens)
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "needs --seed")
	code, _, stderr = runHashWith([]string{"--algo", "xxhash", "--seed", ""}, tokens)
	require.Zero(t, code, stderr, "PYTHONHASHSEED=\"\" is an explicit seed")
}

func TestHashSaysSoWhenThereIsNoFullBlockAndPrintsNoKey(t *testing.T) {
	for _, tc := range []struct {
		args  []string
		stdin string
		want  string
	}{
		{nil, "", "0 tokens make no full block of 16"},
		{nil, "  \n", "0 tokens make no full block of 16"},
		{nil, "[]", "0 tokens make no full block of 16"},
		{nil, "1 2 3", "3 tokens make no full block of 16"},
		{[]string{"--block-size", "4"}, "1 2 3", "3 tokens make no full block of 4"},
	} {
		code, stdout, stderr := runHashWith(tc.args, tc.stdin)
		require.Zero(t, code, stderr)
		require.Empty(t, stdout)
		require.Contains(t, stderr, tc.want)
	}
}

func TestHashMMIdentifierMayContainColons(t *testing.T) {
	code, stdout, stderr := runHashWith([]string{"--block-size", "2", "--output", "json", "--mm", "sha:ab:cd:1:2"}, "1 2 3 4")
	require.Zero(t, code, stderr)
	require.Contains(t, stdout, `"extra_keys":[["sha:ab:cd",1]]`)
	require.Contains(t, stdout, `"extra_keys":[["sha:ab:cd",-1]]`)
}

func TestHashHelpGoesToStdout(t *testing.T) {
	code, stdout, _ := runHashWith([]string{"--help"}, "")
	require.Zero(t, code)
	require.Contains(t, stdout, "usage: kvsource hash")
}

// hashVector is one line of ../shared/conformance/hash_vectors.jsonl.
type hashVector struct {
	Algo      string   `json:"algo"`
	Seed      string   `json:"seed"`
	BlockSize int      `json:"block_size"`
	Tokens    []uint32 `json:"tokens"`
	LoRAName  *string  `json:"lora_name"`
	CacheSalt *string  `json:"cache_salt"`
	MM        []struct {
		ID     string `json:"id"`
		Offset int    `json:"offset"`
		Length int    `json:"length"`
	} `json:"mm"`
	Blocks []struct {
		Digest    *string         `json:"digest"`
		Event     string          `json:"event"`
		ExtraKeys json.RawMessage `json:"extra_keys"`
	} `json:"blocks"`
}

func (v hashVector) args() []string {
	args := []string{"--algo", v.Algo, "--seed", v.Seed, "--block-size", strconv.Itoa(v.BlockSize)}
	if v.LoRAName != nil {
		args = append(args, "--lora-name", *v.LoRAName)
	}
	if v.CacheSalt != nil {
		args = append(args, "--cache-salt", *v.CacheSalt)
	}
	for _, m := range v.MM {
		args = append(args, "--mm", fmt.Sprintf("%s:%d:%d", m.ID, m.Offset, m.Length))
	}
	return args
}

func TestHashBinaryMatchesConformanceVectors(t *testing.T) {
	root := testenv.RepoRoot(t)
	bin := filepath.Join(t.TempDir(), "kvsource")
	build := exec.Command("go", "build", "-o", bin, "./cmd/kvsource")
	build.Dir = root
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)

	f, err := os.Open(testenv.Data(t, "conformance", "hash_vectors.jsonl"))
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 16<<20)
	n := 0
	for sc.Scan() {
		var v hashVector
		require.NoError(t, json.Unmarshal(sc.Bytes(), &v))
		tokens, err := json.Marshal(v.Tokens)
		require.NoError(t, err)
		run := func(output string) []string {
			cmd := exec.Command(bin, append([]string{"hash", "--output", output}, v.args()...)...)
			cmd.Stdin = bytes.NewReader(tokens)
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			stdout, err := cmd.Output()
			require.NoError(t, err, "vector %d: %s", n, stderr.String())
			if len(stdout) == 0 {
				return nil
			}
			return strings.Split(strings.TrimSuffix(string(stdout), "\n"), "\n")
		}
		events, digests, jsonLines := run("event"), run("digest"), run("json")
		require.Len(t, events, len(v.Blocks), "vector %d", n)
		require.Len(t, digests, len(v.Blocks), "vector %d", n)
		require.Len(t, jsonLines, len(v.Blocks), "vector %d", n)
		for i, want := range v.Blocks {
			require.Equal(t, want.Event, events[i], "vector %d block %d event", n, i)
			wantDigest := ""
			if want.Digest != nil {
				wantDigest = *want.Digest
			} else {
				ev, err := strconv.ParseUint(want.Event, 10, 64)
				require.NoError(t, err)
				wantDigest = fmt.Sprintf("%016x", ev)
			}
			require.Equal(t, wantDigest, digests[i], "vector %d block %d digest", n, i)
			var got struct {
				Block     int             `json:"block"`
				Event     string          `json:"event"`
				Digest    string          `json:"digest"`
				ExtraKeys json.RawMessage `json:"extra_keys"`
			}
			require.NoError(t, json.Unmarshal([]byte(jsonLines[i]), &got))
			require.Equal(t, i, got.Block)
			require.Equal(t, want.Event, got.Event)
			require.Equal(t, wantDigest, got.Digest)
			require.JSONEq(t, string(want.ExtraKeys), string(got.ExtraKeys), "vector %d block %d extra keys", n, i)
		}
		n++
	}
	require.NoError(t, sc.Err())
	require.Positive(t, n)
}
