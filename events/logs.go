package events

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// logLimiter keeps a hostile or broken peer from flooding the log: each
// (message, pod) logs at most once per interval, and the next line it
// logs says how many were suppressed meanwhile.
type logLimiter struct {
	log      *slog.Logger
	interval time.Duration
	// now is the clock, time.Now when nil; tests step their own so that
	// no interval passes while they log.
	now  func() time.Time
	mu   sync.Mutex
	last map[logKey]*logState
}

type logKey struct{ msg, pod string }

type logState struct {
	at         time.Time
	suppressed int
}

func (l *logLimiter) logf(level slog.Level, msg, pod string, args ...any) {
	l.log1(logKey{msg, pod}, level, msg, pod, args)
}

// logAny is logf limited per message whatever the pod, for lines that peers
// can cause under names of their choosing.
func (l *logLimiter) logAny(level slog.Level, msg, pod string, args ...any) {
	l.log1(logKey{msg: msg}, level, msg, pod, args)
}

func (l *logLimiter) log1(key logKey, level slog.Level, msg, pod string, args []any) {
	var now time.Time
	if l.now != nil {
		now = l.now()
	} else {
		now = time.Now()
	}
	l.mu.Lock()
	if l.last == nil {
		l.last = map[logKey]*logState{}
	}
	st := l.last[key]
	if st == nil {
		if len(l.last) > 4096 {
			clear(l.last) // bounded: many pods each lose one line at worst
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
	l.mu.Unlock()
	if suppressed > 0 {
		args = append(args, "suppressed", suppressed)
	}
	l.log.Log(context.Background(), level, msg, append([]any{"pod", pod}, args...)...)
}
