package main

import (
	"errors"
	"fmt"
)

// CostModel charges a pod's prefill and a peer pull in seconds.
//
// Prefill of the tokens after a cached prefix of c tokens, up to n tokens in
// all, costs Linear*(n-c) + Quadratic*(n²-c²): the MLP and projection work
// grows with the new tokens, attention with every new token's context. The
// result is the time the prefill takes alone on one pod; prefills running at
// once on a pod share its compute equally (processor sharing), so k of them
// each progress at 1/k of that speed.
//
// A pull costs PullFloor (handshake, lookup, the first write's latency) plus
// PullPerToken for each token pulled. Pulls served by one source share its
// link the same way prefills share a pod.
type CostModel struct {
	Linear       float64 // s per new token
	Quadratic    float64 // s per token² of attention context
	PullFloor    float64 // s per pull
	PullPerToken float64 // s per pulled token, alone on the source's link
	CPULoad      float64 // s per token to load a local CPU-tier hit into GPU memory
	FirstToken   float64 // s from prefill end to the first token (decode step, P→D handoff)
}

// Prefill returns the solo prefill time of tokens (cached, total].
func (m CostModel) Prefill(cached, total int) float64 {
	if total <= cached {
		return 0
	}
	c, n := float64(cached), float64(total)
	return m.Linear*(n-c) + m.Quadratic*(n*n-c*c)
}

// Pull returns the solo time of pulling tokens tokens.
func (m CostModel) Pull(tokens int) float64 {
	return m.PullFloor + m.PullPerToken*float64(tokens)
}

var errCostModel = errors.New("invalid cost model")

func (m CostModel) validate() error {
	for _, v := range []struct {
		name string
		v    float64
	}{{"linear", m.Linear}, {"quadratic", m.Quadratic}, {"pull-floor", m.PullFloor}, {"pull-per-token", m.PullPerToken}, {"cpu-load", m.CPULoad}, {"first-token", m.FirstToken}} {
		if v.v < 0 {
			return fmt.Errorf("%w: %s is negative (%v)", errCostModel, v.name, v.v)
		}
	}
	if m.Linear == 0 && m.Quadratic == 0 {
		return fmt.Errorf("%w: prefill costs nothing", errCostModel)
	}
	return nil
}

// glm753B is the published fork-burst deployment: a 40,960-token prefill
// takes about 6.6 s alone (4.0 s linear, 2.6 s attention) and pulling it
// from a peer's CPU tier about 1 s.
var glm753B = CostModel{
	Linear:       4.0 / 40960,
	Quadratic:    2.6 / (40960.0 * 40960.0),
	PullFloor:    0.35,
	PullPerToken: 0.65 / 40960,
	CPULoad:      0.1 / 40960,
	FirstToken:   0.7,
}

// llama8B is an 8B model on one GPU: a 16,384-token prefill takes about
// 0.55 s alone, pulling it about 0.1 s.
var llama8B = CostModel{
	Linear:       0.33 / 16384,
	Quadratic:    0.22 / (16384.0 * 16384.0),
	PullFloor:    0.03,
	PullPerToken: 0.07 / 16384,
	CPULoad:      0.02 / 16384,
	FirstToken:   0.05,
}
