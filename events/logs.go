package events

import (
	"context"
	"log/slog"

	"github.com/kvsource/kvsource/internal/ratelog"
)

// logLimiter keeps a hostile or broken peer from flooding the log: each
// (message, pod) logs at most once a second, the next line it logs saying
// how many were suppressed meanwhile, and each kind of line (its message)
// to Config.LogBudget lines a second across all pods, the next line of a
// kind saying how many the budget left out (see ratelog.Limiter).
type logLimiter struct {
	log *slog.Logger
	lim *ratelog.Limiter
}

func (l *logLimiter) logf(level slog.Level, msg, pod string, args ...any) {
	l.log1(pod, level, msg, pod, args)
}

// logAny is logf limited per message whatever the pod, for lines that peers
// can cause under names of their choosing.
func (l *logLimiter) logAny(level slog.Level, msg, pod string, args ...any) {
	l.log1("", level, msg, pod, args)
}

func (l *logLimiter) log1(key string, level slog.Level, msg, pod string, args []any) {
	suppressed, leftOut, ok := l.lim.Allow(msg, key)
	if !ok {
		return
	}
	if suppressed > 0 {
		args = append(args, "suppressed", suppressed)
	}
	args = ratelog.WithLeftOut(args, leftOut)
	l.log.Log(context.Background(), level, msg, append([]any{"pod", pod}, args...)...)
}

// allow reports whether a line of kind msg that a caller limits by itself
// (once per holder and interval, say) fits the kind's budget, and how many
// lines of the kind were left out before it.
func (l *logLimiter) allow(msg string) (leftOut int, ok bool) { return l.lim.Spend(msg) }
