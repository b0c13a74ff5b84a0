package events

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// logLimiter keeps a hostile or broken peer from flooding the log: each
// (message, pod) logs at most once per interval, and the next line it
// logs says how many were suppressed meanwhile. On top of that each kind
// of line (its message, whatever the pod) has a budget of lines per
// interval across all pods, since a peer chooses its names: thousands of
// made-up pods would otherwise each log their own line. The next line of
// a kind says how many of its lines the budget left out.
type logLimiter struct {
	log      *slog.Logger
	interval time.Duration
	// budget is the lines of one kind logged per interval, all pods
	// together; 0 is unbounded.
	budget int
	// now is the clock, time.Now when nil; tests step their own so that
	// no interval passes while they log.
	now   func() time.Time
	mu    sync.Mutex
	last  map[logKey]*logState
	kinds map[string]*kindState
}

type logKey struct{ msg, pod string }

type logState struct {
	at         time.Time
	suppressed int
}

// kindState is one kind's budget in the current interval.
type kindState struct {
	start   time.Time
	n       int
	leftOut int
}

// maxKinds bounds the kinds tracked: messages are the package's own, but a
// few append a transport's reason.
const maxKinds = 1024

func (l *logLimiter) logf(level slog.Level, msg, pod string, args ...any) {
	l.log1(logKey{msg, pod}, level, msg, pod, args)
}

// logAny is logf limited per message whatever the pod, for lines that peers
// can cause under names of their choosing.
func (l *logLimiter) logAny(level slog.Level, msg, pod string, args ...any) {
	l.log1(logKey{msg: msg}, level, msg, pod, args)
}

func (l *logLimiter) clock() time.Time {
	if l.now != nil {
		return l.now()
	}
	return time.Now()
}

func (l *logLimiter) log1(key logKey, level slog.Level, msg, pod string, args []any) {
	now := l.clock()
	l.mu.Lock()
	if l.last == nil {
		l.last = map[logKey]*logState{}
	}
	st := l.last[key]
	if st == nil {
		if len(l.last) > 4096 {
			clear(l.last) // bounded: many pods each lose one line at worst, and the kind's budget still holds
		}
		st = &logState{}
		l.last[key] = st
	} else if now.Sub(st.at) < l.interval {
		st.suppressed++
		l.mu.Unlock()
		return
	}
	suppressed := st.suppressed
	st.at, st.suppressed = now, 0
	leftOut, ok := l.spend(msg, now)
	l.mu.Unlock()
	if !ok {
		return
	}
	if suppressed > 0 {
		args = append(args, "suppressed", suppressed)
	}
	args = withLeftOut(args, leftOut)
	l.log.Log(context.Background(), level, msg, append([]any{"pod", pod}, args...)...)
}

// allow reports whether a line of kind msg that a caller limits by itself
// (once per holder and interval, say) fits the kind's budget, and how many
// lines of the kind were left out before it.
func (l *logLimiter) allow(msg string) (leftOut int, ok bool) {
	now := l.clock()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.spend(msg, now)
}

// spend takes one line of kind msg from its budget; l.mu is held.
func (l *logLimiter) spend(msg string, now time.Time) (leftOut int, ok bool) {
	if l.budget <= 0 {
		return 0, true
	}
	if l.kinds == nil {
		l.kinds = map[string]*kindState{}
	}
	ks := l.kinds[msg]
	if ks == nil {
		if len(l.kinds) >= maxKinds {
			clear(l.kinds)
		}
		ks = &kindState{start: now}
		l.kinds[msg] = ks
	}
	if now.Sub(ks.start) >= l.interval {
		ks.start, ks.n = now, 0
	}
	if ks.n >= l.budget {
		ks.leftOut++
		return 0, false
	}
	ks.n++
	leftOut, ks.leftOut = ks.leftOut, 0
	return leftOut, true
}

// withLeftOut adds a line's left_out count, when there is one.
func withLeftOut(args []any, leftOut int) []any {
	if leftOut > 0 {
		return append(args, "left_out", leftOut)
	}
	return args
}
