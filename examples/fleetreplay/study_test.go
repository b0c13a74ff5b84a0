package main

import (
	"bytes"
	"context"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvsource/kvsource/picker"
)

// studyOptions shrinks the study's scenarios to keep the test fast: prompts
// and caches a sixteenth as long (the cost models charge the same seconds),
// fewer conversations, documents and seconds of traffic.
func studyOptions(t *testing.T, scenarios ...string) *options {
	o := defaultOptions()
	o.scenarios = scenarios
	o.transport = "fake"
	o.plots = false
	o.outDir = t.TempDir()
	o.studyScale = 16
	o.pdConversations, o.pdTurnsMax = 24, 6
	o.stormConversations, o.stormAt, o.stormWindow = 12, 30, 15
	o.docs, o.docActive, o.docPods = 24, 16, 4
	o.skewDuration = 8
	o.scaleDuration, o.scaleJoin = 30, 6
	o.routerDuration, o.routerAt = 12, 6
	return &o
}

func byName(t *testing.T, res []*scenarioResult, name string) *scenarioResult {
	for _, s := range res {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("no scenario %s", name)
	return nil
}

func TestStudyScenariosHoldTheirShapes(t *testing.T) {
	o := studyOptions(t, "pd-session", "restart-storm", "doc-qa", "hot-skew", "scale-out", "router-restart", "cpu-restore")
	a := &auditor{}
	o.audit = a.check
	res, err := replay(context.Background(), o, &bytes.Buffer{})
	require.NoError(t, err)
	require.Empty(t, a.problems)
	for _, s := range res {
		require.NotEmpty(t, s.Published, s.Name)
		require.NotEmpty(t, s.Ours, s.Name)
		for _, arm := range s.Arms {
			require.Equal(t, arm.PullsIssued, arm.PullsVerified, "%s %s %s: every pull verified", s.Name, arm.Variant, arm.Arm)
			require.Zero(t, arm.PullsFailed)
			require.Zero(t, arm.Events.HashMismatches)
			if arm.Arm == "without P2P" {
				require.Zero(t, arm.PullDecisions, "%s: no pulls without P2P", s.Name)
			}
		}
	}

	pd := byName(t, res, "pd-session")
	require.LessOrEqual(t, pd.Arms[1].P50, 0.35*pd.Arms[0].P50, "pd-session: median TTFT ratio at most 0.35")
	require.Greater(t, pd.Arms[1].Throughput, pd.Arms[0].Throughput)
	require.Positive(t, pd.Arms[1].Figures["history_tokens_moved"])

	storm := byName(t, res, "restart-storm").Arms
	require.Positive(t, storm[0].Figures["recovery_requests"])
	require.LessOrEqual(t, storm[1].Figures["recovery_mean_s"], storm[0].Figures["recovery_mean_s"]/2, "restart-storm: mean TTFT through the recovery at most half")

	dq := byName(t, res, "doc-qa").Arms
	require.Equal(t, "prefix-affinity", dq[0].Variant)
	require.Equal(t, "load-aware", dq[3].Variant)
	require.Zero(t, dq[1].PullsIssued+dq[0].PullsIssued, "affinity sends every turn to its document's holder")
	require.Less(t, dq[3].P99, dq[0].P99, "doc-qa: p99 lower with load+P2P than with affinity")
	require.Greater(t, dq[3].Throughput, dq[0].Throughput, "doc-qa: throughput higher with load+P2P")

	skew := byName(t, res, "hot-skew").Arms
	require.Less(t, skew[1].P99, skew[0].P99, "hot-skew: p99 lower with P2P")
	require.Less(t, skew[1].Figures["prefill_s"], skew[0].Figures["prefill_s"])

	so := byName(t, res, "scale-out").Arms
	off, on := so[0].Figures["time_to_useful_s"], so[1].Figures["time_to_useful_s"]
	require.False(t, math.IsNaN(off) || math.IsNaN(on), "the new pod becomes useful in both arms")
	require.LessOrEqual(t, on, off/2, "scale-out: time to useful with pulls at most half")

	rr := byName(t, res, "router-restart").Arms
	require.Equal(t, "cold", rr[1].Variant)
	require.Equal(t, "from snapshot", rr[3].Variant)
	require.Positive(t, rr[3].Figures["pulls_first_s"], "router-restart: from its snapshot the router pulls from the first second")
	require.Less(t, rr[1].Figures["pulls_first_s"], rr[3].Figures["pulls_first_s"])
	require.Positive(t, rr[3].Events.Replayed, "the restarted subscriber replayed what the snapshot missed")

	cpu := byName(t, res, "cpu-restore-control").Arms
	require.Zero(t, cpu[1].PullDecisions, "local CPU restore: pulls idle")
	require.Zero(t, cpu[1].BytesMoved)
	require.Positive(t, cpu[1].CPURestored, "the gains come from the local CPU tier")
	require.Equal(t, cpu[0].ttft, cpu[1].ttft)
}

func TestPricingFitsCrossoverAndVerifiesPulls(t *testing.T) {
	o := studyOptions(t, "pricing")
	res, err := replay(context.Background(), o, &bytes.Buffer{})
	require.NoError(t, err)
	s := res[0]
	var cold, warm int
	for _, r := range s.Pricing {
		require.Equal(t, "pricing", r.Scenario)
		require.Positive(t, r.Millis)
		switch {
		case strings.Contains(r.Arm, "cold"):
			cold++
			require.Equal(t, r.Pulls, r.Verified, "every pull verified")
			require.Positive(t, r.Pulls)
		case r.Arm == "with P2P":
			warm++
		}
	}
	require.Equal(t, 2, cold, "one cold probe per model")
	require.Equal(t, 10, warm)
	// gpt-oss-120b-like: the published figures are reproduced within 15%.
	for _, r := range s.Pricing[:10] {
		require.InEpsilon(t, r.Published, r.Millis, 0.15, "%s %d tokens", r.Arm, r.Tokens)
	}
	// The cold probe pays the session set-up on top of the warmed pull.
	require.InDelta(t, s.Pricing[1].Millis+sessionSetup*1000, s.Pricing[10].Millis, 1)
	// GLM-753B-like: tie near 8K, so the crossover is there.
	glm := s.Pricing[11]
	require.InDelta(t, 8192, glm.Crossover, 1024)
	require.Greater(t, glm.Threshold, int(glm.Crossover))
	require.Less(t, glm.Threshold, 16384)
	_, err = picker.Fit(nil, nil, 0.1)
	require.Error(t, err, "the fit is the picker's")
}

func TestScenariosSelectsAndRejects(t *testing.T) {
	o := defaultOptions()
	o.scenarios = []string{"pricing", "router-restart"}
	scs, err := o.scenarioList()
	require.NoError(t, err)
	require.Equal(t, []string{"pricing", "router-restart"}, []string{scs[0].name, scs[1].name})
	o.scenarios = []string{"prefetch-not-yet"}
	_, err = o.scenarioList()
	require.ErrorContains(t, err, "unknown scenario")
	require.Contains(t, err.Error(), "pd-session")
}

func TestSaltExtraKeysAreMsgpackOfTheTuple(t *testing.T) {
	for _, n := range []int{0, 5, 31, 32, 255, 256, 1000} {
		salt := strings.Repeat("s", n)
		want, err := msgpack.Marshal([]any{salt})
		require.NoError(t, err)
		require.Equal(t, want, saltExtraKeys(salt), "salt of %d bytes", n)
	}
}
