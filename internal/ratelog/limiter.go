package ratelog

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// A Limiter bounds the log lines that peers can cause under names of
// their choosing. Each (kind, key) pair, a kind being a line's message
// and a key what it names (a pod), passes at most once an Interval; on
// top of that each kind passes at most Budget lines an Interval whatever
// its keys, since thousands of made-up names would otherwise each log
// their own line. What either held back, the next line let through
// reports. Set its fields before the first call; the zero value passes
// every line.
type Limiter struct {
	// Interval is how often a (kind, key) pair may log, and the period
	// of each kind's budget.
	Interval time.Duration
	// Budget is the lines of one kind let through an Interval, all keys
	// together; 0 is unbounded.
	Budget int
	// Now is the clock, time.Now when nil; tests step their own so that
	// no interval passes while they log.
	Now func() time.Time

	mu    sync.Mutex
	keys  map[lineKey]*keyState
	kinds map[string]*kindState
	// other is the budget the kinds past maxKinds share.
	other kindState
}

type lineKey struct{ kind, key string }

type keyState struct {
	at         time.Time
	suppressed int
}

// kindState is one kind's budget in its current interval.
type kindState struct {
	start   time.Time
	n       int
	leftOut int
}

const (
	// maxKeys bounds the (kind, key) pairs remembered; past it they are
	// forgotten together: many keys each lose one line at worst, and each
	// kind's budget still holds.
	maxKeys = 4096
	// maxKinds bounds the kinds with a budget of their own; the others
	// share one. Kinds are messages, constants in the code, but a few
	// append a reason.
	maxKinds = 1024
)

// Allow reports whether a line of kind naming key may be logged now, and
// how many lines of the pair it held back since the last (suppressed) and
// how many of the kind the budget left out before it (leftOut). Key ""
// limits the kind once an Interval whatever it names.
func (l *Limiter) Allow(kind, key string) (suppressed, leftOut int, ok bool) {
	now := l.clock()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		l.keys = map[lineKey]*keyState{}
	}
	k := lineKey{kind, key}
	st := l.keys[k]
	if st == nil {
		if len(l.keys) > maxKeys {
			clear(l.keys)
		}
		st = &keyState{}
		l.keys[k] = st
	} else if now.Sub(st.at) < l.Interval {
		st.suppressed++
		return 0, 0, false
	}
	suppressed = st.suppressed
	st.at, st.suppressed = now, 0
	leftOut, ok = l.spend(kind, now)
	return suppressed, leftOut, ok
}

// Spend reports whether a line of kind that its caller limits by itself
// (once per holder and interval, say) fits the kind's budget, and how
// many lines of the kind the budget left out before it.
func (l *Limiter) Spend(kind string) (leftOut int, ok bool) {
	now := l.clock()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.spend(kind, now)
}

func (l *Limiter) clock() time.Time {
	if l.Now != nil {
		return l.Now()
	}
	return time.Now()
}

// spend takes one line of kind from its budget; l.mu is held.
func (l *Limiter) spend(kind string, now time.Time) (leftOut int, ok bool) {
	if l.Budget <= 0 {
		return 0, true
	}
	if l.kinds == nil {
		l.kinds = map[string]*kindState{}
	}
	ks := l.kinds[kind]
	if ks == nil {
		if len(l.kinds) < maxKinds {
			ks = &kindState{start: now}
			l.kinds[kind] = ks
		} else {
			ks = &l.other
		}
	}
	if now.Sub(ks.start) >= l.Interval {
		ks.start, ks.n = now, 0
	}
	if ks.n >= l.Budget {
		ks.leftOut++
		return 0, false
	}
	ks.n++
	leftOut, ks.leftOut = ks.leftOut, 0
	return leftOut, true
}

// WithLeftOut adds a line's left_out count, when there is one.
func WithLeftOut(args []any, leftOut int) []any {
	if leftOut > 0 {
		return append(args, "left_out", leftOut)
	}
	return args
}

// Budgeted returns log with each kind of line (its message) at Warn and
// above let through at most once an interval, whatever it names, loggers
// derived with With included; the next line of a kind let through says
// how many it left out ("left_out"). Lower levels pass as they are. It is
// for a logger whose lines name what peers wrote (a shared stream, a
// bucket anyone with credentials writes to), where a limit per name would
// still write a line per name.
func Budgeted(log *slog.Logger, interval time.Duration) *slog.Logger {
	return slog.New(&budgetHandler{next: log.Handler(), lim: &Limiter{Interval: interval, Budget: 1}})
}

type budgetHandler struct {
	next slog.Handler
	lim  *Limiter
}

func (h *budgetHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.next.Enabled(ctx, l)
}

func (h *budgetHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelWarn {
		return h.next.Handle(ctx, r)
	}
	leftOut, ok := h.lim.Spend(r.Message)
	if !ok {
		return nil
	}
	if leftOut > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Int("left_out", leftOut))
	}
	return h.next.Handle(ctx, r)
}

func (h *budgetHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &budgetHandler{next: h.next.WithAttrs(as), lim: h.lim}
}

func (h *budgetHandler) WithGroup(name string) slog.Handler {
	return &budgetHandler{next: h.next.WithGroup(name), lim: h.lim}
}
