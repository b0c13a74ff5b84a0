package main

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/picker/kvhints"
)

// hintsShortOptions is the kv-hints scenario at a reduced size: the load
// spill's prompts, caches and cost model scaled by 4 (as shortOptions),
// 8 prefixes, 3 s of arrivals, on the in-memory transport.
func hintsShortOptions(t *testing.T, placement kvhints.Placement) *options {
	o := shortOptions(t)
	o.scenarios = []string{"kv-hints"}
	o.transport = "fake"
	o.prefixes = 8
	o.hints.duration = 3
	o.hints.placement = string(placement)
	return o
}

func runHints(t *testing.T, o *options) map[string]*armResult {
	t.Helper()
	a := &auditor{}
	o.audit = a.check
	res, err := replay(context.Background(), o, &bytes.Buffer{})
	require.NoError(t, err)
	require.Empty(t, a.problems)
	require.Len(t, res, 1)
	require.Len(t, res[0].Arms, 4)
	for i, want := range []string{armNoPull, armConnector, armHintsDisabled, armHints} {
		arm := res[0].Arms[i]
		require.Equal(t, want, arm.Arm)
		require.Zero(t, arm.Events.HashMismatches)
		require.Zero(t, arm.Events.Unrecovered)
		require.Equal(t, arm.PullsIssued, arm.PullsVerified, "%s: every pull verified", want)
		require.Zero(t, arm.PullsFailed, want)
	}
	require.Len(t, res[0].Ours, 3)
	return hintsArms(res[0])
}

// TestKVHintsReplay runs the scenario once (the replay is the slow part)
// and checks both of its comparisons.
func TestKVHintsReplay(t *testing.T) {
	arms := runHints(t, hintsShortOptions(t, kvhints.DefaultPlacement))
	off := arms[armNoPull]

	t.Run("hints drive the pulls the P2P connector does", func(t *testing.T) {
		conn, hint := arms[armConnector], arms[armHints]
		require.Positive(t, hint.PullsIssued)
		// Every pull decision in an aggregated fleet of KVCR pods is
		// eligible: it gets a hint, which the destination reads.
		require.Equal(t, hint.PullDecisions, hint.Decisions["hint_"+string(kvhints.ReasonHinted)])
		require.Equal(t, float64(hint.PullDecisions), hint.Figures["hints_sent"])
		require.Zero(t, hint.Figures["hints_refused"])
		require.Zero(t, hint.Figures["partial_pulls"], "no source lost blocks between the decision and its pull")
		// With no source losing blocks, KVCR's pull moves what the
		// connector's does, request by request.
		require.Zero(t, requestsDiffer(conn, hint))
		require.Equal(t, conn.PullsIssued, hint.PullsIssued)
		require.Equal(t, conn.BytesMoved, hint.BytesMoved)
		require.Equal(t, conn.Figures["hit_rate"], hint.Figures["hit_rate"])
		require.Equal(t, conn.Figures["compute_s"], hint.Figures["compute_s"])
		require.Greater(t, hint.Figures["hit_rate"], off.Figures["hit_rate"])
		require.Less(t, hint.Figures["compute_s"], off.Figures["compute_s"])
		require.Less(t, hint.P50, off.P50)
	})

	t.Run("disabled hints give the no-pull arm exactly", func(t *testing.T) {
		dis := arms[armHintsDisabled]
		// The picker still decides pulls; without endpoints none is
		// hinted, so the destinations pull nothing.
		require.Positive(t, dis.PullDecisions)
		require.Equal(t, dis.PullDecisions, dis.Decisions["hint_"+string(kvhints.ReasonDestinationNotKVCR)])
		require.Zero(t, dis.Figures["hints_sent"])
		require.Zero(t, dis.PullsIssued)
		require.Zero(t, dis.BytesMoved)
		require.Zero(t, requestsDiffer(off, dis))
		require.Equal(t, off.ttft, dis.ttft)
		require.Equal(t, off.Figures["hit_rate"], dis.Figures["hit_rate"])
		require.Equal(t, off.Figures["compute_s"], dis.Figures["compute_s"])
	})
}

// TestKVHintPartialPullRecomputesWhatTheSourceLost has the source lose
// blocks after its events named them (the index does not know yet): the
// destination asks for the hinted blocks, the source writes those it
// still holds, and the destination keeps the leading run and recomputes
// the rest.
func TestKVHintPartialPullRecomputesWhatTheSourceLost(t *testing.T) {
	const prefixBlocks = 64
	for _, tc := range []struct {
		name                   string
		lost                   []int // prefix blocks the source lost
		pulled, stranded       int
		wantPartial, wantPulls int
	}{
		{name: "holds all", pulled: prefixBlocks, wantPulls: 1},
		{name: "lost its tail", lost: []int{48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63}, pulled: 48, wantPartial: 1, wantPulls: 1},
		{name: "lost a middle block", lost: []int{20}, pulled: 20, stranded: prefixBlocks - 21, wantPartial: 1, wantPulls: 1},
		{name: "lost the first block", lost: []int{0}, pulled: 0, stranded: prefixBlocks - 1, wantPartial: 1, wantPulls: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := defaultOptions()
			bs := 16
			pre := sharedPrefixes(7, 1, prefixBlocks*bs)[0]
			r := &request{id: 0, name: "partial-0", arrival: 0.1, prefix: pre, suffix: make([]uint32, 100)}
			spec := &runSpec{
				scenario: "kv-hints", p2p: true, place: placeLoad, aggregated: 2,
				gpuBlocks: 1000, cpuBlocks: 1000, cost: llama8B, hashing: o.hashing, minDelta: o.minDelta,
				reqs: []*request{r}, replay: []int{1}, figures: hintsFigures,
				hints: &hintsSpec{placement: kvhints.DefaultPlacement},
				warm: func(f *fleet) error {
					src := f.pods[0]
					if err := f.warmPrompt(pre, src); err != nil {
						return err
					}
					keys, err := f.eng.keys(&request{prefix: pre})
					if err != nil {
						return err
					}
					var lost []uint64
					for _, i := range tc.lost {
						lost = append(lost, keys[i])
					}
					// Gone from the source's KVCR store; its events
					// have not said so.
					f.sdk.evicted(src, lost)
					return nil
				},
			}
			f, err := newFleet(context.Background(), spec, sdkOptions{transport: "fake"})
			require.NoError(t, err)
			res, _, err := f.run(context.Background())
			require.NoError(t, err)
			require.Equal(t, 1, res.PullDecisions)
			require.Equal(t, 1, res.Decisions["hint_hinted"])
			require.Equal(t, tc.wantPulls, res.PullsIssued)
			require.Equal(t, res.PullsIssued, res.PullsVerified)
			require.Equal(t, float64(tc.wantPartial), res.Figures["partial_pulls"])
			require.Equal(t, float64(tc.stranded), res.Figures["stranded_blocks"])
			require.Equal(t, tc.pulled, r.pulledBlocks)
			require.Equal(t, len(r.eng.keys)-tc.pulled, r.computedBlocks, "what was not pulled is computed")
			require.Equal(t, int64((prefixBlocks-len(tc.lost))*o.blockBytes), res.BytesMoved, "the source wrote every block it held")
		})
	}
}

func TestKVCRParserReadsTheSpecsEnvelopesAndRefusesWhatKVCRRefuses(t *testing.T) {
	const e2 = `{"protocol_version":"0.1","message_id":"msg-123","actions":[{"action_id":"a1","action_type":"kv.fetch","action_version":"1.0","payload":{"block_hashes":[11,22],"source_control_endpoint":"tcp://127.0.0.1:23280"}}]}`
	for _, tc := range []struct {
		name    string
		env     string
		payload bool // the value is a legacy router_hint payload
		hashes  []uint64
		refuse  string
	}{
		{name: "spec E2", env: e2, hashes: []uint64{11, 22}},
		{name: "spec E1 router_hint", payload: true, env: `{"source_control_endpoint":"tcp://127.0.0.1:23280","block_hashes":[11,22]}`, hashes: []uint64{11, 22}},
		{name: "u64 max, duplicates collapse", payload: true, env: `{"source_control_endpoint":"tcp://h:1","block_hashes":[18446744073709551615,18446744073709551615,9007199254740993]}`, hashes: []uint64{1<<64 - 1, 1<<53 + 1}},
		{name: "first kv.fetch after other actions", env: `{"protocol_version":"0.2","message_id":"m","actions":[7,{"action_type":"kv.retain","payload":{}},{"action_type":"kv.fetch","action_version":"2.0","payload":{"block_hashes":[5],"source_control_endpoint":"tcp://h:1"}},{"action_type":"kv.fetch","payload":{"block_hashes":[6],"source_control_endpoint":"tcp://h:2"}}]}`, hashes: []uint64{5}},
		{name: "not a mapping", env: `[1]`, refuse: "invalid router hint"},
		{name: "actions not a list", env: `{"actions":{}}`, refuse: "actions is not a list"},
		{name: "no kv.fetch", env: `{"actions":[{"action_type":"kv.retain","payload":{}}]}`, refuse: "no kv.fetch"},
		{name: "payload not a mapping", env: `{"actions":[{"action_type":"kv.fetch","payload":null}]}`, refuse: "payload is not a mapping"},
		{name: "no_retain", payload: true, env: `{"no_retain":false,"source_control_endpoint":"tcp://h:1","block_hashes":[1]}`, refuse: "no_retain"},
		{name: "mode move", payload: true, env: `{"mode":"move","source_control_endpoint":"tcp://h:1","block_hashes":[1]}`, refuse: "mode"},
		{name: "source-less", payload: true, env: `{"source_control_endpoint":null,"block_hashes":[1]}`, refuse: "source-less"},
		{name: "empty hashes", payload: true, env: `{"source_control_endpoint":"tcp://h:1","block_hashes":[]}`, refuse: "non-empty list"},
		{name: "float hash", payload: true, env: `{"source_control_endpoint":"tcp://h:1","block_hashes":[1.0]}`, refuse: "not an int"},
		{name: "bool hash", payload: true, env: `{"source_control_endpoint":"tcp://h:1","block_hashes":[true]}`, refuse: "not an int"},
		{name: "negative hash", payload: true, env: `{"source_control_endpoint":"tcp://h:1","block_hashes":[-1]}`, refuse: "outside"},
		{name: "hash past u64", payload: true, env: `{"source_control_endpoint":"tcp://h:1","block_hashes":[18446744073709551616]}`, refuse: "outside"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, err := decodeJSON([]byte(tc.env))
			require.NoError(t, err)
			parse := kvcrParseEnvelope
			if tc.payload {
				parse = kvcrParsePayload
			}
			h, err := parse(v)
			if tc.refuse != "" {
				require.ErrorIs(t, err, errHint)
				require.ErrorContains(t, err, tc.refuse)
				return
			}
			require.NoError(t, err)
			want := map[uint64]bool{}
			for _, x := range tc.hashes {
				want[x] = true
			}
			require.Equal(t, want, h.hashes)
		})
	}
}

func TestKVHintBodiesAreReadWhereEachPlacementPutsThem(t *testing.T) {
	hint := kvhints.Hint{MessageID: "req-1", SourceControlEndpoint: "tcp://10.0.0.1:17771", BlockHashes: []uint64{1<<64 - 1, 3}}
	src, dest := &pod{name: "10.0.0.1:8000"}, &pod{name: "10.0.0.2:8000"}
	for _, p := range []kvhints.Placement{kvhints.PlacementKVHint, kvhints.PlacementKVHints, kvhints.PlacementRouterHint} {
		t.Run(string(p), func(t *testing.T) {
			h := &hintPath{spec: hintsSpec{placement: p}, byControl: map[string]*pod{hint.SourceControlEndpoint: src}}
			body, err := kvhints.MergeIntoBody(nil, []byte(`{"model":"m","kv_transfer_params":{"do_remote_decode":false}}`), &hint, p)
			require.NoError(t, err)
			require.True(t, json.Valid(body))
			o, err := h.read(dest, body)
			require.NoError(t, err)
			require.Same(t, src, o.source)
			require.Equal(t, map[uint64]bool{1<<64 - 1: true, 3: true}, o.hinted)
			// A body without a hint is served without a pull.
			o, err = h.read(dest, []byte(`{"model":"m","kv_transfer_params":{"do_remote_decode":false}}`))
			require.NoError(t, err)
			require.Nil(t, o)
			// A hint naming no peer, or the destination itself, is
			// refused.
			h.byControl = map[string]*pod{hint.SourceControlEndpoint: dest}
			_, err = h.read(dest, body)
			require.ErrorIs(t, err, errHint)
		})
	}
}

func TestKVHintsFlagsAreValidated(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--hints-placement", "header"}, "--hints-placement"},
		{[]string{"--hints-rate", "0"}, "--hints-rate"},
		{[]string{"--hints-duration", "-1"}, "--hints-duration"},
	} {
		var stdout, stderr bytes.Buffer
		require.NotEqual(t, 0, run(context.Background(), tc.args, &stdout, &stderr))
		require.Contains(t, stderr.String(), tc.want)
	}
}
