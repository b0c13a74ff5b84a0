// Package boundmap is a concurrent map that makes an entry for a new key
// only while it holds fewer keys than its caller allows: keys a peer
// chooses (pod names, say) can then not grow it without end, and the
// entries of keys already in it are never refused.
package boundmap

import (
	"sync"
	"sync/atomic"
)

// Map is a concurrent map from K to V with a count of its keys. The zero
// value is empty and ready. V is comparable for CompareAndDelete; values
// are usually pointers.
type Map[K comparable, V comparable] struct {
	m sync.Map
	n atomic.Int64
}

// Load returns k's value, and whether k has one.
func (m *Map[K, V]) Load(k K) (V, bool) {
	v, ok := m.m.Load(k)
	if !ok {
		var zero V
		return zero, false
	}
	return v.(V), true
}

// LoadOrNew returns k's value, making it with mk when k has none and the
// map holds fewer than limit keys (limit < 0: no bound); ok is false, and
// v the zero value, when k has none and there is no room. Two calls for a
// new key return the same value, and may both call mk.
func (m *Map[K, V]) LoadOrNew(k K, limit int, mk func() V) (v V, ok bool) {
	if v, ok := m.Load(k); ok {
		return v, true
	}
	// The slot is taken before the key, so that racing adds of new keys
	// cannot pass the bound together.
	if n := m.n.Add(1); limit >= 0 && n > int64(limit) {
		m.n.Add(-1)
		return v, false
	}
	got, loaded := m.m.LoadOrStore(k, mk())
	if loaded {
		m.n.Add(-1)
	}
	return got.(V), true
}

// CompareAndDelete deletes k if its value is v, and reports whether it
// did.
func (m *Map[K, V]) CompareAndDelete(k K, v V) bool {
	if !m.m.CompareAndDelete(k, v) {
		return false
	}
	m.n.Add(-1)
	return true
}

// Range calls fn for each key and value until fn returns false, as
// sync.Map.Range does: no key is visited twice, and one stored or
// deleted meanwhile may or may not be.
func (m *Map[K, V]) Range(fn func(K, V) bool) {
	m.m.Range(func(k, v any) bool { return fn(k.(K), v.(V)) })
}

// Len is the number of keys: exact when no call runs concurrently, else
// counting a key being made as soon as its slot is taken.
func (m *Map[K, V]) Len() int { return int(m.n.Load()) }
