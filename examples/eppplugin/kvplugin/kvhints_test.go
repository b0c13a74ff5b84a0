package kvplugin

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker/kvhints"
)

// With kvHints, a pull also carries its KV hint, as a merge patch of the
// body, where the source header goes; without an eligible pull, none.
func TestSourceProducerAttachesTheKVHintBesideTheSourceHeader(t *testing.T) {
	kvcrConfig := json.RawMessage(`{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"secondary_tiers":[` +
		`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[17771],"control_advertise_host":"10.0.0.2"}]}}`)
	hints := func(placement string) *KVHintsConfig {
		return &KVHintsConfig{Placement: placement, Endpoints: []KVCREndpointConfig{
			{Endpoint: "10.0.0.2:8080", KVTransferConfig: kvcrConfig},
			{Endpoint: "10.0.0.9:8080", ControlEndpoints: []string{"tcp://10.0.0.9:17771"}},
		}}
	}
	for _, placement := range []string{"", "kv_hints", "router_hint"} {
		t.Run(placement, func(t *testing.T) {
			w := newWorld(t, SourceConfig{KVHints: hints(placement)})
			b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
			w.hold(b, index.TierCPU, 0, 3)
			req := w.request("req-7f3a")
			req.Headers[KVHintHeader] = `{"kv_hints":"the client's"}`
			req = w.decide(req, []scheduling.Endpoint{b, c}, result(c, nil, ""))
			require.Equal(t, "10.0.0.2:8080", header(req))
			var patch struct {
				KVHints          *kvhints.Envelope `json:"kv_hints"`
				KVTransferParams struct {
					KVHint     *kvhints.Envelope   `json:"kv_hint"`
					RouterHint *kvhints.RouterHint `json:"router_hint"`
				} `json:"kv_transfer_params"`
			}
			require.NoError(t, json.Unmarshal([]byte(req.Headers[KVHintHeader]), &patch), req.Headers[KVHintHeader])
			env := patch.KVTransferParams.KVHint
			switch placement {
			case "router_hint":
				require.Equal(t, &kvhints.RouterHint{SourceControlEndpoint: "tcp://10.0.0.2:17771", BlockHashes: w.keys[:3]}, patch.KVTransferParams.RouterHint)
				return
			case "kv_hints":
				env = patch.KVHints
			}
			require.NotNil(t, env)
			require.Equal(t, "req-7f3a", env.MessageID)
			var fp kvhints.FetchPayload
			require.NoError(t, json.Unmarshal(env.Actions[0].Payload, &fp))
			require.Equal(t, kvhints.FetchPayload{BlockHashes: w.keys[:3], SourceControlEndpoint: "tcp://10.0.0.2:17771"}, fp)
		})
	}

	t.Run("a source without a KVCR endpoint gets the source header alone, and a client's hint header is removed", func(t *testing.T) {
		w := newWorld(t, SourceConfig{KVHints: hints("")})
		a, c := endpoint(ip(1), 0), endpoint(ip(9), 0)
		w.hold(a, index.TierCPU, 0, 3)
		req := w.request("r")
		req.Headers[KVHintHeader] = `{"kv_hints":"the client's"}`
		req = w.decide(req, []scheduling.Endpoint{a, c}, result(c, nil, ""))
		require.Equal(t, "10.0.0.1:8080", header(req))
		require.NotContains(t, req.Headers, KVHintHeader)
	})
	t.Run("without kvHints no hint header", func(t *testing.T) {
		w := newWorld(t, SourceConfig{})
		b, c := endpoint(ip(2), 0), endpoint(ip(9), 0)
		w.hold(b, index.TierCPU, 0, 3)
		req := w.decide(w.request("r"), []scheduling.Endpoint{b, c}, result(c, nil, ""))
		require.Equal(t, "10.0.0.2:8080", header(req))
		require.NotContains(t, req.Headers, KVHintHeader)
	})
}

func TestSourceProducerRefusesBadKVHintsParameters(t *testing.T) {
	for _, params := range []string{
		`{"kvHints":{"placement":"kv_transfer_params","endpoints":[]}}`,
		`{"kvHints":{"endpoints":[{"controlEndpoints":["tcp://h:1"]}]}}`,
		`{"kvHints":{"endpoints":[{"endpoint":"10.0.0.1:8080"}]}}`,
		`{"kvHints":{"endpoints":[{"endpoint":"10.0.0.1:8080","controlEndpoints":["tcp://0.0.0.0:1"]}]}}`,
		`{"kvHints":{"endpoints":[{"endpoint":"10.0.0.1:8080","controlEndpoints":["tcp://h:1"],"workerType":"encode"}]}}`,
		`{"kvHints":{"endpoints":[{"endpoint":"10.0.0.1:8080","kvTransferConfig":{"kv_connector_extra_config":{"secondary_tiers":[]}}}]}}`,
	} {
		cfg, err := parseSourceConfig(json.NewDecoder(strings.NewReader(params)))
		require.NoError(t, err, params)
		prefix, err := NewPrefixProducer(PrefixProducerType, func() PrefixConfig {
			c := DefaultPrefixConfig()
			c.KVEventsConfig = nil
			return c
		}(), index.New(index.Config{}))
		require.NoError(t, err)
		_, err = NewSourceProducer("test", cfg, prefix, nil)
		require.ErrorIs(t, err, ErrConfig, params)
	}
}
