package events

import (
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/internal/testenv"
)

func TestLogLimiterLogsOncePerIntervalAndCountsTheRest(t *testing.T) {
	var buf testenv.SyncBuffer
	clock := time.Unix(1e9, 0)
	l := &logLimiter{log: testenv.TextLogger(&buf), interval: 50 * time.Millisecond, now: func() time.Time { return clock }}
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
	l := &logLimiter{log: testenv.TextLogger(&buf), interval: time.Hour}
	for i := range 100 {
		l.logAny(slog.LevelWarn, "new holder dropped", fmt.Sprintf("pod-%d", i), "seq", i)
	}
	l.logf(slog.LevelWarn, "new holder dropped", "pod-0", "seq", 0)
	require.Equal(t, 2, strings.Count(buf.String(), "new holder dropped"), "one line for all pods, and logf's own")
	require.Contains(t, buf.String(), "pod=pod-0 seq=0")
}
