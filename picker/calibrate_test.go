package picker

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
)

// gpt-oss-120b on H200, as published: single-request prefill latency of a
// cold prefix, recomputed or pulled from a peer's CPU tier.
var (
	gptOSSTokens    = []int{2048, 8192, 16384, 32768, 49152}
	gptOSSRecompute = []float64{78, 250, 510, 1173, 1988}
	gptOSSPull      = []float64{35, 57, 86, 165, 235}
)

func samples(tokens []int, ms []float64) []transfer.Sample {
	s := make([]transfer.Sample, len(tokens))
	for i := range tokens {
		s[i] = transfer.Sample{Tokens: tokens[i], Millis: ms[i]}
	}
	return s
}

func TestFitGPTOSSPullWinsEverywhereMeasured(t *testing.T) {
	cal, err := Fit(samples(gptOSSTokens, gptOSSRecompute), samples(gptOSSTokens, gptOSSPull), DefaultMargin)
	require.NoError(t, err)
	t.Logf("recompute %+v pull %+v crossover %.0f threshold %d rmse %.1f/%.1f",
		cal.Recompute, cal.Pull, cal.Crossover, cal.Threshold, cal.RecomputeRMSE, cal.PullRMSE)
	for i, tok := range gptOSSTokens {
		tf := float64(tok)
		require.InEpsilon(t, gptOSSRecompute[i], cal.Recompute.At(tf), 0.12, "recompute at %d", tok)
		require.InEpsilon(t, gptOSSPull[i], cal.Pull.At(tf), 0.15, "pull at %d", tok)
		require.Less(t, cal.Pull.At(tf), (1-DefaultMargin)*cal.Recompute.At(tf), "pull wins at %d", tok)
		require.Positive(t, cal.Saving(0, tok))
	}
	require.Less(t, cal.Crossover, 2048.0)
	require.Equal(t, 1, cal.Threshold, "a pull of any length pays: llm-d's smallest threshold")
	require.Equal(t, 2048, cal.MinTokens)
	require.Equal(t, 49152, cal.MaxTokens)
	for _, c := range []float64{cal.Recompute.A, cal.Recompute.B, cal.Recompute.C, cal.Pull.Floor, cal.Pull.PerToken} {
		require.GreaterOrEqual(t, c, 0.0)
	}
}

// glmCurves returns recompute and pull curves consistent with the figures
// published for the 753B GLM model: a pull floor of 1.2 s, a tie at 8K
// tokens, pulls 27% faster at 12K and 61% faster at 24K. The pull slope is
// an assumption (20 µs/token); the recompute quadratic goes through the
// three points the figures imply.
func glmCurves() (recompute func(float64) float64, pull func(float64) float64) {
	pull = func(t float64) float64 { return 1200 + 0.02*t }
	xs := []float64{8192, 12288, 24576}
	ys := []float64{pull(8192), pull(12288) / (1 - 0.27), pull(24576) / (1 - 0.61)}
	recompute = func(t float64) float64 {
		var y float64
		for i := range xs {
			l := 1.0
			for j := range xs {
				if j != i {
					l *= (t - xs[j]) / (xs[i] - xs[j])
				}
			}
			y += ys[i] * l
		}
		return y
	}
	return recompute, pull
}

func TestFitGLMCrossoverNear8K(t *testing.T) {
	rec, pull := glmCurves()
	// Measurements at more lengths than the figures, each off the curve by
	// up to 3%, alternating in sign.
	lengths := []int{4096, 6144, 8192, 12288, 16384, 24576, 32768}
	noise := []float64{1.02, 0.98, 1.03, 0.97, 1.01, 0.99, 1.02}
	var rs, ps []transfer.Sample
	for i, n := range lengths {
		rs = append(rs, transfer.Sample{Tokens: n, Millis: rec(float64(n)) * noise[i]})
		ps = append(ps, transfer.Sample{Tokens: n, Millis: pull(float64(n)) * noise[len(noise)-1-i]})
	}
	cal, err := Fit(rs, ps, DefaultMargin)
	require.NoError(t, err)
	t.Logf("recompute %+v pull %+v crossover %.0f threshold %d", cal.Recompute, cal.Pull, cal.Crossover, cal.Threshold)
	require.InDelta(t, 8192, cal.Crossover, 8192*0.08)
	require.InDelta(t, 1200, cal.Pull.Floor, 150)
	faster := func(t float64) float64 { return 1 - cal.Pull.At(t)/cal.Recompute.At(t) }
	require.InDelta(t, 0.27, faster(12288), 0.04)
	require.InDelta(t, 0.61, faster(24576), 0.04)
	require.Greater(t, cal.Threshold, int(cal.Crossover), "a margin moves the threshold past the crossover")
	require.Less(t, cal.Threshold, 12288, "pull is 27% faster at 12K, past a 10% margin")
	// Below the crossover the model predicts a loss; past it a saving.
	require.Negative(t, cal.Saving(0, 4096))
	require.Positive(t, cal.Saving(0, 16384))
}

func TestModelSavingCountsContext(t *testing.T) {
	m := Model{Recompute: Quadratic{A: 5, B: 0.01, C: 1e-6}, Pull: Linear{Floor: 20, PerToken: 0.002}}
	for _, tc := range []struct{ cached, pull int }{{0, 1000}, {4000, 1000}, {10000, 5000}} {
		c, g := float64(tc.cached), float64(tc.pull)
		want := 0.01*g + 1e-6*((c+g)*(c+g)-c*c) + 5 - 20 - 0.002*g
		require.InDelta(t, want, m.Saving(tc.cached, tc.pull), 1e-9)
	}
	require.InDelta(t, m.Recompute.At(3000)-m.Pull.At(3000), m.Saving(0, 3000), 1e-9)
	require.Greater(t, m.Saving(10000, 1000), m.Saving(0, 1000), "attention over a longer context makes recompute dearer")
}

func TestCrossoverCases(t *testing.T) {
	cases := []struct {
		name string
		m    Model
		want float64
	}{
		{"pull cheaper from the start", Model{Quadratic{A: 50, B: 0.1}, Linear{Floor: 10, PerToken: 0.01}}, 0},
		{"linear crossover", Model{Quadratic{A: 0, B: 0.1}, Linear{Floor: 90, PerToken: 0.01}}, 1000},
		{"recompute never dearer", Model{Quadratic{A: 0, B: 0.01}, Linear{Floor: 90, PerToken: 0.01}}, math.Inf(1)},
		{"quadratic catches up", Model{Quadratic{A: 0, B: 0, C: 1e-4}, Linear{Floor: 100, PerToken: 0}}, 1000},
		{"pull dearer only in between", Model{Quadratic{A: 30, B: 0, C: 1e-4}, Linear{Floor: 10, PerToken: 0.1}}, 500 + 100*math.Sqrt(5)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.m.Crossover()
			if math.IsInf(tc.want, 1) {
				require.True(t, math.IsInf(got, 1))
				return
			}
			require.InDelta(t, tc.want, got, 1e-6)
			require.GreaterOrEqual(t, tc.m.Recompute.At(got+1), tc.m.Pull.At(got+1))
		})
	}
}

func TestFitNeverReturnsNegativeCoefficients(t *testing.T) {
	// Straight-line recompute data with a negative intercept, and pull data
	// that falls with length: unconstrained fits would go negative.
	rs := []transfer.Sample{{Tokens: 1000, Millis: 50}, {Tokens: 2000, Millis: 150}, {Tokens: 3000, Millis: 250}, {Tokens: 4000, Millis: 350}}
	ps := []transfer.Sample{{Tokens: 1000, Millis: 40}, {Tokens: 2000, Millis: 38}, {Tokens: 3000, Millis: 36}}
	cal, err := Fit(rs, ps, 0)
	require.NoError(t, err)
	for _, c := range []float64{cal.Recompute.A, cal.Recompute.B, cal.Recompute.C, cal.Pull.Floor, cal.Pull.PerToken} {
		require.GreaterOrEqual(t, c, 0.0)
	}
	require.Zero(t, cal.Recompute.A)
	require.Zero(t, cal.Pull.PerToken)
	require.InDelta(t, 38, cal.Pull.Floor, 1e-9)
}

func TestFitRecommendsNoPullWhenPullsNeverPay(t *testing.T) {
	rs := []transfer.Sample{{Tokens: 1000, Millis: 10}, {Tokens: 2000, Millis: 20}, {Tokens: 4000, Millis: 40}}
	ps := []transfer.Sample{{Tokens: 1000, Millis: 100}, {Tokens: 4000, Millis: 400}}
	cal, err := Fit(rs, ps, DefaultMargin)
	require.NoError(t, err)
	require.True(t, math.IsInf(cal.Crossover, 1))
	require.Equal(t, math.MaxInt, cal.Threshold)
}

func TestFitRejectsUnusableSamples(t *testing.T) {
	good := []transfer.Sample{{Tokens: 1000, Millis: 10}, {Tokens: 2000, Millis: 20}, {Tokens: 4000, Millis: 45}}
	pull := []transfer.Sample{{Tokens: 1000, Millis: 5}, {Tokens: 4000, Millis: 8}}
	cases := []struct {
		name      string
		rec, pull []transfer.Sample
		margin    float64
	}{
		{"two recompute lengths", []transfer.Sample{{Tokens: 1000, Millis: 10}, {Tokens: 1000, Millis: 11}, {Tokens: 2000, Millis: 20}}, pull, 0.1},
		{"one pull length", good, []transfer.Sample{{Tokens: 1000, Millis: 5}, {Tokens: 1000, Millis: 6}}, 0.1},
		{"zero tokens", append([]transfer.Sample{{Tokens: 0, Millis: 1}}, good...), pull, 0.1},
		{"negative time", good, append([]transfer.Sample{{Tokens: 500, Millis: -1}}, pull...), 0.1},
		{"NaN time", good, append([]transfer.Sample{{Tokens: 500, Millis: math.NaN()}}, pull...), 0.1},
		{"margin of one", good, pull, 1},
		{"negative margin", good, pull, -0.1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Fit(tc.rec, tc.pull, tc.margin)
			require.ErrorIs(t, err, ErrSamples)
		})
	}
}
