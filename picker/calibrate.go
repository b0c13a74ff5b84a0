package picker

import (
	"errors"
	"fmt"
	"math"

	"github.com/kvsource/kvsource/transfer"
)

// Quadratic is a prefill cost: A + B·t + C·t² milliseconds for t tokens. The
// quadratic term is attention over the growing context.
type Quadratic struct{ A, B, C float64 }

// At returns the cost of t tokens.
func (q Quadratic) At(t float64) float64 { return q.A + q.B*t + q.C*t*t }

// Linear is a pull cost: Floor + PerToken·t milliseconds for t tokens. The
// floor is the round trips of a pull (lookup, fetch, completion); the linear
// term is the bytes.
type Linear struct{ Floor, PerToken float64 }

// At returns the cost of t tokens.
func (l Linear) At(t float64) float64 { return l.Floor + l.PerToken*t }

// Model predicts what recomputing and pulling cost. Both are measured as the
// time to serve a prompt whose prefix is recomputed or pulled, so fixed
// per-request overhead is in Recompute.A and in Pull.Floor alike.
type Model struct {
	Recompute Quadratic
	Pull      Linear
}

// Saving returns the predicted milliseconds saved by pulling pull tokens that
// follow cached tokens the destination already holds, instead of computing
// them: the recompute cost of those tokens over their context,
// R(cached+pull) - R(cached), plus the per-request overhead R(0) that the
// pull measurement includes, minus the pull's cost.
func (m *Model) Saving(cached, pull int) float64 {
	c, g := float64(cached), float64(pull)
	r := m.Recompute
	return r.At(c+g) - r.At(c) + r.A - m.Pull.At(g)
}

// Crossover returns the prefix length, in tokens, from which on pulling a
// prefix is predicted to be at least as fast as recomputing it: the smallest
// t with R(s) >= P(s) for every s >= t. It is +Inf when recomputing stays
// faster however long the prefix.
func (m *Model) Crossover() float64 { return m.crossover(0) }

// crossover solves for the smallest t from which P(s) <= (1-margin)·R(s).
func (m *Model) crossover(margin float64) float64 {
	k := 1 - margin
	a := k * m.Recompute.C
	b := k*m.Recompute.B - m.Pull.PerToken
	c := k*m.Recompute.A - m.Pull.Floor
	// f(t) = a t² + b t + c with a >= 0: convex, so f >= 0 from its largest
	// root on, or everywhere when it has no positive root.
	if a == 0 {
		switch {
		case b > 0:
			return max(0, -c/b)
		case b == 0 && c >= 0:
			return 0
		default:
			return math.Inf(1)
		}
	}
	disc := b*b - 4*a*c
	if disc <= 0 {
		return 0
	}
	return max(0, (-b+math.Sqrt(disc))/(2*a))
}

// Calibration is a fitted Model with the figures a deployment configures.
type Calibration struct {
	Model
	// Crossover is Model.Crossover, in tokens.
	Crossover float64
	// Margin is the fraction by which a pull must be predicted faster than
	// recomputing for Threshold.
	Margin float64
	// Threshold is the recommended minimum cached-token delta: the smallest
	// prefix, in whole tokens, from which a pull is predicted to take at most
	// (1 - Margin) of the recompute time, at least 1. It is math.MaxInt when
	// no prefix qualifies, which disables pulls when used as the threshold.
	Threshold int
	// MinTokens and MaxTokens bound the measured prefix lengths; a
	// Crossover or Threshold outside them is an extrapolation.
	MinTokens, MaxTokens int
	// RecomputeRMSE and PullRMSE are the fits' root-mean-square errors, ms.
	RecomputeRMSE, PullRMSE float64
}

// DefaultMargin is a sensible Fit margin: a pull must be predicted 10% faster.
const DefaultMargin = 0.1

// ErrSamples reports samples Fit cannot use.
var ErrSamples = errors.New("picker: unusable calibration samples")

// Fit fits recompute samples to a Quadratic and pull samples to a Linear by
// least squares with non-negative coefficients (reading each sample's
// Tokens and Millis; transfer.MeasurePull's samples go in as they are), and derives the crossover and
// a threshold with margin (0 <= margin < 1). It needs recompute samples at
// three or more distinct lengths and pull samples at two or more.
func Fit(recompute, pull []transfer.Sample, margin float64) (Calibration, error) {
	if margin < 0 || margin >= 1 || math.IsNaN(margin) {
		return Calibration{}, fmt.Errorf("%w: margin %v outside [0, 1)", ErrSamples, margin)
	}
	cal := Calibration{Margin: margin, MinTokens: math.MaxInt}
	for _, set := range [][]transfer.Sample{recompute, pull} {
		for _, s := range set {
			if s.Tokens <= 0 || s.Millis < 0 || math.IsNaN(s.Millis) || math.IsInf(s.Millis, 0) {
				return Calibration{}, fmt.Errorf("%w: %d tokens, %v ms", ErrSamples, s.Tokens, s.Millis)
			}
			cal.MinTokens = min(cal.MinTokens, s.Tokens)
			cal.MaxTokens = max(cal.MaxTokens, s.Tokens)
		}
	}
	if n := distinct(recompute); n < 3 {
		return Calibration{}, fmt.Errorf("%w: recompute measured at %d distinct lengths, need 3", ErrSamples, n)
	}
	if n := distinct(pull); n < 2 {
		return Calibration{}, fmt.Errorf("%w: pull measured at %d distinct lengths, need 2", ErrSamples, n)
	}
	rc, rr := nnls(recompute, 3)
	pc, pr := nnls(pull, 2)
	// The fit runs in thousands of tokens for conditioning.
	cal.Recompute = Quadratic{A: rc[0], B: rc[1] / 1e3, C: rc[2] / 1e6}
	cal.Pull = Linear{Floor: pc[0], PerToken: pc[1] / 1e3}
	cal.RecomputeRMSE, cal.PullRMSE = rr, pr
	cal.Crossover = cal.Model.crossover(0)
	t := cal.Model.crossover(margin)
	if math.IsInf(t, 1) || t >= math.MaxInt32 {
		cal.Threshold = math.MaxInt
	} else {
		cal.Threshold = max(1, int(math.Ceil(t)))
	}
	return cal, nil
}

func distinct(s []transfer.Sample) int {
	seen := make(map[int]struct{}, len(s))
	for _, x := range s {
		seen[x.Tokens] = struct{}{}
	}
	return len(seen)
}

// nnls fits millis = Σ coef[j]·(tokens/1000)^j, j < n, minimising squared
// error subject to coef >= 0. With n <= 3 it tries every set of free
// coefficients and keeps the best feasible one, which is exact. It returns
// the coefficients and the RMSE.
func nnls(samples []transfer.Sample, n int) (coef []float64, rmse float64) {
	best := math.Inf(1)
	coef = make([]float64, n)
	for mask := 1; mask < 1<<n; mask++ {
		var free []int
		for j := range n {
			if mask&(1<<j) != 0 {
				free = append(free, j)
			}
		}
		c, ok := leastSquares(samples, free, n)
		if !ok {
			continue
		}
		feasible := true
		for _, v := range c {
			if v < 0 {
				feasible = false
			}
		}
		if !feasible {
			continue
		}
		if sse := sse(samples, c); sse < best {
			best, coef = sse, c
		}
	}
	return coef, math.Sqrt(best / float64(len(samples)))
}

func sse(samples []transfer.Sample, c []float64) float64 {
	var s float64
	for _, x := range samples {
		t := float64(x.Tokens) / 1e3
		var y, p float64 = 0, 1
		for _, v := range c {
			y += v * p
			p *= t
		}
		s += (y - x.Millis) * (y - x.Millis)
	}
	return s
}

// leastSquares solves the normal equations for the powers in free, returning
// all n coefficients (zero outside free).
func leastSquares(samples []transfer.Sample, free []int, n int) ([]float64, bool) {
	k := len(free)
	m := make([][]float64, k)
	for i := range m {
		m[i] = make([]float64, k+1)
	}
	for _, x := range samples {
		t := float64(x.Tokens) / 1e3
		for i, pi := range free {
			fi := math.Pow(t, float64(pi))
			for j, pj := range free {
				m[i][j] += fi * math.Pow(t, float64(pj))
			}
			m[i][k] += fi * x.Millis
		}
	}
	sol, ok := solve(m)
	if !ok {
		return nil, false
	}
	c := make([]float64, n)
	for i, pi := range free {
		c[pi] = sol[i]
	}
	return c, true
}

// solve solves the augmented system m by Gaussian elimination with partial
// pivoting.
func solve(m [][]float64) ([]float64, bool) {
	k := len(m)
	for col := range k {
		piv := col
		for r := col + 1; r < k; r++ {
			if math.Abs(m[r][col]) > math.Abs(m[piv][col]) {
				piv = r
			}
		}
		if math.Abs(m[piv][col]) < 1e-12 {
			return nil, false
		}
		m[col], m[piv] = m[piv], m[col]
		for r := col + 1; r < k; r++ {
			f := m[r][col] / m[col][col]
			for c := col; c <= k; c++ {
				m[r][c] -= f * m[col][c]
			}
		}
	}
	x := make([]float64, k)
	for r := k - 1; r >= 0; r-- {
		s := m[r][k]
		for c := r + 1; c < k; c++ {
			s -= m[r][c] * x[c]
		}
		x[r] = s / m[r][r]
	}
	return x, true
}
