package natsstream

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/kvsource/kvsource/internal/ratelog"
)

// logBudgetInterval is how often one kind of warning may be logged. A
// replica is fed whatever anyone with publish rights put on the stream,
// under whatever pod names: a limit per name (the events processor's)
// still writes a line per name, so a budget per kind of line bounds them
// all.
const logBudgetInterval = 10 * time.Second

// maxLogKinds bounds the kinds budgetHandler tells apart; the others share
// one budget. The kinds are the messages, constants in the code.
const maxLogKinds = 256

// budgetHandler passes each kind of line (its message) at Warn and above
// at most once an interval across every name, logger derived with With
// included, and adds to the next one let through how many it left out
// ("left_out"). Lower levels pass as they are.
type budgetHandler struct {
	next     slog.Handler
	interval time.Duration
	gates    *logGates
}

type logGates struct {
	mu    sync.Mutex
	kinds map[string]*ratelog.Gate
	other ratelog.Gate
}

func withLogBudget(log *slog.Logger, interval time.Duration) *slog.Logger {
	return slog.New(&budgetHandler{next: log.Handler(), interval: interval, gates: &logGates{kinds: map[string]*ratelog.Gate{}}})
}

func (g *logGates) gate(msg string) *ratelog.Gate {
	g.mu.Lock()
	defer g.mu.Unlock()
	if k, ok := g.kinds[msg]; ok {
		return k
	}
	if len(g.kinds) >= maxLogKinds {
		return &g.other
	}
	k := new(ratelog.Gate)
	g.kinds[msg] = k
	return k
}

func (h *budgetHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.next.Enabled(ctx, l)
}

func (h *budgetHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelWarn {
		return h.next.Handle(ctx, r)
	}
	skipped, ok := h.gates.gate(r.Message).Allow(h.interval)
	if !ok {
		return nil
	}
	if skipped > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Int64("left_out", skipped))
	}
	return h.next.Handle(ctx, r)
}

func (h *budgetHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &budgetHandler{next: h.next.WithAttrs(as), interval: h.interval, gates: h.gates}
}

func (h *budgetHandler) WithGroup(name string) slog.Handler {
	return &budgetHandler{next: h.next.WithGroup(name), interval: h.interval, gates: h.gates}
}
