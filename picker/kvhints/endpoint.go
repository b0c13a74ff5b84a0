package kvhints

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/kvsource/kvsource/index"
)

// WorkerType is an engine's role, as Dynamo advertises it
// (router_hint_worker_type): a hint goes only between engines of one type.
type WorkerType string

// Worker types.
const (
	Aggregated WorkerType = "aggregated"
	Prefill    WorkerType = "prefill"
	Decode     WorkerType = "decode"
)

// ParseWorkerType parses a worker type; "" and Dynamo's "agg" are
// Aggregated.
func ParseWorkerType(s string) (WorkerType, error) {
	switch WorkerType(s) {
	case "", "agg", Aggregated:
		return Aggregated, nil
	case Prefill, Decode:
		return WorkerType(s), nil
	}
	return "", fmt.Errorf("%w: worker type %q: want aggregated, prefill or decode", ErrConfig, s)
}

// Endpoint is the KVCR control endpoint of one holder (pod and
// data-parallel rank): where a destination's KVCR sends its fetch requests.
type Endpoint struct {
	Holder index.Holder
	// Address is "tcp://host:port" (ParseControlEndpoint).
	Address    string
	WorkerType WorkerType
}

// Endpoints are the KVCR control endpoints of a fleet, by holder. The zero
// value is empty and ready to use. Add must not run concurrently with
// Lookup: fill it before the hints are built.
type Endpoints struct {
	m map[index.Holder]Endpoint
}

// Add records ep. An invalid address or worker type, an empty pod, a
// negative rank or a holder already recorded is an error wrapping
// ErrConfig.
func (e *Endpoints) Add(ep Endpoint) error {
	if ep.Holder.Pod == "" || ep.Holder.Rank < 0 {
		return fmt.Errorf("%w: KVCR endpoint of holder %q rank %d: want a pod and a rank >= 0", ErrConfig, ep.Holder.Pod, ep.Holder.Rank)
	}
	if err := ParseControlEndpoint(ep.Address); err != nil {
		return fmt.Errorf("%s: %w", ep.Holder, err)
	}
	wt, err := ParseWorkerType(string(ep.WorkerType))
	if err != nil {
		return fmt.Errorf("%s: %w", ep.Holder, err)
	}
	ep.WorkerType = wt
	if _, dup := e.m[ep.Holder]; dup {
		return fmt.Errorf("%w: %s has two KVCR endpoints", ErrConfig, ep.Holder)
	}
	if e.m == nil {
		e.m = map[index.Holder]Endpoint{}
	}
	e.m[ep.Holder] = ep
	return nil
}

// Lookup returns h's endpoint.
func (e *Endpoints) Lookup(h index.Holder) (Endpoint, bool) {
	ep, ok := e.m[h]
	return ep, ok
}

// Len returns the number of holders with an endpoint.
func (e *Endpoints) Len() int { return len(e.m) }

// ParseControlEndpoint checks a KVCR control endpoint: "tcp://host:port"
// with a non-empty host that is an IP address or a DNS name, an IPv6
// address in brackets ("tcp://[2001:db8::1]:23280"), and a port in
// 1..65535 without sign or leading zero. An unspecified address (0.0.0.0,
// ::) is refused: it is where KVCR binds, not where a peer reaches it.
// Errors wrap ErrEndpoint.
func ParseControlEndpoint(s string) error {
	bad := func(why string) error { return fmt.Errorf("%w %q: %s", ErrEndpoint, s, why) }
	rest, ok := strings.CutPrefix(s, "tcp://")
	if !ok {
		return bad("want tcp://host:port")
	}
	var host, port string
	if strings.HasPrefix(rest, "[") {
		i := strings.Index(rest, "]:")
		if i < 0 {
			return bad("an IPv6 address in brackets needs a port: tcp://[addr]:port")
		}
		host, port = rest[1:i], rest[i+2:]
		a, err := netip.ParseAddr(host)
		if err != nil || !a.Is6() || a.Zone() != "" {
			return bad("not an IPv6 address in brackets")
		}
		if a.Unmap().IsUnspecified() {
			return bad("unspecified address: name the address peers reach")
		}
	} else {
		i := strings.LastIndexByte(rest, ':')
		if i < 0 {
			return bad("want tcp://host:port")
		}
		host, port = rest[:i], rest[i+1:]
		if strings.IndexByte(host, ':') >= 0 {
			return bad("an IPv6 address must be in brackets: tcp://[addr]:port")
		}
		if a, err := netip.ParseAddr(host); err == nil {
			if a.IsUnspecified() {
				return bad("unspecified address: name the address peers reach")
			}
		} else if !dnsName(host) {
			return bad("host is neither an IP address nor a DNS name")
		}
	}
	if _, err := parsePort(port); err != nil {
		return bad(err.Error())
	}
	return nil
}

// dnsName reports whether s is a plausible DNS name: labels of letters,
// digits, '-' and '_', at most 253 bytes.
func dnsName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for label := range strings.SplitSeq(s, ".") {
		if label == "" || len(label) > 63 {
			return false
		}
		for _, c := range []byte(label) {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

func parsePort(p string) (int, error) {
	n, err := strconv.Atoi(p)
	if err != nil || p[0] == '+' || p[0] == '-' || (p[0] == '0' && len(p) > 1) || n < 1 || n > 65535 {
		return 0, fmt.Errorf("port %q: want 1..65535", p)
	}
	return n, nil
}

// ControlEndpoint returns "tcp://host:port", with an IPv6 host in
// brackets, checked by ParseControlEndpoint.
func ControlEndpoint(host string, port int) (string, error) {
	if strings.IndexByte(host, ':') >= 0 && !strings.HasPrefix(host, "[") {
		host = "[" + host + "]"
	}
	s := "tcp://" + host + ":" + strconv.Itoa(port)
	return s, ParseControlEndpoint(s)
}

// FromKVTransferConfig returns the KVCR control endpoints of pod from its
// vLLM --kv-transfer-config JSON: the one secondary tier of type "kvcr"
// (kv_connector_extra_config.secondary_tiers) whose router_capabilities
// hold "router_hint", which vLLM's KVCR adapter requires; its
// control_ports (integers or numeric strings, one per local data-parallel
// rank) and control_advertise_host. Port k is the endpoint of rank
// dpStartRank + k (vLLM's --data-parallel-start-rank; 0 for a pod that
// runs every rank). A missing or unspecified control_advertise_host is an
// error: KVCR then advertises the engine's hostname, which a router
// cannot know, so name it in the config or give the endpoints instead.
// Errors wrap ErrConfig or ErrEndpoint.
func FromKVTransferConfig(pod string, dpStartRank int, wt WorkerType, config []byte) ([]Endpoint, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: kv-transfer-config of %s: %s", ErrConfig, pod, fmt.Sprintf(format, args...))
	}
	if pod == "" || dpStartRank < 0 {
		return nil, bad("want a pod and a start rank >= 0")
	}
	var cfg struct {
		Extra *struct {
			Tiers []json.RawMessage `json:"secondary_tiers"`
		} `json:"kv_connector_extra_config"`
	}
	dec := json.NewDecoder(bytes.NewReader(config))
	dec.UseNumber()
	if err := dec.Decode(&cfg); err != nil {
		return nil, bad("%v", err)
	}
	if dec.More() {
		return nil, bad("trailing data after the JSON object")
	}
	if cfg.Extra == nil {
		return nil, bad("no kv_connector_extra_config")
	}
	type tier struct {
		Type          string        `json:"type"`
		Capabilities  []string      `json:"router_capabilities"`
		Ports         []json.Number `json:"control_ports"`
		AdvertiseHost *string       `json:"control_advertise_host"`
	}
	var found *tier
	kvcr := 0
	for i, raw := range cfg.Extra.Tiers {
		var t tier
		// Ports may be numbers or numeric strings: decode them as
		// json.Number, which takes both.
		d := json.NewDecoder(bytes.NewReader(raw))
		d.UseNumber()
		if err := d.Decode(&t); err != nil {
			return nil, bad("secondary_tiers[%d]: %v", i, err)
		}
		if t.Type != "kvcr" {
			continue
		}
		kvcr++
		hint := false
		for _, c := range t.Capabilities {
			hint = hint || c == "router_hint"
		}
		if !hint {
			continue
		}
		if found != nil {
			return nil, bad("two kvcr secondary tiers with router_capabilities router_hint")
		}
		found = &t
	}
	switch {
	case found == nil && kvcr > 0:
		return nil, bad(`its kvcr secondary tier lacks "router_hint" in router_capabilities, which vLLM's KVCR adapter requires`)
	case found == nil:
		return nil, bad("no secondary tier of type kvcr")
	case len(found.Ports) == 0:
		return nil, bad("kvcr tier without control_ports")
	case found.AdvertiseHost == nil || *found.AdvertiseHost == "":
		return nil, bad("kvcr tier without control_advertise_host: KVCR would advertise its hostname, which the router cannot know; set it, or give the endpoints")
	}
	eps := make([]Endpoint, 0, len(found.Ports))
	for k, p := range found.Ports {
		port, err := parsePort(p.String())
		if err != nil {
			return nil, bad("control_ports[%d]: %v", k, err)
		}
		addr, err := ControlEndpoint(*found.AdvertiseHost, port)
		if err != nil {
			return nil, fmt.Errorf("kv-transfer-config of %s: control_advertise_host: %w", pod, err)
		}
		eps = append(eps, Endpoint{Holder: index.Holder{Pod: pod, Rank: dpStartRank + k}, Address: addr, WorkerType: wt})
	}
	return eps, nil
}

// Errors callers may branch on.
var (
	// ErrConfig reports endpoint configuration that cannot work.
	ErrConfig = errors.New("kvhints: bad KVCR configuration")
	// ErrEndpoint reports a control endpoint that is not tcp://host:port
	// with a host peers can reach.
	ErrEndpoint = errors.New("kvhints: bad KVCR control endpoint")
)
