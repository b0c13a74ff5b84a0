package main

import (
	"container/heap"
	"time"
)

// clock is a discrete-event simulation's virtual clock: callbacks run in time
// order, ties in the order they were scheduled, so a run is deterministic.
type clock struct {
	now float64 // seconds since the run started
	seq uint64
	q   eventQueue
}

type event struct {
	at  float64
	seq uint64
	f   func()
}

type eventQueue []event

func (q eventQueue) Len() int { return len(q) }
func (q eventQueue) Less(i, j int) bool {
	if q[i].at != q[j].at {
		return q[i].at < q[j].at
	}
	return q[i].seq < q[j].seq
}
func (q eventQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *eventQueue) Push(x any)   { *q = append(*q, x.(event)) }
func (q *eventQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// at schedules f at time t (not before now).
func (c *clock) at(t float64, f func()) {
	c.seq++
	heap.Push(&c.q, event{at: max(t, c.now), seq: c.seq, f: f})
}

// after schedules f d seconds from now.
func (c *clock) after(d float64, f func()) { c.at(c.now+d, f) }

// step runs the next event; it reports false when none is left.
func (c *clock) step() bool {
	if len(c.q) == 0 {
		return false
	}
	e := heap.Pop(&c.q).(event)
	c.now = e.at
	e.f()
	return true
}

// epoch anchors virtual time for SDK parts that read a time.Time clock.
var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// wall returns the virtual time as a time.Time.
func (c *clock) wall() time.Time {
	return epoch.Add(time.Duration(c.now * float64(time.Second)))
}

// shared is a processor-sharing resource: the jobs on it progress together,
// each at 1/n of full speed while n are active. A pod's compute is one (its
// prefills share the GPU), a source's link another (its pulls share the
// bandwidth).
type shared struct {
	c    *clock
	jobs []*job
	last float64 // time the jobs' remaining work was last brought up to date
	gen  uint64  // invalidates completion events scheduled before a change
	busy float64 // seconds with at least one job, for utilisation
}

type job struct {
	rem  float64 // solo seconds of work left
	done func()
}

// add starts work seconds of solo work; done runs when it completes.
func (s *shared) add(work float64, done func()) *job {
	s.advance()
	j := &job{rem: work, done: done}
	s.jobs = append(s.jobs, j)
	s.reschedule()
	return j
}

func (s *shared) advance() {
	dt := s.c.now - s.last
	s.last = s.c.now
	if dt <= 0 || len(s.jobs) == 0 {
		return
	}
	s.busy += dt
	per := dt / float64(len(s.jobs))
	for _, j := range s.jobs {
		j.rem -= per
	}
}

// eps absorbs floating-point residue: work below it counts as done.
const eps = 1e-9

func (s *shared) reschedule() {
	s.gen++
	if len(s.jobs) == 0 {
		return
	}
	m := s.jobs[0].rem
	for _, j := range s.jobs[1:] {
		m = min(m, j.rem)
	}
	gen := s.gen
	s.c.after(max(m, 0)*float64(len(s.jobs)), func() {
		if gen != s.gen {
			return
		}
		s.complete()
	})
}

func (s *shared) complete() {
	s.advance()
	var done []*job
	kept := s.jobs[:0]
	for _, j := range s.jobs {
		if j.rem <= eps {
			done = append(done, j)
		} else {
			kept = append(kept, j)
		}
	}
	clear(s.jobs[len(kept):])
	s.jobs = kept
	s.reschedule()
	for _, j := range done {
		j.done()
	}
}
