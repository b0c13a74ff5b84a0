package ratelog

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLimiterLetsEachKindAndKeyThroughOnceAnIntervalAndCountsTheRest(t *testing.T) {
	clock := time.Unix(1e9, 0)
	l := &Limiter{Interval: 50 * time.Millisecond, Now: func() time.Time { return clock }}
	_, _, ok := l.Allow("bad payload", "pod-a")
	require.True(t, ok)
	for range 99 {
		_, _, ok := l.Allow("bad payload", "pod-a")
		require.False(t, ok)
	}
	_, _, ok = l.Allow("bad payload", "pod-b")
	require.True(t, ok, "a key of its own")
	_, _, ok = l.Allow("other kind", "pod-a")
	require.True(t, ok, "a kind of its own")
	clock = clock.Add(60 * time.Millisecond)
	suppressed, leftOut, ok := l.Allow("bad payload", "pod-a")
	require.True(t, ok)
	require.Equal(t, 99, suppressed)
	require.Zero(t, leftOut)
}

func TestLimiterWithTheEmptyKeyLimitsAKindWhateverItNames(t *testing.T) {
	l := &Limiter{Interval: time.Hour}
	passed := 0
	for range 100 {
		if _, _, ok := l.Allow("new holder dropped", ""); ok {
			passed++
		}
	}
	require.Equal(t, 1, passed)
	_, _, ok := l.Allow("new holder dropped", "pod-0")
	require.True(t, ok, "a pod's own line is another pair")
}

// Thousands of keys logging one kind of line each, once per key, pass at
// most the kind's budget an interval; the next line says how many the
// budget left out.
func TestLimiterBoundsEachKindAcrossAllKeys(t *testing.T) {
	clock := time.Unix(1e9, 0)
	l := &Limiter{Interval: time.Second, Budget: 10, Now: func() time.Time { return clock }}
	passed := 0
	for i := range 6000 {
		if _, _, ok := l.Allow("pod disconnected", fmt.Sprintf("10.1.%d.%d:8000", i/256, i%256)); ok {
			passed++
		}
	}
	require.Equal(t, 10, passed)
	_, _, ok := l.Allow("another kind", "pod-a")
	require.True(t, ok, "each kind has a budget of its own")
	clock = clock.Add(time.Second)
	_, leftOut, ok := l.Allow("pod disconnected", "10.2.0.1:8000")
	require.True(t, ok)
	require.Equal(t, 5990, leftOut)
	_, ok = l.Spend("pod disconnected")
	require.True(t, ok)
}

func TestLimiterSharesOneBudgetAmongTheKindsPastItsBound(t *testing.T) {
	l := &Limiter{Interval: time.Hour, Budget: 1}
	passed := 0
	for i := range 10 * maxKinds {
		if _, ok := l.Spend(fmt.Sprint("kind ", i)); ok {
			passed++
		}
	}
	require.Len(t, l.kinds, maxKinds)
	require.Equal(t, maxKinds+1, passed, "one line each, then one for all the others")
}

func TestZeroLimiterPassesEveryLine(t *testing.T) {
	var l Limiter
	for range 10 {
		suppressed, leftOut, ok := l.Allow("kind", "key")
		require.True(t, ok)
		require.Zero(t, suppressed+leftOut)
	}
}

func TestBudgetedPassesEachKindOnceAnIntervalAcrossNamesAndSaysHowManyItLeftOut(t *testing.T) {
	var buf bytes.Buffer
	log := Budgeted(slog.New(slog.NewTextHandler(&buf, nil)), 50*time.Millisecond)
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
	}, 10*time.Second, 10*time.Millisecond)
	require.Contains(t, buf.String(), "replica=r")
	require.Regexp(t, `left_out=(99|\d{3,})\b`, buf.String(), "the 99 held back, and any tries since")
}

func TestBudgetedBoundsTheKindsItTellsApart(t *testing.T) {
	var buf bytes.Buffer
	log := Budgeted(slog.New(slog.NewTextHandler(&buf, nil)), time.Hour)
	for i := range 10 * maxKinds {
		log.Warn(fmt.Sprint("kind ", i))
	}
	require.Equal(t, maxKinds+1, strings.Count(buf.String(), "\n"), "one line each, then one for all the others")
}
