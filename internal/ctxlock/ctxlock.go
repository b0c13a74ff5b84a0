// Package ctxlock takes a sync.Mutex with a context: a caller that gives up
// waiting returns at once, and the lock, once it comes, is released for it,
// so nobody is left holding it.
package ctxlock

import (
	"context"
	"sync"
)

// Lock locks mu, or returns ctx's error when ctx ends first. On success the
// caller holds mu and must unlock it.
func Lock(ctx context.Context, mu *sync.Mutex) error {
	if mu.TryLock() {
		return nil
	}
	locked := make(chan struct{})
	go func() {
		mu.Lock()
		close(locked)
	}()
	select {
	case <-locked:
		return nil
	case <-ctx.Done():
		go func() {
			<-locked
			mu.Unlock()
		}()
		return ctx.Err()
	}
}
