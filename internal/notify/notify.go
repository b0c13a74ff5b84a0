// Package notify wakes goroutines waiting for a condition that another
// goroutine makes true, such as "these events are applied": every waiter is
// woken on each Broadcast (none is lost, however many wait), and a
// Broadcast with nobody waiting costs one atomic load.
package notify

import (
	"context"
	"sync"
	"sync/atomic"
)

// Notifier is ready to use at its zero value. It must not be copied.
type Notifier struct {
	waiters atomic.Int32
	mu      sync.Mutex
	ch      chan struct{}
}

// Await returns nil once done reports true, or ctx's error. done is checked
// first and again after every Broadcast.
func (n *Notifier) Await(ctx context.Context, done func() bool) error {
	n.waiters.Add(1)
	defer n.waiters.Add(-1)
	for {
		n.mu.Lock()
		if n.ch == nil {
			n.ch = make(chan struct{})
		}
		ch := n.ch
		n.mu.Unlock()
		if done() {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Broadcast wakes every goroutine in Await to check its condition again.
func (n *Notifier) Broadcast() {
	if n.waiters.Load() == 0 {
		return
	}
	n.mu.Lock()
	if n.ch != nil {
		close(n.ch)
		n.ch = nil
	}
	n.mu.Unlock()
}
