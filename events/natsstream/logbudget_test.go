package natsstream

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLogBudgetPassesEachKindOnceAnIntervalAcrossNamesAndSaysHowManyItLeftOut(t *testing.T) {
	var buf bytes.Buffer
	log := withLogBudget(slog.New(slog.NewTextHandler(&buf, nil)), 50*time.Millisecond)
	derived := log.With("replica", "r")
	for i := range 100 {
		derived.Warn("dropped", "pod", fmt.Sprint(i))
		log.Warn("gap", "pod", fmt.Sprint(i))
		log.Info("stored snapshot") // lower levels are not budgeted
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Len(t, lines, 2+100)
	require.Equal(t, 1, strings.Count(buf.String(), "msg=dropped"))
	require.Equal(t, 1, strings.Count(buf.String(), "msg=gap"))
	require.NotContains(t, buf.String(), "left_out")

	buf.Reset()
	require.Eventually(t, func() bool {
		derived.Warn("dropped", "pod", "again")
		return strings.Contains(buf.String(), "msg=dropped")
	}, waitLong, 10*time.Millisecond)
	require.Contains(t, buf.String(), "replica=r")
	require.Regexp(t, `left_out=(99|\d{3,})\b`, buf.String(), "the 99 held back, and any tries since")
}

func TestLogBudgetBoundsTheKindsItTellsApart(t *testing.T) {
	var buf bytes.Buffer
	log := withLogBudget(slog.New(slog.NewTextHandler(&buf, nil)), time.Hour)
	for i := range 10 * maxLogKinds {
		log.Warn(fmt.Sprint("kind ", i))
	}
	h := log.Handler().(*budgetHandler)
	require.Len(t, h.gates.kinds, maxLogKinds)
	require.Equal(t, maxLogKinds+1, strings.Count(buf.String(), "\n"), "one line each, then one for all the others")
}
