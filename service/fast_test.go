package service

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
)

// oracleJSON is v as encoding/json's Encoder writes it, the encoding
// the hand-written answers must match byte for byte.
func oracleJSON(t *testing.T, v any) string {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, json.NewEncoder(&buf).Encode(v))
	return buf.String()
}

var trickyStrings = []string{
	"", "127.0.0.1:8001", "[fd00::2]:8000", `a"b\c`, "<script>&amp;", "tab\tnl\ncr\rbs\bff\f",
	"\x00\x01\x1f\x7f", "é中文🙂", "bad\xffutf8\xc3", "\u2028\u2029", "x-kv-cache-source-host-port",
}

func randString(r *rand.Rand) string {
	if r.IntN(2) == 0 {
		return trickyStrings[r.IntN(len(trickyStrings))]
	}
	b := make([]byte, r.IntN(12))
	for i := range b {
		b[i] = byte(r.IntN(256))
	}
	return string(b)
}

func randFloat(r *rand.Rand) float64 {
	switch r.IntN(6) {
	case 0:
		return 0
	case 1:
		return float64(r.IntN(5000))
	case 2:
		return r.Float64() * 1e-7
	case 3:
		return r.Float64() * 1e25
	case 4:
		return math.Ldexp(r.Float64(), r.IntN(2000)-1000)
	}
	return r.NormFloat64() * 100
}

func TestServeAnswersEncodeAsEncodingJSONDoes(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	reasons := []picker.Reason{picker.ReasonPull, picker.ReasonNoHolder, picker.ReasonSelf, picker.ReasonLocalHit, picker.ReasonBelowThreshold,
		picker.ReasonNoLiveSource}
	tierNames := []string{index.TierGPU, index.TierCPU, "DISK", "A", "Z", "gpu"}
	for iter := range 3000 {
		d := picker.Decision{
			Destination: index.Holder{Pod: randString(r), Rank: r.IntN(4)},
			Reason:      reasons[r.IntN(len(reasons))], Blocks: r.IntN(3000), BlockSize: 16,
			Cached: r.IntN(100), Gain: r.IntN(100), Best: r.IntN(100), Recompute: r.IntN(100),
			SavingMillis: randFloat(r),
		}
		if r.IntN(2) == 0 {
			// Holders passed over as no live source, as Pick reports them.
			d.Skipped, d.SkippedBest = 1+r.IntN(5), r.IntN(100)
			d.SkippedState = []string{"stale", "disconnected", "conflict", randString(r)}[r.IntN(4)]
		}
		var kv picker.KVTransferParams
		if d.Reason == picker.ReasonPull {
			d.Source = index.Holder{Pod: randString(r), Rank: r.IntN(4)}
			for range r.IntN(40) {
				d.Missing = append(d.Missing, r.Uint64()>>r.IntN(64))
			}
			kv = picker.KVTransferParams{RemoteKVSource: &picker.RemoteKVSource{
				KVRequestID: randString(r), RemoteHost: randString(r), RemotePort: r.IntN(70000)}}
		}
		a := pickAnswer{d: &d, kv: kv, saving: r.IntN(2) == 0, hint: randHintAnswer(r)}
		got, err := a.appendJSON(nil)
		require.NoError(t, err)
		resp, err := a.response()
		require.NoError(t, err)
		require.Equal(t, oracleJSON(t, resp), string(got), "pick %d", iter)

		sa := scoreAnswer{model: randString(r), blocks: r.IntN(3000)}
		for range r.IntN(5) {
			p := podScoreAnswer{holder: index.Holder{Pod: randString(r), Rank: r.IntN(3)},
				matched: r.IntN(100), score: randFloat(r)}
			for range r.IntN(4) {
				p.tiers = append(p.tiers, index.TierPrefix{Tier: tierNames[r.IntN(len(tierNames))], Blocks: r.IntN(100)})
			}
			sa.pods = append(sa.pods, p)
		}
		got, err = sa.appendJSON(nil)
		require.NoError(t, err)
		require.Equal(t, oracleJSON(t, sa.response()), string(got), "score %d", iter)
	}
}

func TestServeAnswersRefuseNonFiniteNumbers(t *testing.T) {
	for _, f := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		d := picker.Decision{Reason: picker.ReasonPull, SavingMillis: f}
		a := pickAnswer{d: &d, saving: true}
		_, err := a.appendJSON(nil)
		require.ErrorIs(t, err, errServeNonFinite)
		sa := scoreAnswer{pods: []podScoreAnswer{{score: f}}}
		_, err = sa.appendJSON(nil)
		require.ErrorIs(t, err, errServeNonFinite)
	}
}

// tokensB64 is tokens as a tokens_b64 value: base64 of little-endian uint32s.
func tokensB64(tokens []uint32) string {
	b := make([]byte, 4*len(tokens))
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(b[4*i:], t)
	}
	return base64.StdEncoding.EncodeToString(b)
}

func TestServeTakesTokensAsBase64AndAnswersAsForTheirJSON(t *testing.T) {
	s, base := startServe(t, "--events-bind", "tcp://127.0.0.1:0")
	tokens := make([]uint32, 40*16+5)
	for i := range tokens {
		tokens[i] = uint32(i*7919) % 152064
	}
	keys, err := s.hasher.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	feed := newServeFeeder(t, s)
	feed.store("127.0.0.1:8002", "m", "CPU", keys)
	feed.store("127.0.0.1:8001", "m", "GPU", keys[:10])
	for _, path := range []string{"/v1/score", "/v1/pick"} {
		plain := map[string]any{"model": "m", "tokens": tokens, "destination": "127.0.0.1:8001", "request_id": "r"}
		b64 := map[string]any{"model": "m", "tokens_b64": tokensB64(tokens), "destination": "127.0.0.1:8001", "request_id": "r"}
		if path == "/v1/score" {
			delete(plain, "destination")
			delete(plain, "request_id")
			delete(b64, "destination")
			delete(b64, "request_id")
		}
		code, want := call(t, "POST", base+path, plain)
		require.Equal(t, 200, code, "%s", want)
		code, got := call(t, "POST", base+path, b64)
		require.Equal(t, 200, code, "%s", got)
		require.JSONEq(t, string(want), string(got), path)
		if path == "/v1/pick" {
			require.Contains(t, string(got), `"reason":"pull"`)
		}
	}
	for _, tc := range []struct{ body, want string }{
		{`{"model":"m","tokens":[1],"tokens_b64":"AQAAAA=="}`, "both"},
		{`{"model":"m","tokens_b64":"AQAA"}`, "whole number"},
		{`{"model":"m","tokens_b64":"AQAAAA"}`, "padded"},
		{`{"model":"m","tokens_b64":"!!!!"}`, "tokens_b64"},
	} {
		code, body := call(t, "POST", base+"/v1/score", tc.body)
		require.Equal(t, 400, code, "%s", body)
		var e ErrorResponse
		require.NoError(t, json.Unmarshal(body, &e))
		require.True(t, strings.Contains(e.Error, "decoding request") && strings.Contains(e.Error, tc.want), "%s: %s", tc.body, e.Error)
	}
}

func TestServeAppendKeysWritesWhatStrconvWrites(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	edges := []uint64{0, 9, 10, 1e8 - 1, 1e8, 1e16 - 1, 1e16, 1e16 + 1, 1e17, 1e18, 1e19 - 1, 1e19, math.MaxUint64}
	for range 2000 {
		keys := make([]uint64, r.IntN(100))
		for i := range keys {
			keys[i] = r.Uint64() >> r.IntN(64)
			if r.IntN(10) == 0 {
				keys[i] = edges[r.IntN(len(edges))]
			}
		}
		var want []byte
		for i, k := range keys {
			if i > 0 {
				want = append(want, ',')
			}
			want = strconv.AppendQuote(want, strconv.FormatUint(k, 10))
		}
		prefix := randString(r)
		require.Equal(t, prefix+string(want), string(appendKeys([]byte(prefix), keys)))
	}
}

func TestServeDigits8WritesEveryValueAsEightDigits(t *testing.T) {
	check := func(v uint32) {
		var a [8]byte
		binary.LittleEndian.PutUint64(a[:], digits8(v))
		require.Equal(t, fmt.Sprintf("%08d", v), string(a[:]))
	}
	for v := uint32(0); v < 1e8; v += 97 {
		check(v)
	}
	for _, e := range []uint32{9, 10, 99, 100, 999, 1000, 9999, 10000, 99999, 100000, 999999, 1e6, 9999999, 1e7, 99999999} {
		check(e)
		check(e - 1)
	}
}
