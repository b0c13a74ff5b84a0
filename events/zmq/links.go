//go:build cgo

package zmq

import (
	"fmt"
	"net/netip"
	"sync/atomic"

	zmq4 "github.com/pebbe/zmq4"
)

// loopback is the default of SubscriberConfig.Allow.
var loopback = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}

// monitorSeq names the monitor endpoints of the process's sockets.
var monitorSeq atomic.Uint64

// monitor starts libzmq's socket monitor on sock for events and returns
// the PAIR socket its events arrive on. It must run before sock binds or
// connects, so that no event is missed.
func monitor(sock *zmq4.Socket, events zmq4.Event) (*zmq4.Socket, error) {
	ep := fmt.Sprintf("inproc://kvsource-events-monitor-%d", monitorSeq.Add(1))
	if err := sock.Monitor(ep, events); err != nil {
		return nil, fmt.Errorf("events/zmq: socket monitor: %w", err)
	}
	pair, err := zmq4.NewSocket(zmq4.PAIR)
	if err != nil {
		_ = sock.Monitor("", 0)
		return nil, fmt.Errorf("events/zmq: monitor socket: %w", err)
	}
	_ = pair.SetLinger(0)
	if err := pair.Connect(ep); err != nil {
		_ = sock.Monitor("", 0)
		pair.Close()
		return nil, fmt.Errorf("events/zmq: monitor socket: %w", err)
	}
	return pair, nil
}

// closeMonitored closes sock and its monitor's socket mon. The monitor
// stops first: libzmq's I/O thread sends a monitored socket's events
// blocking, and one sent after mon closed (the socket's connections end
// after zmq_close returns) would block it, and every socket, for good.
func closeMonitored(sock, mon *zmq4.Socket) {
	_ = sock.Monitor("", 0)
	sock.Close()
	mon.Close()
}

// links is the bind socket's view of who is connected: its connections'
// peer addresses (libzmq's monitor reports each accepted connection's file
// descriptor, whose peer the kernel knows) and the pods whose messages
// came from each address. libzmq says which address a message came from
// ("Peer-Address"), not which of the address's connections, so when one of
// several connections from an address closes (one of a host's engines
// died, or an engine restarted and its new connection came first) it
// cannot tell whose: every pod of that address is down until its next
// message shows it alive. The receiver reads the bind socket dry before it
// applies a close, so that a dead engine's last messages do not come after
// and bring it back. When an address's last connection closes its pods are
// down until its next connection. Connect mode, which dials each engine
// itself, follows every engine exactly.
//
// The table holds the pods the processor tracks (events.Processor.Tracked:
// those with holders or messages in flight) and the newest heard: when it
// is full, or an address reaches its bound on pods, the pods the processor
// forgot are dropped first, so that neither bound fills with pods long
// gone and every pod with holders is followed.
type links struct {
	fds     map[int]netip.Addr      // accepted connection -> peer
	conns   map[netip.Addr]int      // peer -> connections
	pods    map[netip.Addr][]string // peer -> pods its messages named
	podAddr map[string]netip.Addr
	// down holds the pods a close left down while their address kept a
	// connection: each is up again with its next message.
	down    map[string]bool
	max     int // pods tracked
	perPeer int // pods one peer may name
	// tracked reports whether the processor still has state for a pod.
	tracked func(pod string) bool
}

func newLinks(maxPods, perPeer int, tracked func(pod string) bool) *links {
	return &links{fds: map[int]netip.Addr{}, conns: map[netip.Addr]int{}, pods: map[netip.Addr][]string{},
		podAddr: map[string]netip.Addr{}, down: map[string]bool{}, max: maxPods, perPeer: perPeer, tracked: tracked}
}

// accepted records a new connection; report is called for each pod whose
// state changes.
func (l *links) accepted(fd int, report func(pod string, up bool)) {
	addr, ok := peerOf(fd)
	if !ok {
		return
	}
	if _, dup := l.fds[fd]; dup {
		// Its disconnect was not reported: take it as gone.
		l.closed(fd, report)
	}
	l.fds[fd] = addr
	l.conns[addr]++
	if l.conns[addr] == 1 {
		for _, pod := range l.pods[addr] {
			report(pod, true)
		}
	}
}

func (l *links) closed(fd int, report func(pod string, up bool)) {
	addr, ok := l.fds[fd]
	if !ok {
		return
	}
	delete(l.fds, fd)
	last := l.conns[addr] == 1
	if last {
		delete(l.conns, addr)
	} else {
		l.conns[addr]--
	}
	for _, pod := range l.pods[addr] {
		wasDown := l.down[pod]
		if last {
			// Up again with the address's next connection.
			delete(l.down, pod)
		} else {
			l.down[pod] = true
		}
		if !wasDown {
			report(pod, false)
		}
	}
}

// heard records that a message of pod came from addr; ok is false when
// addr names more pods than the per-peer bound already. downAfter asks
// the caller to report the pod down once it has handed the message.
func (l *links) heard(pod string, addr netip.Addr, report func(pod string, up bool)) (ok, downAfter bool) {
	if old, known := l.podAddr[pod]; known && old == addr {
		if l.down[pod] {
			delete(l.down, pod)
			report(pod, true)
		}
		return true, false
	} else if known {
		l.forget(pod, old)
	}
	if len(l.pods[addr]) >= l.perPeer {
		l.prunePeer(addr)
		if len(l.pods[addr]) >= l.perPeer {
			return false, false
		}
	}
	if len(l.podAddr) >= l.max {
		// The processor tracks at most 3 x MaxHolders pods (those of its
		// holders, and twice MaxHolders more with messages in flight), the
		// table holds 4 x: a prune frees a quarter of it at least, so its
		// cost spreads over as many new pods.
		for pod, addr := range l.podAddr {
			if !l.tracked(pod) {
				l.forget(pod, addr)
			}
		}
	}
	if len(l.podAddr) >= l.max {
		// Untracked: the pod stays connected as far as the processor
		// knows; the holder bound evicts what this bound cannot follow.
		return true, false
	}
	l.podAddr[pod] = addr
	l.pods[addr] = append(l.pods[addr], pod)
	if l.conns[addr] > 0 || !l.tracksPeers() {
		report(pod, true)
		return true, false
	}
	// No connection from addr (the message was read after its close): the
	// processor may have no state for the pod before its message is
	// handed, so the caller reports it down after.
	return true, true
}

// tracksPeers reports whether connections are known at all: when the
// monitor's descriptors cannot be read, no pod is ever reported down.
func (l *links) tracksPeers() bool { return len(l.fds) > 0 }

// prunePeer forgets the pods of addr the processor no longer tracks.
func (l *links) prunePeer(addr netip.Addr) {
	ps := l.pods[addr]
	// Backwards: forget takes the pod out of this slice in place.
	for i := len(ps) - 1; i >= 0; i-- {
		if !l.tracked(ps[i]) {
			l.forget(ps[i], addr)
		}
	}
}

func (l *links) forget(pod string, addr netip.Addr) {
	delete(l.podAddr, pod)
	delete(l.down, pod)
	ps := l.pods[addr]
	for i, p := range ps {
		if p == pod {
			ps = append(ps[:i], ps[i+1:]...)
			break
		}
	}
	if len(ps) == 0 {
		delete(l.pods, addr)
	} else {
		l.pods[addr] = ps
	}
}
