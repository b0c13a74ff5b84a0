package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// specBurstShortOptions is the burst scenario at a reduced size: an
// 8,192-token prefix on the in-memory transport.
func specBurstShortOptions(t *testing.T) *options {
	o := defaultOptions()
	o.scenarios = []string{"spec-burst"}
	o.plots = false
	o.outDir = t.TempDir()
	o.transport = "fake"
	o.sb.prefixTokens = 8192
	o.sb.suffixMin, o.sb.suffixMax = 256, 1024
	o.sb.gpuBlocks, o.sb.cpuBlocks = 4000, 8000
	return &o
}

func runSpecBurst(t *testing.T, o *options) (arms []*armResult) {
	t.Helper()
	a := &auditor{}
	o.audit = a.check
	res, err := replay(context.Background(), o, &bytes.Buffer{})
	require.NoError(t, err)
	require.Empty(t, a.problems)
	require.Len(t, res, 1)
	arms = res[0].Arms
	require.Len(t, arms, 6)
	for i, want := range []struct{ variant, arm string }{
		{"burst", "without speculative"}, {"burst", "with speculative"},
		{"busy", "without speculative"}, {"busy", "with speculative"},
		{"control", "without speculative"}, {"control", "with speculative"},
	} {
		require.Equal(t, want.variant, arms[i].Variant)
		require.Equal(t, want.arm, arms[i].Arm)
		require.Zero(t, arms[i].Events.HashMismatches)
		require.Zero(t, arms[i].Events.Unrecovered)
	}
	return arms
}

func TestSpeculativeIndexingKeepsABurstOnANewPrefixOffMostPods(t *testing.T) {
	o := specBurstShortOptions(t)
	arms := runSpecBurst(t, o)
	off, on := arms[0], arms[1]
	so := o.sb
	// Without speculation no request of the burst sees a holder: each pod
	// the least-loaded fallback reaches computes the prefix.
	require.Equal(t, float64(min(so.requests, so.pods)), off.Figures["prefix_pods"])
	// With it the holder takes requests until the spill threshold.
	require.Equal(t, float64((so.requests+so.spillAt-1)/so.spillAt), on.Figures["prefix_pods"])
	require.Less(t, on.Figures["prefix_tokens_computed"], off.Figures["prefix_tokens_computed"])
	require.Less(t, on.Figures["compute_s"], off.Figures["compute_s"])
	require.Equal(t, float64(so.requests), on.Figures["speculative_recorded"])
	require.Positive(t, on.Figures["speculative_replaced"], "the engine's events meet the guesses")
	require.Zero(t, off.Figures["speculative_recorded"])
	// A pod that holds the prefix only speculatively is no pull source.
	for _, arm := range []*armResult{off, on} {
		require.Zero(t, arm.PullDecisions, arm.Arm)
		require.Zero(t, arm.PullsIssued, arm.Arm)
	}
	// Every request but the first on each pod finds its destination the
	// best holder, by the speculative entries alone.
	require.Equal(t, so.requests-int(on.Figures["prefix_pods"]), on.Decisions["self"])
	require.Zero(t, off.Decisions["self"])

	// Among other traffic the burst spreads alike, and the compute it
	// saves is the other traffic's.
	busyOff, busyOn := arms[2], arms[3]
	require.Equal(t, off.Figures["prefix_pods"], busyOff.Figures["prefix_pods"])
	require.Equal(t, on.Figures["prefix_pods"], busyOn.Figures["prefix_pods"])
	require.Less(t, busyOn.Figures["compute_s"], busyOff.Figures["compute_s"])
	require.Equal(t, busyOff.PullsIssued, busyOff.PullsVerified)
	require.Equal(t, busyOn.PullsIssued, busyOn.PullsVerified)
}

func TestSpeculativeIndexingChangesNothingForRequestsSpacedBeyondAPrefill(t *testing.T) {
	o := specBurstShortOptions(t)
	arms := runSpecBurst(t, o)
	off, on := arms[4], arms[5]
	require.Equal(t, off.ttft, on.ttft, "every TTFT as without speculation")
	for i, r := range off.reqs {
		require.Equal(t, r.destName, on.reqs[i].destName, r.name)
		require.Equal(t, r.reason, on.reqs[i].reason, r.name)
	}
	require.Equal(t, off.Decisions, on.Decisions)
	require.Equal(t, 1.0, on.Figures["prefix_pods"])
	require.Equal(t, off.Figures["prefix_tokens_computed"], on.Figures["prefix_tokens_computed"])
	require.Equal(t, float64(o.sb.requests), on.Figures["speculative_recorded"])
	// The guesses were live, and the events, not the TTL, retired them.
	require.Positive(t, on.Figures["speculative_replaced"])
}

func TestSpecBurstFlagsAreValidated(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--burst-requests", "1"}, "--burst-requests"},
		{[]string{"--burst-window", "1.5"}, "--burst-window"},
		{[]string{"--burst-prefix", "4"}, "--burst-prefix"},
		{[]string{"--burst-cost", "linear=-1"}, "negative"},
	} {
		var stdout, stderr bytes.Buffer
		require.NotEqual(t, 0, run(context.Background(), tc.args, &stdout, &stderr))
		require.Contains(t, stderr.String(), tc.want)
	}
}

func TestSpecBurstFiguresAreTheSameEveryRun(t *testing.T) {
	var figs [2][]map[string]float64
	for i := range figs {
		for _, arm := range runSpecBurst(t, specBurstShortOptions(t)) {
			figs[i] = append(figs[i], arm.Figures)
		}
	}
	// The counters are read after the last events are applied, not while
	// the subscriber may still be applying them.
	require.Equal(t, figs[0], figs[1])
}
