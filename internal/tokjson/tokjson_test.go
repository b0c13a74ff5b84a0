package tokjson

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// pickBody has the shape of kvsource serve's /v1/pick and /v1/score
// request bodies.
type pickBody struct {
	Model     string   `json:"model"`
	Tokens    []uint32 `json:"tokens"`
	LoRAName  string   `json:"lora_name"`
	CacheSalt string   `json:"cache_salt"`
	MMItems   []struct {
		ID     string `json:"id"`
		Offset int    `json:"offset"`
		Length int    `json:"length"`
	} `json:"mm_items"`
	Pods        []string `json:"pods"`
	RequestID   string   `json:"request_id"`
	Destination string   `json:"destination"`
	Candidates  []struct {
		Pod     string  `json:"pod"`
		DPRank  *int    `json:"dp_rank"`
		Waiting int     `json:"waiting"`
		Load    float64 `json:"load"`
	} `json:"candidates"`
	MinCachedTokenDelta *int `json:"min_cached_token_delta"`
}

// oracle decodes data as kvsource serve does with encoding/json: one object
// into a fresh struct, unknown fields refused, nothing but white space after.
func oracle(data []byte) (pickBody, error) {
	var v pickBody
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		return v, err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return v, errors.New("trailing data")
	}
	return v, nil
}

func fast(data []byte, dst []uint32) (pickBody, error) {
	var v pickBody
	tokens, err := Unmarshal(data, &v, dst)
	v.Tokens = tokens
	return v, err
}

// requireSameAsOracle checks that Unmarshal and encoding/json agree on data:
// the same value, or both an error.
func requireSameAsOracle(t testing.TB, data []byte, dst []uint32) {
	want, wantErr := oracle(data)
	got, err := fast(data, dst)
	if isB64Unknown(wantErr) {
		return // the compact encoding, which encoding/json does not know
	}
	if wantErr != nil || err != nil {
		require.Equal(t, wantErr != nil, err != nil, "input %q: encoding/json error %v, tokjson error %v", data, wantErr, err)
		return
	}
	require.Equal(t, want, got, "input %q", data)
	require.Equal(t, want.Tokens == nil, got.Tokens == nil, "input %q: nil tokens", data)
}

// isB64Unknown reports whether err is encoding/json refusing a tokens_b64
// member as an unknown field.
func isB64Unknown(err error) bool {
	if err == nil {
		return false
	}
	_, q, ok := strings.Cut(err.Error(), "json: unknown field ")
	if !ok {
		return false
	}
	name, uerr := strconv.Unquote(q)
	return uerr == nil && strings.EqualFold(name, TokensB64Member)
}

var seedBodies = []string{
	`{"model":"m","tokens":[1,2,3]}`,
	`{"model":"m","tokens":[]}`,
	`{"model":"m","tokens":null}`,
	`{"model":"m"}`,
	`{}`,
	`null`,
	` null `,
	`  {"tokens" : [ 0 , 4294967295 ] }  `,
	"{\"tokens\":[1,\n2,\t3\r]}",
	`{"tokens":[4294967296]}`,
	`{"tokens":[99999999999999999999999]}`,
	`{"tokens":[-1]}`,
	`{"tokens":[-0]}`,
	`{"tokens":[1.0]}`,
	`{"tokens":[1e3]}`,
	`{"tokens":[1E3]}`,
	`{"tokens":[01]}`,
	`{"tokens":[00]}`,
	`{"tokens":[1,]}`,
	`{"tokens":[,1]}`,
	`{"tokens":[1 2]}`,
	`{"tokens":[1,null,2]}`,
	`{"tokens":[nul]}`,
	`{"tokens":["1"]}`,
	`{"tokens":[true]}`,
	`{"tokens":[[1]]}`,
	`{"tokens":{"a":1}}`,
	`{"tokens":"abc"}`,
	`{"tokens":[1,2`,
	`{"tokens":[1,2]`,
	`{"tokens":[1,2]}}`,
	`{"tokens":[1,2]} {}`,
	`{"tokens":[1,2]} x`,
	`{"tokens":[1,2],}`,
	`{"tokens":[1,2],"tokens":[3]}`,
	`{"tokens":[1,2],"tokens":[null]}`,
	`{"tokens":[1,2],"tokens":null}`,
	`{"tokens":null,"tokens":[null]}`,
	`{"tokens":[1,2],"tokens":[]}`,
	`{"Tokens":[7]}`,
	`{"TOKENS":[7]}`,
	"{\"to\u212Aens\":[7]}",
	`{"tok\u0065ns":[7]}`,
	`{"tok\u0065ns":[7],"model":"\u00e9"}`,
	`{"tokens":[7],"unknown":1}`,
	`{"model":1,"tokens":[7]}`,
	`{"model":"a","model":"b","tokens":[7]}`,
	`{"model":"a\"},\"tokens\":[9]","tokens":[7]}`,
	`{"mm_items":[{"id":"x","offset":2,"length":3}],"tokens":[1],"lora_name":"l","cache_salt":"s"}`,
	`{"candidates":[{"pod":"a:1","dp_rank":null,"waiting":1,"load":0.5}],"min_cached_token_delta":3,"tokens":[1]}`,
	`{"pods":["a","b"],"tokens":[1]}`,
	`{"model":"m",}`,
	`{"model" "m"}`,
	`{model:"m"}`,
	`{"model":}`,
	`{"model":"m"`,
	`{"mod`,
	`[1,2]`,
	`"tokens"`,
	`7`,
	``,
	`   `,
	"\xef\xbb\xbf{}",
	`{"tokens":[1],"model":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}`,
	`{"tokens":[` + strings.Repeat("[", 20000) + `]}`,
	`{"model":` + strings.Repeat("[", 20000) + strings.Repeat("]", 20000) + `,"tokens":[1]}`,
	`{"model":"` + "\x01" + `","tokens":[1]}`,
	`{"mo` + "\x01" + `del":"m","tokens":[1]}`,
	`{"model":"m","tokens":[1],"model":"\ud800"}`,
	`{"tokens":[1],"tokens_b64":"AQAAAA=="}`,
}

func TestUnmarshalAgreesWithEncodingJSON(t *testing.T) {
	for _, body := range seedBodies {
		t.Run(strconv.Quote(body[:min(len(body), 40)]), func(t *testing.T) {
			requireSameAsOracle(t, []byte(body), nil)
			requireSameAsOracle(t, []byte(body), []uint32{9, 9, 9, 9})
		})
	}
}

func TestUnmarshalAgreesWithEncodingJSONOnRandomPrompts(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	dst := make([]uint32, 0, 8)
	for range 500 {
		var b strings.Builder
		b.WriteString(`{"model":"m",`)
		b.WriteString(`"tokens":[`)
		for j := range r.IntN(100) {
			if j > 0 {
				b.WriteString([]string{",", ", ", " ,\n"}[r.IntN(3)])
			}
			b.WriteString(strconv.FormatUint(uint64(r.Uint32()>>r.IntN(32)), 10))
		}
		b.WriteString(`],"request_id":"r"}`)
		requireSameAsOracle(t, []byte(b.String()), dst)
	}
}

func b64(tokens []uint32) string {
	raw := make([]byte, 0, 4*len(tokens))
	for _, t := range tokens {
		raw = binary.LittleEndian.AppendUint32(raw, t)
	}
	return base64.StdEncoding.EncodeToString(raw)
}

func TestUnmarshalSaysATokenWithAFractionOrExponentIsNoInteger(t *testing.T) {
	type req struct {
		Tokens []uint32 `json:"tokens"`
	}
	for _, body := range []string{`{"tokens":[1.5]}`, `{"tokens":[7,1e3]}`, `{"tokens":[2E1]}`} {
		_, err := Unmarshal([]byte(body), &req{}, nil)
		require.ErrorIs(t, err, ErrSyntax, body)
		require.ErrorContains(t, err, "tokens must be integers from 0 to 4294967295, without a fraction or exponent", body)
	}
}

func TestTokensB64DecodesLittleEndianUint32s(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{0, 1, 2, 3, 191, 192, 193, 255, 256, 257, 1000, 20000} {
		tokens := make([]uint32, n)
		for i := range tokens {
			tokens[i] = r.Uint32()
		}
		body := fmt.Sprintf(`{"model":"m","tokens_b64":%q}`, b64(tokens))
		var v pickBody
		got, err := Unmarshal([]byte(body), &v, nil)
		require.NoError(t, err, n)
		require.Equal(t, tokens, got, n)
		require.NotNil(t, got)
		require.Equal(t, "m", v.Model)
	}
}

func TestTokensB64RejectsMalformedValues(t *testing.T) {
	long := b64(make([]uint32, 300))
	tests := []struct{ name, value string }{
		{"not a string", `123`},
		{"not a whole uint32", `"AQID"`},
		{"unpadded", `"AQAAAA"`},
		{"bad alphabet", `"AQ-_AA=="`},
		{"padding inside", `"AA==` + long + `"`},
		{"json escape", `"AQAA\u0041A=="`},
		{"raw newline", "\"AQAA\nAAA=\""},
		{"unterminated", `"AQAAAA==`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var v pickBody
			_, err := Unmarshal([]byte(`{"tokens_b64":`+tt.value+`}`), &v, nil)
			require.ErrorIs(t, err, ErrSyntax)
		})
	}
	var v pickBody
	_, err := Unmarshal([]byte(`{"tokens":[1],"tokens_b64":"AQAAAA=="}`), &v, nil)
	require.ErrorIs(t, err, ErrSyntax, "both encodings at once")
	tokens, err := Unmarshal([]byte(`{"tokens_b64":null}`), &v, nil)
	require.NoError(t, err)
	require.Nil(t, tokens)
}

func TestUnmarshalReusesDstWithoutAllocating(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector drops sync.Pool items on purpose")
	}
	body := []byte(`{"tokens":[` + strings.Repeat("151000,", 999) + `7]}`)
	b64body := []byte(`{"tokens_b64":"` + b64(make([]uint32, 1000)) + `"}`)
	dst := make([]uint32, 0, 1000)
	var v pickBody
	allocs := testing.AllocsPerRun(100, func() {
		out, err := Unmarshal(body, &v, dst)
		if err != nil || len(out) != 1000 || &out[0] != &dst[:1][0] {
			t.Fatal("tokens not decoded into dst")
		}
		if _, err := Unmarshal(b64body, &v, dst); err != nil {
			t.Fatal(err)
		}
	})
	require.Zero(t, allocs)
}

func FuzzUnmarshal(f *testing.F) {
	for _, body := range seedBodies {
		if len(body) < 1024 { // minimising inputs grown from the 20,000-deep seeds is slow
			f.Add([]byte(body))
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		requireSameAsOracle(t, data, []uint32{5, 5})
	})
}

// BenchmarkDecode decodes a 20,000-token pick body (tokens of a 152,064
// vocabulary, a model, a request id and eight candidates) with Unmarshal,
// and "b64" the same request with tokens_b64. Each iteration also decodes
// the JSON body with encoding/json as kvsource serve does today, right
// after: the machine's load falls on both alike, and x-encoding/json is the
// ratio of their times.
func BenchmarkDecode(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	tokens := make([]uint32, 20000)
	for i := range tokens {
		tokens[i] = uint32(r.IntN(152064))
	}
	var cands strings.Builder
	for i := range 8 {
		if i > 0 {
			cands.WriteString(",")
		}
		fmt.Fprintf(&cands, `{"pod":"10.0.0.%d:8000","waiting":%d,"load":0.%d}`, i, i, i)
	}
	ids, _ := json.Marshal(tokens)
	body := []byte(fmt.Sprintf(`{"model":"qwen","request_id":"req-1","tokens":%s,"candidates":[%s]}`, ids, cands.String()))
	b64body := []byte(fmt.Sprintf(`{"model":"qwen","request_id":"req-1","tokens_b64":%q,"candidates":[%s]}`, b64(tokens), cands.String()))
	for _, c := range []struct {
		name string
		body []byte
	}{{"tokjson", body}, {"b64", b64body}} {
		b.Run(c.name, func(b *testing.B) {
			dst := make([]uint32, 0, len(tokens))
			var fastT, baseT time.Duration
			for b.Loop() {
				t0 := time.Now()
				var v pickBody
				out, err := Unmarshal(c.body, &v, dst)
				t1 := time.Now()
				if err != nil || len(out) != len(tokens) {
					b.Fatal(err)
				}
				if _, err := oracle(body); err != nil {
					b.Fatal(err)
				}
				baseT += time.Since(t1)
				fastT += t1.Sub(t0)
			}
			b.ReportMetric(float64(fastT.Nanoseconds())/float64(b.N), "ns/decode")
			b.ReportMetric(float64(baseT.Nanoseconds())/float64(b.N), "ns/encoding-json")
			b.ReportMetric(float64(fastT)/float64(baseT), "x-encoding/json")
			b.ReportMetric(float64(fastT.Nanoseconds())/float64(b.N*len(tokens)), "ns/token")
			b.ReportMetric(float64(len(c.body)), "body-bytes")
		})
	}
	b.Run("allocs", func(b *testing.B) {
		dst := make([]uint32, 0, len(tokens))
		b.ReportAllocs()
		for b.Loop() {
			var v pickBody
			if _, err := Unmarshal(body, &v, dst); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestUnmarshalAgreesWithEncodingJSONOnMutatedSeeds is a deterministic
// differential run over mutations of the seed bodies, for what the fuzzer
// finds when it runs.
func TestUnmarshalAgreesWithEncodingJSONOnMutatedSeeds(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	pieces := []string{"[", "]", "{", "}", ",", ":", `"`, `\`, "null", "0", "1", "-", ".", "e", " ", "\n", `"tokens"`, `"model"`, "4294967295", "4294967296", `\u0041`, "\xff", "\x00"}
	for range 20000 {
		b := []byte(seedBodies[r.IntN(len(seedBodies))])
		if len(b) > 1024 {
			continue
		}
		for range 1 + r.IntN(4) {
			p := r.IntN(len(b) + 1)
			switch r.IntN(3) {
			case 0: // insert
				b = append(b[:p], append([]byte(pieces[r.IntN(len(pieces))]), b[p:]...)...)
			case 1: // delete
				if p < len(b) {
					b = append(b[:p], b[p+1:]...)
				}
			default: // replace
				if p < len(b) {
					b[p] = pieces[r.IntN(len(pieces))][0]
				}
			}
		}
		requireSameAsOracle(t, b, []uint32{5, 5})
	}
}

// TestSwarDigitsAgreesWithAByteWiseScan checks the 8-byte digit reader on
// random bytes, biased to digits, against reading one byte at a time.
func TestSwarDigitsAgreesWithAByteWiseScan(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	var b [8]byte
	for range 1_000_000 {
		for j := range b {
			if r.IntN(4) == 0 {
				b[j] = byte(r.IntN(256))
			} else {
				b[j] = '0' + byte(r.IntN(10))
			}
		}
		l, v := 0, uint32(0)
		for l < 8 && b[l] >= '0' && b[l] <= '9' {
			v = v*10 + uint32(b[l]-'0')
			l++
		}
		if l == 8 {
			l, v = 0, 0
		}
		gv, gl := swarDigits(binary.LittleEndian.Uint64(b[:]))
		require.Equal(t, l, gl, "%q", b)
		require.Equal(t, v, gv, "%q", b)
	}
}
