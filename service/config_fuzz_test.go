package service

import (
	"strings"
	"testing"

	"github.com/kvsource/kvsource/picker/kvhints"
)

// FuzzParsePodEndpoint: any --events-connect value parses or fails
// with an error, never a panic, and what parses keeps its parts.
func FuzzParsePodEndpoint(f *testing.F) {
	for _, s := range []string{"a=tcp://h:1", "a=tcp://h:1,replay=tcp://h:2,model=m", "a=tcp://h:1,model=x@y/z", "=", "a=,", "a=b,model=", "a=b,replay=c,replay=d"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		pe, err := ParsePodEndpoint(v)
		if err != nil {
			return
		}
		if pe.Pod == "" || strings.Contains(pe.Pod, "=") {
			t.Fatalf("%q: pod %q", v, pe.Pod)
		}
		if strings.Contains(pe.Model, ",") || strings.Contains(pe.Replay, ",") {
			t.Fatalf("%q: option values %q, %q hold a comma", v, pe.Replay, pe.Model)
		}
		if !strings.HasPrefix(v, pe.Pod+"="+pe.Endpoint) {
			t.Fatalf("%q: pod %q endpoint %q", v, pe.Pod, pe.Endpoint)
		}
	})
}

// FuzzParseKVCRFlags: any --kvcr-endpoint or --kvcr-config value parses or
// fails with an error, never a panic, and what parses is endpoints KVCR
// peers can reach, of the pod named, on consecutive ranks.
func FuzzParseKVCRFlags(f *testing.F) {
	for _, s := range []string{"p=tcp://h:1", "p=tcp://[fd00::1]:2,tcp://h:3,worker-type=prefill,dp-start-rank=4", "p=tcp://0.0.0.0:1", "=", "p=,",
		`p={"kv_connector_extra_config":{"secondary_tiers":[{"type":"kvcr","router_capabilities":["router_hint"],"control_ports":[1,"2"],"control_advertise_host":"h"}]}},dp-start-rank=2`,
		`p={"kv_connector_extra_config":{"secondary_tiers":[{"type":"kvcr"}]}}`, `p={}x`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		for _, parse := range []func(string) ([]kvhints.Endpoint, error){ParseKVCREndpoint, ParseKVCRConfig} {
			eps, err := parse(v)
			if err != nil {
				continue
			}
			if len(eps) == 0 {
				t.Fatalf("%q: no endpoints and no error", v)
			}
			for k, ep := range eps {
				if err := kvhints.ParseControlEndpoint(ep.Address); err != nil {
					t.Fatalf("%q: %v", v, err)
				}
				if !strings.HasPrefix(v, ep.Holder.Pod+"=") || strings.Contains(ep.Holder.Pod, "=") {
					t.Fatalf("%q: pod %q", v, ep.Holder.Pod)
				}
				if ep.Holder.Rank != eps[0].Holder.Rank+k || ep.Holder.Rank < 0 {
					t.Fatalf("%q: ranks %v", v, eps)
				}
			}
		}
	})
}
