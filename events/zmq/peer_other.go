//go:build cgo && !unix

package zmq

import "net/netip"

// peerOf cannot read a socket's peer here, so bind-mode pods are never
// reported disconnected.
func peerOf(int) (netip.Addr, bool) { return netip.Addr{}, false }
