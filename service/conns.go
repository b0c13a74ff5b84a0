package service

import (
	"net"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Connections are bounded by Config.MaxConnections: without a bound,
// 20,000 idle keep-alive connections took every descriptor, so that
// /healthz timed out, engines could not connect and snapshot saves failed.
// At the bound, a new connection first makes the server close its idle
// ones (keep-alives are off until the count falls to half the bound) and is
// served; with none idle it is closed at once and counted.

// connLimit is the accounting of Serve's connections.
type connLimit struct {
	max      int64
	srv      *http.Server
	open     atomic.Int64
	idle     atomic.Int64
	shedding atomic.Bool // keep-alives off

	refused prometheus.Counter
	gauge   prometheus.GaugeFunc
}

func newConnLimit(max int, srv *http.Server) *connLimit {
	c := &connLimit{max: int64(max), srv: srv}
	c.refused = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsource_http_connections_refused_total",
		Help: "Connections closed at accept because --http-max-connections were open and none was idle."})
	c.gauge = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsource_http_connections",
		Help: "HTTP connections open, bounded by --http-max-connections."}, func() float64 { return float64(c.open.Load()) })
	srv.ConnState = c.state
	return c
}

// state follows the server's connections in and out of idle.
func (c *connLimit) state(conn net.Conn, st http.ConnState) {
	lc, ok := conn.(*limitConn)
	if !ok {
		return
	}
	idle := st == http.StateIdle
	if lc.idle.Swap(idle) != idle {
		if idle {
			c.idle.Add(1)
		} else {
			c.idle.Add(-1)
		}
	}
}

// accepted decides on a connection just accepted: false closes it.
func (c *connLimit) accepted() bool {
	n := c.open.Add(1)
	if n <= c.max {
		return true
	}
	if c.idle.Load() > 0 {
		c.shed()
		return true
	}
	c.open.Add(-1)
	c.refused.Inc()
	return false
}

// shed turns keep-alives off, which closes the idle connections now and
// every other after its answer, until closed sees the count at half.
func (c *connLimit) shed() {
	if c.shedding.CompareAndSwap(false, true) {
		c.srv.SetKeepAlivesEnabled(false)
	}
}

func (c *connLimit) closed() {
	if c.open.Add(-1) <= c.max/2 && c.shedding.CompareAndSwap(true, false) {
		c.srv.SetKeepAlivesEnabled(true)
	}
}

// limitListener applies a connLimit to the connections it accepts.
type limitListener struct {
	net.Listener
	c *connLimit
}

func (l limitListener) Accept() (net.Conn, error) {
	for {
		conn, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.c.accepted() {
			return &limitConn{Conn: conn, c: l.c}, nil
		}
		_ = conn.Close()
	}
}

type limitConn struct {
	net.Conn
	c    *connLimit
	idle atomic.Bool
	once sync.Once
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.c.closed)
	return err
}
