package boundmap

import (
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// A random sequence of operations gives what a plain map with the same
// rules gives: a new key gets an entry only below the limit, a key that
// has one keeps it, and Len and Range follow.
func TestMapBehavesAsAPlainMapWithABoundOnNewKeys(t *testing.T) {
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 1))
		var m Map[int, *int]
		model := map[int]*int{}
		made := 0
		mk := func() *int { made++; v := made; return &v }
		for op := range 300 {
			k := rng.IntN(24)
			switch rng.IntN(4) {
			case 0, 1:
				limit := rng.IntN(20) - 2 // sometimes negative: no bound
				v, ok := m.LoadOrNew(k, limit, mk)
				want, has := model[k]
				switch {
				case has:
					require.True(t, ok, "seed %d op %d: a key that has an entry", seed, op)
					require.Same(t, want, v)
				case limit < 0 || len(model) < limit:
					require.True(t, ok, "seed %d op %d: room for key %d: %d keys, limit %d", seed, op, k, len(model), limit)
					require.Equal(t, made, *v, "the value mk made")
					model[k] = v
				default:
					require.False(t, ok, "seed %d op %d: no room for key %d: %d keys, limit %d", seed, op, k, len(model), limit)
					require.Nil(t, v)
				}
			case 2:
				v, has := model[k]
				if !has || rng.IntN(3) == 0 {
					v = new(int) // a value the key does not have
				}
				deleted := m.CompareAndDelete(k, v)
				require.Equal(t, has && model[k] == v, deleted, "seed %d op %d", seed, op)
				if deleted {
					delete(model, k)
				}
			case 3:
				v, ok := m.Load(k)
				want, has := model[k]
				require.Equal(t, has, ok)
				require.Same(t, want, v)
			}
			require.Equal(t, len(model), m.Len(), "seed %d op %d", seed, op)
		}
		got := map[int]*int{}
		m.Range(func(k int, v *int) bool { got[k] = v; return true })
		require.Equal(t, model, got, "seed %d", seed)
	}
}

func TestRangeStopsWhenFnReturnsFalse(t *testing.T) {
	var m Map[int, *int]
	for k := range 10 {
		_, ok := m.LoadOrNew(k, -1, func() *int { return new(int) })
		require.True(t, ok)
	}
	visited := 0
	m.Range(func(int, *int) bool { visited++; return visited < 3 })
	require.Equal(t, 3, visited)
}

// Racing adds never pass the bound, and every caller of one key gets the
// same value.
func TestConcurrentAddsStayWithinTheBoundAndAgreeOnEachKeysValue(t *testing.T) {
	const limit, goroutines, keys = 50, 8, 200
	var m Map[int, *int]
	got := make([][keys]*int, goroutines)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for k := range keys {
				if v, ok := m.LoadOrNew(k, limit, func() *int { return new(int) }); ok {
					got[g][k] = v
				}
			}
		})
	}
	wg.Wait()
	// Refusals see the slots racing adds hold a moment, so the map can
	// end a few keys short of the bound, never past it.
	require.LessOrEqual(t, m.Len(), limit)
	require.Greater(t, m.Len(), limit-goroutines)
	n := 0
	m.Range(func(k int, v *int) bool {
		n++
		for g := range goroutines {
			if got[g][k] != nil {
				require.Same(t, v, got[g][k], "key %d", k)
			}
		}
		return true
	})
	require.Equal(t, m.Len(), n)
	for k := range keys {
		if _, ok := m.Load(k); !ok {
			for g := range goroutines {
				require.Nil(t, got[g][k], "key %d was refused yet handed a value", k)
			}
		}
	}
}
