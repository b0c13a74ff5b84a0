package events

import (
	"errors"
	"net/netip"
	"strconv"
	"strings"
)

// ErrBadPodName is wrapped by ValidPodName's errors.
var ErrBadPodName = errors.New("events: bad pod name")

// MaxPodNameLen is the longest pod name a Processor accepts, a DNS name's
// limit: a name reaches the index and the pull header, so a peer must not
// make it arbitrarily long.
const MaxPodNameLen = 253

// ValidPodName checks a pod name before it reaches the index or a header:
// "host:port", "[v6]:port" or "dns-name:port" (the address a pull header
// names), or a bare host for pods named by configuration; at most
// MaxPodNameLen bytes of printable ASCII. A DNS name's labels hold letters,
// digits, '-' and '_', at most 63 bytes each, and its last label is no
// number: a name that a resolver reads as an address is an address, so an
// IPv4 address must be in its one dotted-decimal form ("127.0.0.5", not
// inet_aton's "127.0.0.05", "0x7f.0.0.5", "127.5" or "2130706437", which
// the name check would otherwise take for DNS names, exempt from the
// sender's IP check) and an IPv6 one bracketed without a zone. The error
// says which rule failed and wraps ErrBadPodName.
func ValidPodName(pod string) error {
	if pod == "" {
		return podNameError("empty")
	}
	if len(pod) > MaxPodNameLen {
		return podNameError("longer than " + strconv.Itoa(MaxPodNameLen) + " bytes")
	}
	for i := 0; i < len(pod); i++ {
		if c := pod[i]; c <= ' ' || c >= 0x7f {
			return podNameError("byte " + strconv.Itoa(i) + " is not printable ASCII")
		}
	}
	host, port := pod, ""
	if strings.HasPrefix(pod, "[") {
		end := strings.IndexByte(pod, ']')
		if end < 0 {
			return podNameError("unclosed '['")
		}
		host, port = pod[1:end], pod[end+1:]
		if port == "" {
			return podNameError("a bracketed address without a port")
		}
		a, err := netip.ParseAddr(host)
		if err != nil || !a.Is6() {
			return podNameError("not an IPv6 address in brackets")
		}
		if a.Zone() != "" {
			// A zone names a local interface, no address another host can
			// reach, and PodAddr would take it for a DNS name.
			return podNameError("an IPv6 address with a zone")
		}
	} else if i := strings.LastIndexByte(pod, ':'); i >= 0 {
		host, port = pod[:i], pod[i:]
		if strings.IndexByte(host, ':') >= 0 {
			return podNameError("an IPv6 address must be in brackets")
		}
		if err := checkHost(host); err != nil {
			return err
		}
	} else if err := checkHost(host); err != nil {
		return err
	}
	if port != "" {
		p, ok := strings.CutPrefix(port, ":")
		n, err := strconv.Atoi(p)
		if !ok || err != nil || n < 1 || n > 65535 || p[0] == '+' || p[0] == '0' {
			return podNameError("the port is not a number from 1 to 65535")
		}
	}
	return nil
}

func podNameError(why string) error { return &podNameErr{why} }

type podNameErr struct{ why string }

func (e *podNameErr) Error() string { return ErrBadPodName.Error() + ": " + e.why }
func (e *podNameErr) Unwrap() error { return ErrBadPodName }

// checkHost checks that h is a DNS name or an IPv4 address in dotted
// decimal.
func checkHost(h string) error {
	if h == "" {
		return podNameError("not a host name or IPv4 address")
	}
	last := h
	for label := range strings.SplitSeq(h, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return podNameError("not a host name or IPv4 address")
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
				return podNameError("not a host name or IPv4 address")
			}
		}
		last = label
	}
	// inet_aton, which the C resolver tries before DNS, reads 1 to 4
	// parts, each decimal, octal (a leading 0) or hex (0x); a top-level
	// domain is never numeric, so a numeric last label is an address
	// whatever the other labels hold, and it must be the canonical one.
	if numericLabel(last) {
		if a, err := netip.ParseAddr(h); err != nil || !a.Is4() {
			return podNameError("an IPv4 address not in dotted decimal (a.b.c.d without leading zeros)")
		}
	}
	return nil
}

// numericLabel reports whether a label is a number as inet_aton reads one:
// decimal digits, or 0x followed by hex digits (none included: glibc reads
// "0x" as 0).
func numericLabel(l string) bool {
	if len(l) >= 2 && l[0] == '0' && (l[1] == 'x' || l[1] == 'X') {
		for i := 2; i < len(l); i++ {
			c := l[i]
			if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
				return false
			}
		}
		return true
	}
	for i := 0; i < len(l); i++ {
		if l[i] < '0' || l[i] > '9' {
			return false
		}
	}
	return true
}

// PodAddr returns the IP address a pod is named by, when its host is an IP
// literal ("10.0.0.1:8000", "[fd00::1]:8000", "10.0.0.1"); ok is false for
// a DNS name. A transport that knows a message's sender address checks it
// against this (see package events/zmq).
func PodAddr(pod string) (addr netip.Addr, ok bool) {
	host := pod
	if strings.HasPrefix(pod, "[") {
		if end := strings.IndexByte(pod, ']'); end > 0 {
			host = pod[1:end]
		}
	} else if i := strings.LastIndexByte(pod, ':'); i >= 0 {
		host = pod[:i]
	}
	a, err := netip.ParseAddr(host)
	if err != nil || a.Zone() != "" {
		return netip.Addr{}, false
	}
	return a.Unmap(), true
}
