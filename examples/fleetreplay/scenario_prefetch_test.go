package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// prefetchShortOptions is the prefetch scenario at a reduced size: fewer,
// shorter sessions on three pods.
func prefetchShortOptions(t *testing.T, transport string) *options {
	o := defaultOptions()
	o.scenarios = []string{"prefetch"}
	o.plots = false
	o.outDir = t.TempDir()
	o.transport = transport
	po := &o.pf
	po.sessions, po.pods = 8, 3
	po.turnsMin, po.turnsMax = 2, 5
	po.systemMin, po.systemMax = 2048, 8192
	po.toolMin, po.toolMax = 256, 2048
	po.gapMax = 8
	po.gpuBlocks, po.cpuBlocks = 4000, 8000
	return &o
}

func TestPrefetchLowersTTFTAfterAToolGap(t *testing.T) {
	o := prefetchShortOptions(t, "fake")
	a := &auditor{}
	o.audit = a.check
	res, err := replay(context.Background(), o, &bytes.Buffer{})
	require.NoError(t, err)
	require.Empty(t, a.problems)
	require.Len(t, res, 1)
	require.Equal(t, "prefetch", res[0].Name)
	onDemand, prefetch := res[0].Arms[0], res[0].Arms[1]
	require.Equal(t, "P2P on-demand", onDemand.Arm)
	require.Equal(t, "P2P + prefetch", prefetch.Arm)
	for _, arm := range res[0].Arms {
		require.Positive(t, arm.PullsIssued, arm.Arm)
		require.Equal(t, arm.PullsIssued, arm.PullsVerified, "%s: every pull verified", arm.Arm)
		require.Zero(t, arm.PullsFailed, arm.Arm)
		require.Zero(t, arm.Events.HashMismatches)
		require.Zero(t, arm.Events.Unrecovered)
	}
	require.Zero(t, onDemand.Decisions["prefetch_started"], "on-demand prefetches nothing")
	require.Positive(t, onDemand.Decisions["pull"], "on-demand pulls the history at arrival")
	require.Positive(t, prefetch.Decisions["prefetch_started"])
	require.Less(t, prefetch.Decisions["pull"], onDemand.Decisions["pull"], "prefetched turns find their history local")
	require.Less(t, prefetch.P50, onDemand.P50, "prefetch: lower median TTFT after a tool gap")
	require.Less(t, prefetch.Mean, onDemand.Mean, "prefetch: lower mean TTFT after a tool gap")
}

func TestPrefetchReplaysAlikeOverVLLMsP2PProtocol(t *testing.T) {
	var res [2][]*scenarioResult
	for i, tr := range []string{"p2p", "fake"} {
		o := prefetchShortOptions(t, tr)
		o.pf.sessions = 4
		var err error
		res[i], err = replay(context.Background(), o, &bytes.Buffer{})
		require.NoError(t, err)
	}
	for i := range res[0][0].Arms {
		a, b := res[0][0].Arms[i], res[1][0].Arms[i]
		require.Equal(t, a.ttft, b.ttft, a.Arm)
		require.Equal(t, a.PullsIssued, a.PullsVerified, "%s: every pull over ZMQ verified", a.Arm)
		require.Equal(t, b.BytesMoved, a.BytesMoved)
		require.Contains(t, a.Transfer, "transfer/p2p")
	}
}

func TestPrefetchJSONRowsCarryScenarioArmAndFigures(t *testing.T) {
	dir := t.TempDir()
	jsonPath := filepath.Join(dir, "tables.json")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{
		"--scenarios", "prefetch", "--plot=false", "--json", jsonPath, "--progress", "never", "--transport", "fake",
		"--prefetch-sessions", "3", "--prefetch-turns", "4", "--prefetch-gap", "5",
	}, &stdout, &stderr)
	require.Equal(t, 0, code, stderr.String())
	require.Contains(t, stdout.String(), "P2P + prefetch")
	var doc struct {
		Scenarios []struct {
			Arms []struct {
				Scenario      string         `json:"scenario"`
				Arm           string         `json:"arm"`
				Requests      int            `json:"requests"`
				P50           float64        `json:"p50_s"`
				PullsIssued   int            `json:"pulls_issued"`
				PullsVerified int            `json:"pulls_verified"`
				Decisions     map[string]int `json:"decisions"`
			} `json:"arms"`
		} `json:"scenarios"`
	}
	b, err := os.ReadFile(jsonPath)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &doc))
	require.Len(t, doc.Scenarios, 1)
	arms := doc.Scenarios[0].Arms
	require.Len(t, arms, 2)
	for _, a := range arms {
		require.Equal(t, "prefetch", a.Scenario)
		require.Positive(t, a.Requests)
		require.Positive(t, a.P50)
		require.Equal(t, a.PullsIssued, a.PullsVerified)
	}
	require.Equal(t, []string{"P2P on-demand", "P2P + prefetch"}, []string{arms[0].Arm, arms[1].Arm})
	require.Positive(t, arms[1].Decisions["prefetch_started"])
}

func TestPrefetchFlagsAreValidated(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--prefetch-pods", "1"}, "--prefetch-pods at least 2"},
		{[]string{"--prefetch-turns", "1"}, "--prefetch-turns"},
		{[]string{"--prefetch-gpu-blocks", "10"}, "prefetch caches must hold"},
		{[]string{"--prefetch-cost", "linear=-1"}, "negative"},
	} {
		var stdout, stderr bytes.Buffer
		require.NotEqual(t, 0, run(context.Background(), tc.args, &stdout, &stderr))
		require.Contains(t, stderr.String(), tc.want)
	}
}
