package service

import (
	"encoding/json"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/picker/kvhints"
)

// randHintAnswer is a pick's hint as the service may answer it: none
// (no KVCR endpoints), a reason for none, or a hint in any placement.
func randHintAnswer(r *rand.Rand) *hintAnswer {
	placements := []kvhints.Placement{kvhints.PlacementKVHint, kvhints.PlacementKVHints, kvhints.PlacementRouterHint}
	reasons := []kvhints.Reason{kvhints.ReasonNoPull, kvhints.ReasonNoSourceEndpoint, kvhints.ReasonWorkerType, kvhints.ReasonContentKeys}
	switch r.IntN(3) {
	case 0:
		return nil
	case 1:
		return &hintAnswer{reason: reasons[r.IntN(len(reasons))], placement: placements[r.IntN(len(placements))]}
	}
	h := kvhints.Hint{MessageID: randString(r), SourceControlEndpoint: []string{"tcp://10.0.0.5:17771", "tcp://[fd00::2]:1", "tcp://kvcr-0.ns:65535"}[r.IntN(3)]}
	if h.MessageID == "" {
		h.MessageID = "kvsource-1"
	}
	for range 1 + r.IntN(40) {
		h.BlockHashes = append(h.BlockHashes, r.Uint64()>>r.IntN(64))
	}
	return &hintAnswer{reason: kvhints.ReasonHinted, hint: h, placement: placements[r.IntN(len(placements))]}
}

func TestServeParsesKVCRFlags(t *testing.T) {
	cfgJSON := `{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"secondary_tiers":[{"type":"kvcr","router_capabilities":["router_hint"],"control_host":"0.0.0.0","control_ports":[17771,17772],"control_advertise_host":"10.0.0.2"}]}}`
	cfg, err := parseFlags([]string{
		"--kvcr-endpoint", "10.0.0.1:8000=tcp://10.0.0.1:17771",
		"--kvcr-endpoint", "[fd00::3]:8000=tcp://[fd00::3]:17771,tcp://[fd00::3]:17772,worker-type=prefill,dp-start-rank=2",
		"--kvcr-config", "10.0.0.2:8000=" + cfgJSON + ",worker-type=agg",
		"--hint-placement", "router_hint",
	}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, kvhints.PlacementRouterHint, cfg.KVHints.Placement)
	require.Equal(t, []kvhints.Endpoint{
		{Holder: index.Holder{Pod: "10.0.0.1:8000"}, Address: "tcp://10.0.0.1:17771", WorkerType: kvhints.Aggregated},
		{Holder: index.Holder{Pod: "[fd00::3]:8000", Rank: 2}, Address: "tcp://[fd00::3]:17771", WorkerType: kvhints.Prefill},
		{Holder: index.Holder{Pod: "[fd00::3]:8000", Rank: 3}, Address: "tcp://[fd00::3]:17772", WorkerType: kvhints.Prefill},
		{Holder: index.Holder{Pod: "10.0.0.2:8000"}, Address: "tcp://10.0.0.2:17771", WorkerType: kvhints.Aggregated},
		{Holder: index.Holder{Pod: "10.0.0.2:8000", Rank: 1}, Address: "tcp://10.0.0.2:17772", WorkerType: kvhints.Aggregated},
	}, cfg.KVHints.Endpoints)

	cfg, err = parseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Empty(t, cfg.KVHints.Endpoints)

	for _, args := range [][]string{
		{"--kvcr-endpoint", "p=tcp://0.0.0.0:1"},
		{"--kvcr-endpoint", "p=tcp://[::]:1"},
		{"--kvcr-endpoint", "p=tcp://fd00::1:1"},
		{"--kvcr-endpoint", "p="},
		{"--kvcr-endpoint", "=tcp://h:1"},
		{"--kvcr-endpoint", "p=worker-type=prefill"},
		{"--kvcr-endpoint", "p=tcp://h:1,worker-type=encode"},
		{"--kvcr-endpoint", "p=tcp://h:1,dp-start-rank=-1"},
		{"--kvcr-endpoint", "p=tcp://h:1,worker-type=prefill,tcp://h:2"},
		{"--kvcr-endpoint", "p=tcp://h:1,worker-type=prefill,worker-type=decode"},
		{"--kvcr-endpoint", "p=tcp://h:1", "--kvcr-endpoint", "p=tcp://h:2"},
		{"--kvcr-config", "p=" + cfgJSON + "x"},
		{"--kvcr-config", "p=" + strings.Replace(cfgJSON, `"10.0.0.2"`, `"0.0.0.0"`, 1)},
		{"--kvcr-config", "p=" + strings.Replace(cfgJSON, `"router_hint"`, `"other"`, 1)},
		{"--kvcr-config", "p=tcp://h:1"},
		{"--kvcr-config", "p={"},
		{"--hint-placement", "kv_transfer_params"},
	} {
		_, err := parseFlags(args, io.Discard)
		require.Error(t, err, "%q", args)
	}
}

// A pick from a KVCR fleet answers the hint ready to forward: in the
// answer's kv_transfer_params beside remote_kv_source (or as kv_hints),
// with the prompt's engine block hashes from block 0 and the source's
// endpoint, under the pick's request id.
func TestServePickAnswersAKVHintReadyToForward(t *testing.T) {
	srcConfig := `{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",` +
		`"secondary_tiers":[{"type":"kvcr","router_capabilities":["router_hint"],"control_host":"0.0.0.0","control_ports":[17771],"control_advertise_host":"127.0.0.1"}]}}`
	for _, p := range []kvhints.Placement{"", kvhints.PlacementKVHints, kvhints.PlacementRouterHint} {
		t.Run(string(p), func(t *testing.T) {
			args := []string{"--events-bind", "tcp://127.0.0.1:0",
				"--kvcr-endpoint", "10.0.0.1:8000=tcp://10.0.0.1:17771", "--kvcr-config", "127.0.0.1:8002=" + srcConfig}
			if p != "" {
				args = append(args, "--hint-placement", string(p))
			}
			s, base := startServe(t, args...)
			tokens, _ := storedPrompt(t, s)
			keys, err := s.hasher.BlockKeys(nil, hashing.Request{Tokens: tokens})
			require.NoError(t, err)

			code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": "10.0.0.1:8000", "request_id": "req-7f3a"})
			require.Equal(t, http.StatusOK, code, "%s", body)
			var d PickResponse
			require.NoError(t, json.Unmarshal(body, &d))
			require.Equal(t, picker.ReasonPull, d.Reason)
			require.Equal(t, kvhints.ReasonHinted, d.HintReason)
			require.NotNil(t, d.KVTransferParams.RemoteKVSource, "the P2P tier's member stays")
			var env *kvhints.Envelope
			switch p {
			case kvhints.PlacementRouterHint:
				require.Equal(t, &kvhints.RouterHint{SourceControlEndpoint: "tcp://127.0.0.1:17771", BlockHashes: keys}, d.KVTransferParams.RouterHint)
				require.Nil(t, d.KVTransferParams.KVHint)
				require.Nil(t, d.KVHints)
				return
			case kvhints.PlacementKVHints:
				env = d.KVHints
				require.Nil(t, d.KVTransferParams.KVHint)
			default:
				env = d.KVTransferParams.KVHint
				require.Nil(t, d.KVHints)
			}
			require.NotNil(t, env, "%s", body)
			require.Equal(t, "0.1", env.ProtocolVersion)
			require.Equal(t, "req-7f3a", env.MessageID)
			require.Len(t, env.Actions, 1)
			require.Equal(t, kvhints.Action{ActionID: "a1", ActionType: "kv.fetch", ActionVersion: "1.0", Payload: env.Actions[0].Payload}, env.Actions[0])
			var fp kvhints.FetchPayload
			require.NoError(t, json.Unmarshal(env.Actions[0].Payload, &fp))
			require.Equal(t, kvhints.FetchPayload{BlockHashes: keys, SourceControlEndpoint: "tcp://127.0.0.1:17771"}, fp)

			// A destination without an endpoint, a pick without a pull.
			for dest, reason := range map[string]kvhints.Reason{"10.0.0.9:8000": kvhints.ReasonDestinationNotKVCR, "127.0.0.1:8002": kvhints.ReasonNoPull} {
				code, body := call(t, "POST", base+"/v1/pick", map[string]any{"model": "m", "tokens": tokens, "destination": dest})
				require.Equal(t, http.StatusOK, code, "%s", body)
				var d PickResponse
				require.NoError(t, json.Unmarshal(body, &d))
				require.Equal(t, reason, d.HintReason, dest)
				require.Nil(t, d.KVHints)
				require.Nil(t, d.KVTransferParams.KVHint)
				require.Nil(t, d.KVTransferParams.RouterHint)
			}
			mfs, err := s.reg.Gather()
			require.NoError(t, err)
			counted := map[string]float64{}
			for _, mf := range mfs {
				if mf.GetName() == "kvsource_pick_kv_hints_total" {
					for _, m := range mf.GetMetric() {
						counted[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
					}
				}
			}
			require.Equal(t, map[string]float64{"hinted": 1, "no_pull": 1, "destination_not_kvcr": 1, "no_source_endpoint": 0}, counted)
		})
	}
}

// With --keys content the index holds no engine hashes: a pull says why
// it carries no hint.
func TestServeContentKeysGiveNoKVHint(t *testing.T) {
	s, _ := startServe(t, "--keys", "content",
		"--kvcr-endpoint", "10.0.0.1:8000=tcp://10.0.0.1:17771", "--kvcr-endpoint", "127.0.0.1:8002=tcp://127.0.0.1:17771")
	keys := []uint64{1, 2, 3}
	d := picker.Decision{Reason: picker.ReasonPull, Destination: index.Holder{Pod: "10.0.0.1:8000"}, Source: index.Holder{Pod: "127.0.0.1:8002"},
		Cached: 1, Gain: 2, Missing: keys[1:]}
	a, err := s.hints.answer(&d, keys, "r")
	require.NoError(t, err)
	require.Equal(t, kvhints.ReasonContentKeys, a.reason)
	b, err := (&pickAnswer{d: &d, hint: a}).appendJSON(nil)
	require.NoError(t, err)
	require.Contains(t, string(b), `"kv_transfer_params":{},"hint_reason":"content_keys"}`)
}
