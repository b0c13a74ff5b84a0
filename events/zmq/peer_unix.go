//go:build cgo && unix

package zmq

import (
	"net/netip"
	"syscall"
)

// peerOf returns the IP address of the TCP peer of socket fd.
func peerOf(fd int) (netip.Addr, bool) {
	sa, err := syscall.Getpeername(fd)
	if err != nil {
		return netip.Addr{}, false
	}
	switch sa := sa.(type) {
	case *syscall.SockaddrInet4:
		return netip.AddrFrom4(sa.Addr), true
	case *syscall.SockaddrInet6:
		return netip.AddrFrom16(sa.Addr).Unmap(), true
	}
	return netip.Addr{}, false
}
