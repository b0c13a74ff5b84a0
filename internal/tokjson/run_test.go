package tokjson

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// runElements are the elements randomRunArray draws from besides plain
// tokens: what the run scanner must leave to the per-token scanner.
var runElements = []string{
	"0", "00", "01", "0123", "-1", "-0", "1.5", "1e3", "1E3", "null", "nul", `"7"`, "true", "[1]",
	"", "4294967295", "4294967296", "99999999999", "12345678", "123456789", "0000000012",
}

// runSeparators are the separators it draws from: mostly the two the run
// scanner takes.
var runSeparators = []string{",", ",", ",", ",", ", ", ", ", " ,", ",  ", ",\n", ",\t", ",\r\n ", " ", ",,", ", ,"}

// randomRunArray returns a tokens array of n elements: tokens of 1 to 10
// digits, and with probability irregular per element something else from
// runElements, per separator one of the other runSeparators; unterminated
// now and then.
func randomRunArray(r *rand.Rand, n int, irregular float64) []byte {
	b := []byte{'['}
	for j := range n {
		if j > 0 {
			sep := runSeparators[r.IntN(2)*4]
			if r.Float64() < irregular {
				sep = runSeparators[r.IntN(len(runSeparators))]
			}
			b = append(b, sep...)
		}
		if r.Float64() < irregular {
			b = append(b, runElements[r.IntN(len(runElements))]...)
			continue
		}
		digits := 1 + r.IntN(10)
		if r.IntN(4) > 0 {
			digits = 1 + r.IntN(6) // the usual vocabulary
		}
		b = strconv.AppendUint(b, randomDigits(r, digits), 10)
	}
	if r.IntN(20) > 0 {
		b = append(b, ']')
	}
	return b
}

// randomDigits returns a random number of exactly d digits.
func randomDigits(r *rand.Rand, d int) uint64 {
	if d == 1 {
		return r.Uint64N(10)
	}
	return pow10(d-1) + r.Uint64N(pow10(d)-pow10(d-1))
}

func pow10(n int) uint64 {
	p := uint64(1)
	for range n {
		p *= 10
	}
	return p
}

// runBody puts array into a request body whose tokens array starts shift
// bytes further on, so that the run scanner's blocks fall anywhere in it;
// the members after it hold commas, which the run must not take.
func runBody(shift int, array []byte) ([]byte, int) {
	head := `{"tokens":` + strings.Repeat(" ", shift)
	return []byte(head + string(array) + `,"model":"m,1,2,3","request_id":"` + strings.Repeat("9,", 40) + `"}`), len(head)
}

// requireSameAsPerToken requires scanTokens to give what the per-token
// scanner gives at data[i]: the same tokens, end offset and error, with no
// earlier tokens member and with one (whose elements a null keeps).
func requireSameAsPerToken(t testing.TB, data []byte, i int) {
	for _, prevLen := range []int{0, 300} {
		prev := make([]uint32, prevLen, prevLen+7)
		for j := range prev {
			prev[j] = uint32(1000 + j)
		}
		prevCopy := append([]uint32(nil), prev...)
		dst := []uint32{5, 5}
		want, wantEnd, wantErr := scanTokensPerToken(data, i, append([]uint32(nil), dst...), prevCopy)
		got, gotEnd, err := scanTokens(data, i, dst, prev)
		require.Equal(t, fmt.Sprint(wantErr), fmt.Sprint(err), "input %q", data)
		require.Equal(t, wantEnd, gotEnd, "input %q", data)
		require.Equal(t, want, got, "input %q", data)
		require.Equal(t, want == nil, got == nil, "input %q", data)
	}
}

func TestScanTokensAgreesWithThePerTokenScannerOnRandomArrays(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	for round := range 6000 {
		irregular := []float64{0, 0.001, 0.01, 0.05, 0.3}[round%5]
		array := randomRunArray(r, 1+r.IntN(120), irregular)
		body, i := runBody(r.IntN(64), array)
		requireSameAsPerToken(t, body, i)
		requireSameAsOracle(t, body, []uint32{5, 5})
	}
}

// TestScanTokensAgreesWithThePerTokenScannerAtEveryBlockOffset puts each
// irregular element and separator at every offset of a block, after a
// run of clean tokens, and the array at every start offset of a block.
func TestScanTokensAgreesWithThePerTokenScannerAtEveryBlockOffset(t *testing.T) {
	clean := strings.Repeat("123456,7,89,", 12)
	for _, odd := range append(append([]string{}, runElements...), runSeparators...) {
		for pos := range 2 * runBlock {
			pre := clean[:pos]
			if strings.HasSuffix(pre, ",") || pre == "" {
				pre += "4"
			}
			for _, array := range []string{
				"[" + pre + "," + odd + "," + clean + "5]",
				"[" + pre + odd + "," + clean + "5]",
				"[" + pre + odd + "4," + clean + "5]",
			} {
				for _, shift := range []int{0, 1, 7, 8, 63} {
					body, i := runBody(shift, []byte(array))
					requireSameAsPerToken(t, body, i)
				}
			}
		}
	}
}

func TestScanTokensTakesRunsThatStraddleBlocks(t *testing.T) {
	// Tokens of every length up to 8, many straddling a block's end,
	// at every start offset; also one of 9 digits now and then.
	r := rand.New(rand.NewPCG(13, 14))
	for shift := range runBlock {
		var want []uint32
		var b strings.Builder
		b.WriteByte('[')
		for j := range 300 {
			if j > 0 {
				b.WriteString([]string{",", ", "}[r.IntN(2)])
			}
			v := uint32(randomDigits(r, 1+j%9))
			want = append(want, v)
			b.WriteString(strconv.FormatUint(uint64(v), 10))
		}
		b.WriteByte(']')
		body, i := runBody(shift, []byte(b.String()))
		got, end, err := scanTokens(body, i, nil, nil)
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.Equal(t, byte(','), body[end])
		requireSameAsPerToken(t, body, i)
	}
}

func TestScanRunTakesCompactAndPythonArrays(t *testing.T) {
	r := rand.New(rand.NewPCG(15, 16))
	tokens := make([]uint32, 1000)
	for i := range tokens {
		tokens[i] = uint32(r.IntN(152064))
	}
	compact, err := json.Marshal(tokens)
	require.NoError(t, err)
	python := bytes.ReplaceAll(compact, []byte(","), []byte(", "))
	for _, array := range [][]byte{compact, python} {
		body, i := runBody(3, array)
		out, j := scanRun(body, i+1, make([]uint32, 0, 2*len(tokens)))
		// All but the last few, which the body's last window holds.
		require.GreaterOrEqual(t, len(out), len(tokens)-4, "%.40s", array)
		require.Equal(t, tokens[:len(out)], out)
		require.Equal(t, byte(','), body[j-1])
	}
}

func TestScanRunLeavesDstsCapacityAlone(t *testing.T) {
	array := []byte("[" + strings.Repeat("151000,", 999) + "7]")
	body, i := runBody(0, array)
	dst := make([]uint32, 0, 1000)
	out, _ := scanRun(body, i+1, dst)
	require.Greater(t, len(out), 900)
	require.Equal(t, &dst[:1][0], &out[0], "the tokens went into dst")
	out, j := scanRun(body, i+1, make([]uint32, 0, runBlock/2-1))
	require.Empty(t, out, "no room for a block: nothing taken")
	require.Equal(t, i+1, j)
}

// TestCommaBitsMarksCommasAndTheMinusSignsAfterThem checks the comma mask
// on random words, biased to commas, minus signs and digits, against a
// byte-wise model of what it marks.
func TestCommaBitsMarksCommasAndTheMinusSignsAfterThem(t *testing.T) {
	r := rand.New(rand.NewPCG(17, 18))
	var b [8]byte
	for range 1_000_000 {
		for j := range b {
			switch r.IntN(4) {
			case 0:
				b[j] = ','
			case 1:
				b[j] = '-'
			case 2:
				b[j] = '0' + byte(r.IntN(10))
			default:
				b[j] = byte(r.IntN(256))
			}
		}
		want := uint64(0)
		for j, c := range b {
			if c == ',' || c == '-' && j > 0 && want&(1<<(j-1)) != 0 {
				want |= 1 << j
			}
		}
		require.Equal(t, want, commaBits(binary.LittleEndian.Uint64(b[:])), "%q", b)
	}
}

func FuzzScanTokens(f *testing.F) {
	r := rand.New(rand.NewPCG(19, 20))
	for _, irregular := range []float64{0, 0, 0.01, 0.05, 0.3} {
		f.Add(uint8(r.IntN(64)), randomRunArray(r, 60, irregular))
	}
	f.Fuzz(func(t *testing.T, shift uint8, array []byte) {
		body, i := runBody(int(shift%runBlock), array)
		requireSameAsPerToken(t, body, i)
		requireSameAsOracle(t, body, []uint32{5, 5})
	})
}
