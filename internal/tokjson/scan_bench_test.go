package tokjson

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"testing"
	"time"
)

// BenchmarkScan times scanTokens on the tokens array of a 20,000-token
// prompt (a 152,064 vocabulary) as json.Marshal writes it ("compact"), as
// Python's json.dumps does ("python": ", "), one token a line ("lines")
// and of random uint32s, mostly 9 and 10 digits ("uint32"). Each iteration
// also runs the per-token scanner it replaced on the same bytes right
// after: x-old is the ratio of their times.
func BenchmarkScan(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	vocab := make([]uint32, 20000)
	wide := make([]uint32, 20000)
	for i := range vocab {
		vocab[i] = uint32(r.IntN(152064))
		wide[i] = r.Uint32()
	}
	compact, _ := json.Marshal(vocab)
	lines, _ := json.MarshalIndent(vocab, "", " ")
	wideJSON, _ := json.Marshal(wide)
	for _, c := range []struct {
		name string
		body []byte
	}{
		{"compact", compact},
		{"python", bytes.ReplaceAll(compact, []byte(","), []byte(", "))},
		{"lines", lines},
		{"uint32", wideJSON},
	} {
		b.Run(c.name, func(b *testing.B) {
			// The body goes on as a request's would after the array.
			body := append(c.body, `,"model":"m"}`...)
			dst := make([]uint32, 0, len(vocab))
			var newT, oldT time.Duration
			for b.Loop() {
				t0 := time.Now()
				out, end, err := scanTokens(body, 0, dst, nil)
				t1 := time.Now()
				if err != nil || len(out) != len(vocab) || end != len(c.body) {
					b.Fatal(err, len(out), end)
				}
				if out, _, err = scanTokensPerToken(body, 0, dst, nil); err != nil || len(out) != len(vocab) {
					b.Fatal(err)
				}
				oldT += time.Since(t1)
				newT += t1.Sub(t0)
			}
			b.ReportMetric(float64(newT.Nanoseconds())/float64(b.N*len(vocab)), "ns/token")
			b.ReportMetric(float64(oldT.Nanoseconds())/float64(b.N*len(vocab)), "ns/token-old")
			b.ReportMetric(float64(newT)/float64(oldT), "x-old")
		})
	}
}
