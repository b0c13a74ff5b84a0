package events

import (
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/internal/ratelog"
	"github.com/kvsource/kvsource/internal/testenv"
)

func TestLogLimiterLogsOncePerIntervalAndCountsTheRest(t *testing.T) {
	var buf testenv.SyncBuffer
	clock := time.Unix(1e9, 0)
	l := &logLimiter{log: testenv.TextLogger(&buf), lim: &ratelog.Limiter{Interval: 50 * time.Millisecond, Now: func() time.Time { return clock }}}
	for seq := range 100 {
		l.logf(slog.LevelError, "bad payload", "pod-a", "seq", seq)
	}
	l.logf(slog.LevelError, "bad payload", "pod-b", "seq", 7)
	require.Equal(t, 2, strings.Count(buf.String(), "bad payload"), "one line per pod")
	require.Contains(t, buf.String(), "pod=pod-a seq=0")
	clock = clock.Add(60 * time.Millisecond)
	l.logf(slog.LevelError, "bad payload", "pod-a", "seq", 100)
	require.Contains(t, buf.String(), "pod=pod-a seq=100 suppressed=99")
}

func TestLogLimiterLogsAnyOncePerIntervalWhateverThePod(t *testing.T) {
	var buf testenv.SyncBuffer
	l := &logLimiter{log: testenv.TextLogger(&buf), lim: &ratelog.Limiter{Interval: time.Hour}}
	for i := range 100 {
		l.logAny(slog.LevelWarn, "new holder dropped", fmt.Sprintf("pod-%d", i), "seq", i)
	}
	l.logf(slog.LevelWarn, "new holder dropped", "pod-0", "seq", 0)
	require.Equal(t, 2, strings.Count(buf.String(), "new holder dropped"), "one line for all pods, and logf's own")
	require.Contains(t, buf.String(), "pod=pod-0 seq=0")
}

// Thousands of names logging one kind of line each, once per name, write
// at most the kind's budget per interval; the next line says how many the
// budget left out.
func TestLogLimiterBoundsEachKindAcrossAllPods(t *testing.T) {
	var buf testenv.SyncBuffer
	clock := time.Unix(1e9, 0)
	l := &logLimiter{log: testenv.TextLogger(&buf), lim: &ratelog.Limiter{Interval: time.Second, Budget: 10, Now: func() time.Time { return clock }}}
	for i := range 6000 {
		l.logf(slog.LevelWarn, "pod disconnected", fmt.Sprintf("10.1.%d.%d:8000", i/256, i%256))
	}
	l.logf(slog.LevelWarn, "another kind", "pod-a")
	require.Equal(t, 10, strings.Count(buf.String(), "pod disconnected"))
	require.Equal(t, 1, strings.Count(buf.String(), "another kind"), "each kind has a budget of its own")
	clock = clock.Add(time.Second)
	l.logf(slog.LevelWarn, "pod disconnected", "10.2.0.1:8000")
	require.Contains(t, buf.String(), "pod=10.2.0.1:8000 left_out=5990")
	_, ok := l.allow("pod disconnected")
	require.True(t, ok)
}

func TestProcessorLogsAFloodOfDisconnectsWithinItsBudget(t *testing.T) {
	var buf testenv.SyncBuffer
	p := startProcessor(t, Config{Sink: eventstest.NewRecSink(), Logger: testenv.TextLogger(&buf), LogBudget: 5})
	for i := range 2000 {
		pod := fmt.Sprintf("10.1.%d.%d:8000", i/256, i%256)
		p.Handle(t.Context(), Message{Pod: pod, Model: "m", Payload: storedPayload(t, uint64(i+1))})
	}
	require.NoError(t, p.Sync(t.Context()))
	start := time.Now()
	for i := range 2000 {
		p.PodConnected(fmt.Sprintf("10.1.%d.%d:8000", i/256, i%256), false)
	}
	elapsed := time.Since(start)
	lines := strings.Count(buf.String(), "pod disconnected")
	t.Logf("2000 disconnects in %v: %d lines", elapsed.Round(time.Millisecond), lines)
	require.LessOrEqual(t, lines, 5*(int(elapsed/time.Second)+1))
	require.Equal(t, uint64(2000), p.Stats().Disconnects)
}
