package main

// lru is one cache tier of a pod: a fixed number of block slots, evicting the
// least recently used block when full. Nodes live in slices linked by index,
// so a tier of tens of thousands of blocks costs no per-block allocation.
type lru struct {
	cap        int
	slot       map[uint64]int32
	key        []uint64
	prev, next []int32 // index links; 0 is the sentinel (head of the list)
	free       []int32
}

func newLRU(capacity int) *lru {
	l := &lru{
		cap:  capacity,
		slot: make(map[uint64]int32, capacity),
		key:  make([]uint64, 1, capacity+1),
		prev: make([]int32, 1, capacity+1),
		next: make([]int32, 1, capacity+1),
	}
	return l
}

func (l *lru) len() int { return len(l.slot) }

func (l *lru) has(k uint64) bool {
	_, ok := l.slot[k]
	return ok
}

func (l *lru) unlink(i int32) {
	l.next[l.prev[i]] = l.next[i]
	l.prev[l.next[i]] = l.prev[i]
}

// pushFront makes i the most recently used.
func (l *lru) pushFront(i int32) {
	l.prev[i] = 0
	l.next[i] = l.next[0]
	l.prev[l.next[0]] = i
	l.next[0] = i
}

// touch marks k most recently used; it reports whether k is held.
func (l *lru) touch(k uint64) bool {
	i, ok := l.slot[k]
	if ok {
		l.unlink(i)
		l.pushFront(i)
	}
	return ok
}

// insert adds k as most recently used, appending the keys it evicts to
// evicted. Inserting a held key only touches it.
func (l *lru) insert(k uint64, evicted []uint64) []uint64 {
	if l.touch(k) {
		return evicted
	}
	if len(l.slot) >= l.cap {
		victim := l.prev[0]
		l.unlink(victim)
		evicted = append(evicted, l.key[victim])
		delete(l.slot, l.key[victim])
		l.free = append(l.free, victim)
	}
	var i int32
	if n := len(l.free); n > 0 {
		i = l.free[n-1]
		l.free = l.free[:n-1]
	} else {
		i = int32(len(l.key))
		l.key = append(l.key, 0)
		l.prev = append(l.prev, 0)
		l.next = append(l.next, 0)
	}
	l.key[i] = k
	l.slot[k] = i
	l.pushFront(i)
	return evicted
}

// keys returns the held keys, most recently used first.
func (l *lru) keys() []uint64 {
	out := make([]uint64, 0, len(l.slot))
	for i := l.next[0]; i != 0; i = l.next[i] {
		out = append(out, l.key[i])
	}
	return out
}

// reset empties the tier.
func (l *lru) reset() { *l = *newLRU(l.cap) }
