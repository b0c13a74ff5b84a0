package service

import (
	"strings"
	"testing"
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
