// Package ratelog lets log lines through at most so often and counts the
// others, so that a peer or client repeating bad input cannot flood the
// log with it. A Gate is one kind of line: its zero value is ready, and it
// takes no lock, so that request handlers and event workers call it on
// their own paths. A Limiter bounds many kinds and the names their lines
// carry, which peers choose; Budgeted puts a logger's warnings on a
// Limiter's budget.
package ratelog

import (
	"sync/atomic"
	"time"
)

// epoch is the base of Gate's times: the monotonic clock, which a step of
// the wall clock does not move.
var epoch = time.Now()

// A Gate is one kind of log line.
type Gate struct {
	last    atomic.Int64 // nanoseconds after epoch, plus an interval, of the last line let through
	skipped atomic.Int64
}

// Allow reports whether a line may be logged now, the first or the first
// an interval after the last, and how many were held back since then.
func (g *Gate) Allow(interval time.Duration) (skipped int64, ok bool) {
	// An interval on, so that the first call passes.
	now := int64(time.Since(epoch) + interval)
	last := g.last.Load()
	if now-last < int64(interval) || !g.last.CompareAndSwap(last, now) {
		g.skipped.Add(1)
		return 0, false
	}
	return g.skipped.Swap(0), true
}
