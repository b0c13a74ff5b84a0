package kvhints_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker/kvhints"
)

func TestControlEndpointsArePeerReachableTCPAddresses(t *testing.T) {
	for _, ok := range []string{"tcp://127.0.0.1:23280", "tcp://10.0.0.5:17771", "tcp://[2001:db8::1]:23280", "tcp://worker-a:24000",
		"tcp://kvcr-0.kvcr.ns.svc.cluster.local:1", "tcp://h:65535", "tcp://[::1]:5"} {
		require.NoError(t, kvhints.ParseControlEndpoint(ok), ok)
	}
	for _, bad := range []string{"", "tcp://", "127.0.0.1:23280", "udp://h:1", "ipc:///tmp/x", "tcp://0.0.0.0:1", "tcp://[::]:1",
		"tcp://[::ffff:0.0.0.0]:1", "tcp://::1:5", "tcp://[2001:db8::1]", "tcp://2001:db8::1:1", "tcp://[10.0.0.1]:1", "tcp://*:1",
		"tcp://h:0", "tcp://h:65536", "tcp://h:+1", "tcp://h:01", "tcp://h:", "tcp://:1", "tcp://h:1/x", "tcp://[fe80::1%eth0]:1",
		"tcp://a..b:1", "tcp://h h:1", `tcp://h":1`} {
		require.ErrorIs(t, kvhints.ParseControlEndpoint(bad), kvhints.ErrEndpoint, bad)
	}
	s, err := kvhints.ControlEndpoint("2001:db8::1", 23280)
	require.NoError(t, err)
	require.Equal(t, "tcp://[2001:db8::1]:23280", s)
	_, err = kvhints.ControlEndpoint("::", 1)
	require.ErrorIs(t, err, kvhints.ErrEndpoint)
}

// The spec's §3.2 example, the KVCR quick-start's --kv-transfer-config.
const quickStart = `{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
 "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":2000000000,
  "enable_external_pinning":true,"self_describing_kv_events":true,
  "secondary_tiers":[{"type":"kvcr","router_capabilities":["router_hint"],
   "control_host":"0.0.0.0","control_ports":[17771,17772],"control_advertise_host":"127.0.0.1",
   "operation_timeout_ms":5000,"enable_telemetry":true}]}}`

func TestEndpointsComeFromAPodsKVTransferConfig(t *testing.T) {
	eps, err := kvhints.FromKVTransferConfig("10.0.0.1:8000", 0, kvhints.Aggregated, []byte(quickStart))
	require.NoError(t, err)
	require.Equal(t, []kvhints.Endpoint{
		{Holder: index.Holder{Pod: "10.0.0.1:8000"}, Address: "tcp://127.0.0.1:17771", WorkerType: kvhints.Aggregated},
		{Holder: index.Holder{Pod: "10.0.0.1:8000", Rank: 1}, Address: "tcp://127.0.0.1:17772", WorkerType: kvhints.Aggregated},
	}, eps)

	// A pod running global ranks 4 and 5, ports as strings, IPv6.
	cfg := `{"kv_connector_extra_config":{"secondary_tiers":[{"type":"p2p"},{"type":"kvcr","router_capabilities":["router_hint"],
	  "control_ports":["24000","24001"],"control_advertise_host":"2001:db8::7"}]}}`
	eps, err = kvhints.FromKVTransferConfig("pod-b", 4, kvhints.Prefill, []byte(cfg))
	require.NoError(t, err)
	require.Equal(t, []kvhints.Endpoint{
		{Holder: index.Holder{Pod: "pod-b", Rank: 4}, Address: "tcp://[2001:db8::7]:24000", WorkerType: kvhints.Prefill},
		{Holder: index.Holder{Pod: "pod-b", Rank: 5}, Address: "tcp://[2001:db8::7]:24001", WorkerType: kvhints.Prefill},
	}, eps)
	var all kvhints.Endpoints
	for _, e := range eps {
		require.NoError(t, all.Add(e))
	}
	require.Error(t, all.Add(eps[0]), "a holder has one endpoint")
	got, ok := all.Lookup(index.Holder{Pod: "pod-b", Rank: 5})
	require.True(t, ok)
	require.Equal(t, "tcp://[2001:db8::7]:24001", got.Address)
}

func TestKVTransferConfigsWithoutAUsableKVCRTierAreRefused(t *testing.T) {
	tier := func(s string) string {
		return `{"kv_connector_extra_config":{"secondary_tiers":[` + s + `]}}`
	}
	const good = `"router_capabilities":["router_hint"],"control_ports":[17771],"control_advertise_host":"10.0.0.1"`
	for name, cfg := range map[string]string{
		"not JSON":                    `{`,
		"trailing data":               tier(`{"type":"kvcr",`+good+`}`) + ` {}`,
		"no extra config":             `{"kv_connector":"OffloadingConnector"}`,
		"no kvcr tier":                tier(`{"type":"p2p"}`),
		"kvcr without router_hint":    tier(`{"type":"kvcr","control_ports":[17771],"control_advertise_host":"10.0.0.1"}`),
		"two router_hint tiers":       tier(`{"type":"kvcr",` + good + `},{"type":"kvcr",` + good + `}`),
		"no ports":                    tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[],"control_advertise_host":"h"}`),
		"no advertise host":           tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[17771]}`),
		"empty advertise host":        tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[17771],"control_advertise_host":""}`),
		"unspecified advertise host":  tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[17771],"control_advertise_host":"0.0.0.0"}`),
		"unspecified IPv6 host":       tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[17771],"control_advertise_host":"::"}`),
		"port 0":                      tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[0],"control_advertise_host":"h"}`),
		"port 65536":                  tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[65536],"control_advertise_host":"h"}`),
		"float port":                  tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[17771.0],"control_advertise_host":"h"}`),
		"non-numeric port":            tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":["x"],"control_advertise_host":"h"}`),
		"boolean port":                tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[true],"control_advertise_host":"h"}`),
		"ports not a list":            tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":17771,"control_advertise_host":"h"}`),
		"advertise host with a space": tier(`{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[1],"control_advertise_host":"a b"}`),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := kvhints.FromKVTransferConfig("pod", 0, kvhints.Aggregated, []byte(cfg))
			require.Error(t, err)
		})
	}
	_, err := kvhints.FromKVTransferConfig("", 0, kvhints.Aggregated, []byte(quickStart))
	require.ErrorIs(t, err, kvhints.ErrConfig)
	_, err = kvhints.FromKVTransferConfig("pod", -1, kvhints.Aggregated, []byte(quickStart))
	require.ErrorIs(t, err, kvhints.ErrConfig)
}

func TestWorkerTypesAndPlacementsParse(t *testing.T) {
	for in, want := range map[string]kvhints.WorkerType{"": kvhints.Aggregated, "agg": kvhints.Aggregated, "aggregated": kvhints.Aggregated,
		"prefill": kvhints.Prefill, "decode": kvhints.Decode} {
		got, err := kvhints.ParseWorkerType(in)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	_, err := kvhints.ParseWorkerType("encode")
	require.ErrorIs(t, err, kvhints.ErrConfig)
	p, err := kvhints.ParsePlacement("")
	require.NoError(t, err)
	require.Equal(t, kvhints.PlacementKVHint, p)
	_, err = kvhints.ParsePlacement("kv_transfer_params")
	require.ErrorIs(t, err, kvhints.ErrConfig)
}
