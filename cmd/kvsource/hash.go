package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/internal/cliflag"
)

func init() {
	commands["hash"] = command{summary: "print a prompt's vLLM block hashes (tokens on stdin)", run: runHash}
}

const hashUsage = `usage: kvsource hash [--algo A] [--seed S] [--block-size N] [--lora-name L]
                     [--cache-salt S] [--mm ID:OFFSET:LENGTH]... [--output event|digest|json]
                     < tokens

Prints one line per full block of the prompt whose token ids are on stdin (a
JSON array, or integers separated by white space or commas), hashed as vLLM's
prefix cache does.

  --algo        sha256 (default), sha256_cbor, xxhash, xxhash_cbor,
                sha256_cbor_64bit, or content (kvsource's own keys)
  --seed        the engines' PYTHONHASHSEED (default: unset, which vLLM
                hashes as "vllm-none-hash"; required for xxhash and
                xxhash_cbor); --seed '' is PYTHONHASHSEED="", the empty
                string hashed as such
  --block-size  tokens per block (default 16)
  --lora-name   the request's LoRA adapter name
  --cache-salt  the request's cache_salt
  --mm          a multimodal item: identifier (may contain ':'), offset and
                length of its placeholder tokens; repeatable
  --output      event: the uint64 in KV events, in decimal (default);
                digest: the full digest in hex; json: {"block", "event"
                (decimal string), "digest", "extra_keys"} per line
`

// hashMMFlag collects --mm values.
type hashMMFlag []hashing.MMItem

func (f *hashMMFlag) String() string { return fmt.Sprint(*f) }

func (f *hashMMFlag) Set(v string) error {
	it, err := hashParseMM(v)
	if err != nil {
		return err
	}
	*f = append(*f, it)
	return nil
}

// hashParseMM parses ID:OFFSET:LENGTH; the identifier may contain ':'.
func hashParseMM(v string) (hashing.MMItem, error) {
	rest, lengthStr, ok1 := hashCutLast(v)
	id, offsetStr, ok2 := hashCutLast(rest)
	if !ok1 || !ok2 {
		return hashing.MMItem{}, fmt.Errorf("%q is not ID:OFFSET:LENGTH", v)
	}
	if id == "" {
		return hashing.MMItem{}, fmt.Errorf("%q has an empty identifier", v)
	}
	offset, err := strconv.ParseUint(offsetStr, 10, 31)
	if err != nil {
		return hashing.MMItem{}, fmt.Errorf("%q: offset %q is not a non-negative integer", v, offsetStr)
	}
	length, err := strconv.ParseUint(lengthStr, 10, 31)
	if err != nil {
		return hashing.MMItem{}, fmt.Errorf("%q: length %q is not a non-negative integer", v, lengthStr)
	}
	return hashing.MMItem{ID: id, Offset: int(offset), Length: int(length)}, nil
}

func hashCutLast(s string) (before, after string, ok bool) {
	i := strings.LastIndexByte(s, ':')
	if i < 0 {
		return "", "", false
	}
	return s[:i], s[i+1:], true
}

// runHash is kvsource hash. It writes nothing to stdout unless every input is
// valid and every block is hashed.
func runHash(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fail := func(code int, format string, a ...any) int {
		msg := strings.ReplaceAll(fmt.Sprintf(format, a...), "\n", " ")
		fmt.Fprintf(stderr, "kvsource hash: %s\n", msg)
		return code
	}
	fs := flag.NewFlagSet("hash", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	algo := fs.String("algo", string(hashing.SHA256), "")
	var seed cliflag.Seed
	fs.Var(&seed, "seed", "")
	blockSize := fs.Int("block-size", hashing.DefaultBlockSize, "")
	lora := fs.String("lora-name", "", "")
	salt := fs.String("cache-salt", "", "")
	output := fs.String("output", "event", "")
	var mm hashMMFlag
	fs.Var(&mm, "mm", "")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, hashUsage)
			return 0
		}
		return fail(2, "%v (see kvsource hash --help)", err)
	}
	if fs.NArg() > 0 {
		return fail(2, "unexpected argument %q: tokens are read from stdin", fs.Arg(0))
	}
	if *output != "event" && *output != "digest" && *output != "json" {
		return fail(2, "unknown --output %q (want event, digest or json)", *output)
	}
	if *blockSize < 1 {
		return fail(2, "--block-size %d: must be at least 1", *blockSize)
	}
	h, err := hashing.New(seed.Config(*algo, *blockSize))
	switch {
	case errors.Is(err, hashing.ErrUnknownAlgo):
		return fail(2, "unknown --algo %q (want one of %s)", *algo, hashAlgoList())
	case errors.Is(err, hashing.ErrSeedRequired):
		return fail(2, "--algo %s needs --seed: the engines' PYTHONHASHSEED (without it they hash with a random seed)", *algo)
	case err != nil:
		return fail(2, "%v", err)
	}
	input, err := io.ReadAll(stdin)
	if err != nil {
		return fail(1, "read stdin: %v", err)
	}
	tokens, err := hashParseTokens(input)
	if err != nil {
		return fail(1, "%v", err)
	}
	blocks, err := h.Blocks(nil, hashing.Request{Tokens: tokens, LoRAName: *lora, CacheSalt: *salt, MM: mm})
	if err != nil {
		return fail(1, "%v", err)
	}
	if len(blocks) == 0 {
		// Only full blocks are hashed and cached: say so rather than
		// print nothing, which reads as a failure. stdout stays empty,
		// the answer for scripts: no block.
		fmt.Fprintf(stderr, "kvsource hash: %d tokens make no full block of %d: nothing to hash (vLLM caches full blocks only)\n", len(tokens), *blockSize)
		return 0
	}
	var out bytes.Buffer
	for i, b := range blocks {
		switch *output {
		case "event":
			out.WriteString(strconv.FormatUint(b.Key, 10))
		case "digest":
			out.WriteString(b.Digest.String())
		case "json":
			line, err := json.Marshal(hashJSONBlock{
				Block: i, Event: strconv.FormatUint(b.Key, 10), Digest: b.Digest.String(), ExtraKeys: b.Extra,
			})
			if err != nil {
				return fail(1, "encode block %d: %v", i, err)
			}
			out.Write(line)
		}
		out.WriteByte('\n')
	}
	if _, err := stdout.Write(out.Bytes()); err != nil {
		return fail(1, "write output: %v", err)
	}
	return 0
}

type hashJSONBlock struct {
	Block     int                `json:"block"`
	Event     string             `json:"event"`
	Digest    string             `json:"digest"`
	ExtraKeys []hashing.ExtraKey `json:"extra_keys"`
}

func hashAlgoList() string {
	var names []string
	for _, a := range append(slices.Clone(hashing.Algos), hashing.EngineAlgos...) {
		names = append(names, string(a))
	}
	return strings.Join(names, ", ")
}

// hashParseTokens parses a JSON array of integers, or integers separated by
// white space or commas.
func hashParseTokens(input []byte) ([]uint32, error) {
	text := bytes.TrimSpace(input)
	if len(text) > 0 && text[0] == '[' {
		return hashParseJSONTokens(text)
	}
	var tokens []uint32
	if len(text) == 0 {
		return nil, nil
	}
	for _, part := range bytes.Split(text, []byte(",")) {
		fields := bytes.Fields(part)
		if len(fields) == 0 {
			return nil, fmt.Errorf("empty value after token %d: two commas in a row, or a comma at an end", len(tokens))
		}
		for _, f := range fields {
			t, err := hashParseToken(string(f), len(tokens)+1)
			if err != nil {
				return nil, err
			}
			tokens = append(tokens, t)
		}
	}
	return tokens, nil
}

func hashParseJSONTokens(text []byte) ([]uint32, error) {
	dec := json.NewDecoder(bytes.NewReader(text))
	var raw []json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("stdin is not a JSON array of integers: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("stdin has more after the JSON array")
	}
	tokens := make([]uint32, len(raw))
	for i, r := range raw {
		t, err := hashParseToken(string(r), i+1)
		if err != nil {
			return nil, err
		}
		tokens[i] = t
	}
	return tokens, nil
}

// hashParseToken parses the n-th token (1-based), naming the problem.
func hashParseToken(s string, n int) (uint32, error) {
	v, err := strconv.ParseUint(s, 10, 32)
	if err == nil {
		return uint32(v), nil
	}
	digits := strings.TrimPrefix(s, "-")
	switch {
	case hashIsDigits(digits) && strings.Trim(digits, "0") == "":
		return 0, nil // -0
	case hashIsDigits(digits) && digits != s:
		return 0, fmt.Errorf("token %d: %s is negative", n, s)
	case hashIsDigits(s):
		return 0, fmt.Errorf("token %d: %s is above the uint32 maximum %d", n, s, uint32(1<<32-1))
	}
	if len(s) > 40 {
		s = s[:40] + "..."
	}
	return 0, fmt.Errorf("token %d: %q is not an integer", n, s)
}

func hashIsDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
