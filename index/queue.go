package index

// A queue is one holder's eviction order: its holdings, oldest first, as
// runs of consecutive entry ids in one lane (a holder storing new blocks
// gets consecutive ids, so a store is mostly one run). It names every
// holding of its lanes exactly once, held or ghost (removed, its place
// kept until the queue drops it); see elem.
//
// An item packs a run: first id (bits 0-31), lane (32-34), length - 1
// (35-63). Only the queue's methods read or write items.
type queue struct {
	items []uint64
	head  int
	n     int64 // ids named, ghosts included
}

const (
	runLaneShift = 32
	runLenShift  = 35
	maxRun       = 1 << (64 - runLenShift)
)

func packRun(first uint32, lane int, n int) uint64 {
	return uint64(first) | uint64(lane)<<runLaneShift | uint64(n-1)<<runLenShift
}

func unpackRun(it uint64) (first uint32, lane int, n int) {
	return uint32(it), int(it>>runLaneShift) & 7, int(it>>runLenShift) + 1
}

// push appends id in lane, extending the last run when it continues it.
func (q *queue) push(id uint32, lane int) {
	q.n++
	if k := len(q.items) - 1; k >= q.head {
		if first, l, n := unpackRun(q.items[k]); l == lane && n < maxRun && uint64(first)+uint64(n) == uint64(id) {
			q.items[k] = packRun(first, lane, n+1)
			return
		}
	}
	q.items = append(q.items, packRun(id, lane, 1))
}

// pop takes the oldest id.
func (q *queue) pop() (id uint32, lane int, ok bool) {
	if q.head == len(q.items) {
		return 0, 0, false
	}
	first, lane, n := unpackRun(q.items[q.head])
	if n == 1 {
		q.items[q.head] = 0
		q.head++
		if q.head == len(q.items) {
			q.items, q.head = q.items[:0], 0
		} else if q.head >= 64 && q.head*2 >= len(q.items) {
			// A holder at capacity pops as it pushes and never empties:
			// the popped front goes, or appends would keep copying it.
			k := copy(q.items, q.items[q.head:])
			clear(q.items[k:])
			q.items, q.head = q.items[:k], 0
		}
	} else {
		q.items[q.head] = packRun(first+1, lane, n-1)
	}
	q.n--
	return first, lane, true
}

// each calls f with each id from the oldest, until f returns false.
func (q *queue) each(f func(id uint32, lane int) bool) {
	for _, it := range q.items[q.head:] {
		first, lane, n := unpackRun(it)
		for i := range n {
			if !f(first+uint32(i), lane) {
				return
			}
		}
	}
}

// keep drops the ids for which f returns false, keeping the others in
// order.
func (q *queue) keep(f func(id uint32, lane int) bool) {
	out := queue{items: make([]uint64, 0, len(q.items)-q.head)}
	q.each(func(id uint32, lane int) bool {
		if f(id, lane) {
			out.push(id, lane)
		}
		return true
	})
	*q = out
}
