package render

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
)

var bodySeeds = []string{
	`{}`,
	` { } `,
	`{"model":"m","prompt":"x"}`,
	`{"prompt":["a","b"],"model":null,"cache_salt":"s"}`,
	`{"model":"a","model":"b","messages":[]}`,
	`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}}]}],"cache_salt":"\u00e9\n"}`,
	`{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null}],"tools":[{"type":"function"}],"n":-1.5e+3}`,
	`{"mod\u0065l":"escaped name","prompt":"x"}`,
	`{"messages":[1,"x",[{"content":[]}],{"content":"s"}]}`,
	`{"x":[true,false,null,0,-0,1.0,1E2,"\"\\\/\b\f\n\r\t\u0041"]}`,
	`{"a":{"b":{"c":[[[[]]]]}}}`,
	`[]`, `{`, `{"a"}`, `{"a":}`, `{"a":1,}`, `{"a":01}`, `{"a":"x` + "\x01" + `"}`, `{"a":tru}`, `{"a":1}x`, `{"a":-}`, `{"a":1.}`, `{"a":1e}`, `{"a":"\u12"}`,
}

// TestScanBodyAgreesWithEncodingJSON checks the scanner against
// encoding/json, the reference: it accepts a body exactly when the body is
// a valid JSON object, and reads the same model, salt and parts.
func TestScanBodyAgreesWithEncodingJSON(t *testing.T) {
	for _, s := range bodySeeds {
		checkScan(t, []byte(s))
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 3000 {
		b := []byte(bodySeeds[rng.IntN(len(bodySeeds))])
		for range 1 + rng.IntN(3) {
			b = mutate(rng, b)
		}
		checkScan(t, b)
	}
}

func mutate(rng *rand.Rand, b []byte) []byte {
	const alphabet = `{}[]":,\ 0123456789-+.eEtrufalsn"abcdmodelcache_saltmessagescontent`
	b = bytes.Clone(b)
	switch i := rng.IntN(max(len(b), 1)); rng.IntN(3) {
	case 0:
		if len(b) > 0 {
			b = append(b[:i], b[i+1:]...)
		}
	case 1:
		b = append(b[:i], append([]byte{alphabet[rng.IntN(len(alphabet))]}, b[i:]...)...)
	default:
		if len(b) > 0 {
			b[i] = alphabet[rng.IntN(len(alphabet))]
		}
	}
	return b
}

func checkScan(t *testing.T, b []byte) {
	t.Helper()
	info, err := scanBody(b)
	var ref map[string]json.RawMessage
	refErr := json.Unmarshal(b, &ref)
	if refErr == nil && ref == nil {
		refErr = fmt.Errorf("null") // a null body is no object
	}
	if refErr != nil {
		require.Error(t, err, "%q: encoding/json says %v", b, refErr)
		return
	}
	if m, ok := ref["model"]; ok && !isStringOrNull(m) || !isStringOrNull(ref["cache_salt"]) {
		require.Error(t, err, "%q: a model or salt that is no string", b)
		return
	}
	require.NoError(t, err, "%q", b)
	require.Equal(t, jsonString(ref["model"]), info.model, "%q", b)
	require.Equal(t, jsonString(ref["cache_salt"]), info.salt, "%q", b)
	_, hasMessages := ref["messages"]
	require.Equal(t, hasMessages, info.messages, "%q", b)
	require.Equal(t, hasParts(ref["messages"]), info.parts, "%q", b)
	checkRewrite(t, b, &info)
}

func isStringOrNull(raw json.RawMessage) bool {
	var v any
	if raw == nil {
		return true
	}
	_ = json.Unmarshal(raw, &v)
	_, ok := v.(string)
	return ok || v == nil
}

func jsonString(raw json.RawMessage) string {
	var s string
	_ = json.Unmarshal(raw, &s)
	return s
}

func hasParts(raw json.RawMessage) bool {
	var msgs []json.RawMessage
	if json.Unmarshal(raw, &msgs) != nil {
		return false
	}
	for _, m := range msgs {
		var fields map[string]json.RawMessage
		if json.Unmarshal(m, &fields) != nil {
			continue
		}
		if c := bytes.TrimSpace(fields["content"]); len(c) > 0 && c[0] == '[' {
			return true
		}
	}
	return false
}

// checkRewrite checks that the body sent is valid JSON with every member of
// b kept, the model stamped and return_mm_kwargs false, with and without
// each splice.
func checkRewrite(t *testing.T, b []byte, info *bodyInfo) {
	t.Helper()
	var orig map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(b, &orig))
	for _, model := range []string{"", "base/model-7B", "<&>\"\\é"} {
		for _, omit := range []bool{false, true} {
			out := rewrite(b, info, model, omit)
			var got map[string]json.RawMessage
			require.NoError(t, json.Unmarshal(out, &got), "%q -> %q", b, out)
			for k, v := range orig {
				if (k == "model" && model != "") || (k == "return_mm_kwargs" && omit) {
					continue
				}
				require.JSONEq(t, string(v), string(got[k]), "%q -> %q: member %q", b, out, k)
			}
			if model != "" {
				require.Equal(t, model, jsonString(got["model"]), "%q -> %q", b, out)
			}
			if omit {
				require.Equal(t, "false", string(got["return_mm_kwargs"]), "%q -> %q", b, out)
			}
			if model == "" && !omit {
				require.Equal(t, b, out)
			}
			again, err := scanBody(out)
			require.NoError(t, err, "%q", out)
			if model != "" {
				require.Equal(t, model, again.model)
			}
		}
	}
}

func TestRewriteStampsEveryDuplicateModel(t *testing.T) {
	b := []byte(`{"model":"a", "x":1, "model" : "b"}`)
	info, err := scanBody(b)
	require.NoError(t, err)
	require.Equal(t, "b", info.model, "the last duplicate is the one vLLM reads")
	require.Equal(t, `{"model":"m", "x":1, "model" : "m","return_mm_kwargs":false}`, string(rewrite(b, &info, "m", true)))
	b = []byte(`{}`)
	info, err = scanBody(b)
	require.NoError(t, err)
	require.Equal(t, `{"model":"m","return_mm_kwargs":false}`, string(rewrite(b, &info, "m", true)))
	require.Equal(t, `{"model":"m"}`, string(rewrite(b, &info, "m", false)))
	require.Equal(t, `{"return_mm_kwargs":false}`, string(rewrite(b, &info, "", true)))
}

func TestScanBodyBoundsItsDepth(t *testing.T) {
	deep := `{"a":` + strings.Repeat("[", maxDepth+10) + strings.Repeat("]", maxDepth+10) + `}`
	_, err := scanBody([]byte(deep))
	require.ErrorContains(t, err, "nested deeper than 512")
	ok := `{"a":` + strings.Repeat("[", maxDepth-1) + strings.Repeat("]", maxDepth-1) + `}`
	_, err = scanBody([]byte(ok))
	require.NoError(t, err)
}

func FuzzScanBody(f *testing.F) {
	for _, s := range bodySeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if bytes.Count(b, []byte("["))+bytes.Count(b, []byte("{")) >= maxDepth {
			return // the reference nests deeper than the scanner takes
		}
		checkScan(t, b)
	})
}

var answerSeeds = []string{
	`{"token_ids":[1,2,3],"model":"m","cache_salt":"s","features":null}`,
	`{"token_ids":[1,2,3,4,5],"features":{"mm_hashes":{"image":["a","b"]},"mm_placeholders":{"image":[{"offset":3,"length":2},{"offset":0,"length":2}]},"kwargs_data":{"image":["QUFB",null]}}}`,
	`{"token_ids":[4294967295, 0 ,7],"features":{"mm_hashes":{"image":["a"],"audio":["b"]},"mm_placeholders":{"image":[{"offset":0,"length":1}],"audio":[{"offset":1,"length":2}]}}}`,
	`[{"token_ids":[1]},{"token_ids":[2,3],"cache_salt":null}]`,
	`{"token_ids":[-1]}`, `{"token_ids":[1.5]}`, `{"token_ids":[]}`, `[]`, `{}`, `{"token_ids":[1],"features":{"mm_hashes":{"x":["a"]},"mm_placeholders":{"x":[{"offset":0,"length":9}]}}}`,
	// kwargs_data, vLLM's processed tensors, before, between and after
	// the items, skipped however it nests and escapes.
	`{"features":{"kwargs_data":{"image":["QUFB\u0041\/","` + strings.Repeat("QUFB", 300) + `",null]},"mm_hashes":{"image":["h"]},"mm_metadata":{"image":[{"shape":[3,1024,1024],"dtype":"bfloat16"}]},"mm_placeholders":{"image":[{"offset":1,"length":2}]}},"token_ids":[7,8,9]}`,
	`{"token_ids":[1,2],"features":{"mm_hashes":{"image":["h"]},"mm_placeholders":{"image":[{"offset":0,"length":2}]},"kwargs_data":{"image":[{"pixel_values":[[0.5,-1e-3],[2E+2,0]],"grid":[1,2,3]}]}}}`,
	`{"token_ids":[1],"features":{"kwargs_data":{"image":["QUFB` + `\x` + `"]}}}`,
	`{"token_ids":[1],"features":{"kwargs_data":{"image":["QUFB"}}}`,
	`{"token_ids":[1],"features":{"kwargs_data":[[[[[[[[1]]]]]]]],"mm_hashes":null,"mm_placeholders":null}}`,
	`{"token_ids":[1],"features":{"mm_hashes":{"image":["a"]},"mm_hashes":{"audio":["b"]},"mm_placeholders":{"audio":[{"offset":0,"length":1}]}}}`,
	`[{"token_ids":[1],"features":{"kwargs_data":null}},{"token_ids":[2],"features":{"kwargs_data":{"video":["` + strings.Repeat("A", 100) + `"]}}}]`,
}

// FuzzParseAnswer checks that no answer panics the parser, and that what it
// accepts is what vLLM's validators accept and the hasher takes.
func FuzzParseAnswer(f *testing.F) {
	for _, s := range answerSeeds {
		f.Add([]byte(s), s[0] == '[')
	}
	h, err := hashing.New(hashing.Config{BlockSize: 2})
	require.NoError(f, err)
	f.Fuzz(func(t *testing.T, b []byte, array bool) {
		rs, err := parseAnswer(b, array)
		// Streamed through a window of a few bytes, every value crosses
		// refills: the answer is the same.
		small, smallErr := readAnswer(iotest.OneByteReader(bytes.NewReader(b)), array, make([]byte, 1+len(b)%7), 0, 0, nil)
		require.Equal(t, err == nil, smallErr == nil, "%v / %v", err, smallErr)
		if err != nil {
			require.ErrorIs(t, err, errAnswer)
			return
		}
		require.Equal(t, rs, small)
		require.NotEmpty(t, rs)
		var ref any
		require.NoError(t, json.Unmarshal(b, &ref), "accepted invalid JSON %q", b)
		for _, r := range rs {
			require.NotEmpty(t, r.Request.Tokens)
			end := 0
			for _, it := range r.Request.MM {
				require.GreaterOrEqual(t, it.Offset, end, "items sorted, not overlapping")
				require.Positive(t, it.Length)
				require.NotEmpty(t, it.ID)
				end = it.Offset + it.Length
			}
			require.LessOrEqual(t, end, len(r.Request.Tokens))
			_, err := h.BlockKeys(nil, r.Request)
			require.NoError(t, err)
		}
	})
}

func TestParseAnswerSeeds(t *testing.T) {
	rs, err := parseAnswer([]byte(answerSeeds[1]), false)
	require.NoError(t, err)
	require.Equal(t, []hashing.MMItem{{ID: "b", Offset: 0, Length: 2}, {ID: "a", Offset: 3, Length: 2}}, rs[0].Request.MM)
	rs, err = parseAnswer([]byte(answerSeeds[2]), false)
	require.NoError(t, err)
	require.Equal(t, []uint32{4294967295, 0, 7}, rs[0].Request.Tokens)
	require.Equal(t, []hashing.MMItem{{ID: "a", Offset: 0, Length: 1}, {ID: "b", Offset: 1, Length: 2}}, rs[0].Request.MM)
	rs, err = parseAnswer([]byte(answerSeeds[3]), true)
	require.NoError(t, err)
	require.Len(t, rs, 2)
	require.False(t, rs[1].saltEchoed, "a null salt is no salt")
	rs, err = parseAnswer([]byte(answerSeeds[10]), false)
	require.NoError(t, err)
	require.Equal(t, []uint32{7, 8, 9}, rs[0].Request.Tokens)
	require.Equal(t, []hashing.MMItem{{ID: "h", Offset: 1, Length: 2}}, rs[0].Request.MM, "kwargs_data and mm_metadata skipped")
	_, err = parseAnswer([]byte(answerSeeds[12]), false)
	require.ErrorContains(t, err, "invalid escape")
	_, err = parseAnswer([]byte(answerSeeds[13]), false)
	require.ErrorIs(t, err, errAnswer, "a skipped value is still validated")
	rs, err = parseAnswer([]byte(answerSeeds[15]), false)
	require.NoError(t, err)
	require.Equal(t, []hashing.MMItem{{ID: "b", Offset: 0, Length: 1}}, rs[0].Request.MM, "the last of duplicate members, as vLLM's parser")
}

// TestScanTokensAgreesWithEncodingJSON checks the token reader against
// encoding/json's []uint32 decoding on random arrays and their mutations.
func TestScanTokensAgreesWithEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for range 2000 {
		var sb strings.Builder
		sb.WriteString("[")
		for i := range rng.IntN(20) {
			if i > 0 {
				sb.WriteString([]string{",", ", ", " ,\n"}[rng.IntN(3)])
			}
			switch rng.IntN(8) {
			case 0:
				fmt.Fprint(&sb, uint64(1)<<32+rng.Uint64N(10))
			case 1:
				fmt.Fprint(&sb, -rng.IntN(5))
			case 2:
				sb.WriteString([]string{"1.0", "1e3", `"7"`, "null", "true", "01"}[rng.IntN(6)])
			default:
				fmt.Fprint(&sb, rng.Uint32())
			}
		}
		sb.WriteString("]")
		b := []byte(sb.String())
		if rng.IntN(4) == 0 {
			b = mutate(rng, b)
		}
		var want []uint32
		refErr := json.Unmarshal(b, &want)
		if refErr == nil && bytes.Contains(b, []byte("null")) {
			continue // encoding/json reads a null element as 0; vLLM never sends one
		}
		var raw json.RawMessage
		if json.Unmarshal(b, &raw) != nil {
			continue // the scanner only sees what encoding/json validated
		}
		// Through a window of a few bytes, so that numbers, separators and
		// white space cross its refills.
		p := &answerReader{r: bytes.NewReader(raw), buf: make([]byte, 1+rng.IntN(8))}
		got, err := p.tokens()
		if c, wsErr := p.ws(); err == nil && (wsErr != nil || c >= 0) {
			err = fmt.Errorf("data after the array")
		}
		if refErr != nil {
			require.Error(t, err, "%s", b)
			continue
		}
		require.NoError(t, err, "%s", b)
		if len(want) == 0 {
			require.Empty(t, got)
			continue
		}
		require.Equal(t, want, got, "%s", b)
	}
}

func TestSpecialFindsEveryByteThatEndsAStringRun(t *testing.T) {
	for pos := range 8 {
		for c := range 256 {
			var w [8]byte
			for i := range w {
				w[i] = 'A'
			}
			w[pos] = byte(c)
			want := c == '"' || c == '\\' || c < 0x20
			require.Equal(t, want, special(binary.LittleEndian.Uint64(w[:])), "byte %#02x at %d", c, pos)
		}
	}
}
