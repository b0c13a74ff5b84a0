//go:build cgo

package p2p

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/transfer"
)

// freezer is a TCP proxy that can stop forwarding without closing its
// connections: to the client, a peer that hangs.
type freezer struct {
	ln     net.Listener
	target string
	frozen chan struct{}
	once   sync.Once
	mu     sync.Mutex
	conns  []net.Conn
}

func newFreezer(t *testing.T, target string) *freezer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	f := &freezer{ln: ln, target: target, frozen: make(chan struct{})}
	go f.serve()
	t.Cleanup(f.close)
	return f
}

func (f *freezer) addr() string { return f.ln.Addr().String() }

func (f *freezer) freeze() { f.once.Do(func() { close(f.frozen) }) }

func (f *freezer) serve() {
	for {
		in, err := f.ln.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp", f.target)
		if err != nil {
			in.Close()
			continue
		}
		f.mu.Lock()
		f.conns = append(f.conns, in, out)
		f.mu.Unlock()
		go f.pipe(in, out)
		go f.pipe(out, in)
	}
}

func (f *freezer) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-f.frozen:
			return
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				return
			}
			return
		}
	}
}

func (f *freezer) close() {
	f.freeze()
	f.ln.Close()
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.conns {
		c.Close()
	}
}

func TestHeartbeatTimeoutLosesAHungPeer(t *testing.T) {
	hb := Heartbeat{Interval: 50 * time.Millisecond, Timeout: 300 * time.Millisecond, TTL: 300 * time.Millisecond}
	f := newFixture(t, fixtureOpts{stored: 1, skipConnect: true,
		producer: func(c *ProducerConfig) { c.Heartbeat = hb },
		client:   func(c *ClientConfig) { c.Heartbeat = hb }})
	proxy := newFreezer(t, f.prod.ID())
	ctx := context.Background()
	s, err := f.client.Connect(ctx, proxy.addr())
	require.NoError(t, err)
	hits, err := s.Lookup(ctx, []transfer.Key{testKey(0)})
	require.NoError(t, err)
	require.Equal(t, []bool{true}, hits)

	proxy.freeze()
	start := time.Now()
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = s.Lookup(lctx, []transfer.Key{testKey(0)})
	require.ErrorIs(t, err, transfer.ErrPeerLost, "the unanswered PINGs end the session")
	require.Less(t, time.Since(start), 5*time.Second)
}
