package index

import (
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeClock is a clock tests step.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time       { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) step(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// specKeys are n keys from..from+n-1 of one prompt.
func specKeys(from, n uint64) []uint64 {
	ks := make([]uint64, n)
	for i := range ks {
		ks[i] = from + uint64(i)
	}
	return ks
}

func specHit(ix *Index, keys []uint64, h Holder) (prefix, spec int) {
	var res Result
	ix.Lookup("m", keys, &res)
	if hit := res.Holder(h); hit != nil {
		return hit.Prefix, hit.Tier(TierSpeculative)
	}
	return 0, 0
}

func TestSpeculativeEntriesScoreUntilTheirTTLAndArePartOfNoSnapshot(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ix := New(Config{})
	s := NewSpeculative(ix, SpeculativeConfig{TTL: 2 * time.Second, Now: clock.now})
	dest := Holder{Pod: "10.0.0.1:8000"}
	keys := specKeys(100, 8)
	s.Record("m", dest, keys)
	prefix, spec := specHit(ix, keys, dest)
	require.Equal(t, 8, prefix)
	require.Equal(t, 8, spec)

	// Not saved: a guess does not outlive the process.
	path := filepath.Join(t.TempDir(), "snap")
	require.NoError(t, ix.SaveFile(path, map[Holder]uint64{dest: 1}))
	loaded, _, err := LoadFile(path, Config{})
	require.NoError(t, err)
	prefix, _ = specHit(loaded, keys, dest)
	require.Zero(t, prefix)

	clock.step(time.Second)
	s.Expire()
	_, spec = specHit(ix, keys, dest)
	require.Equal(t, 8, spec, "kept within its TTL")
	clock.step(time.Second)
	s.Expire()
	prefix, _ = specHit(ix, keys, dest)
	require.Zero(t, prefix, "gone after its TTL")
	st := s.Stats()
	require.Equal(t, uint64(1), st.Recorded)
	require.Equal(t, uint64(1), st.Expired)
	require.Zero(t, st.Entries)
	require.Zero(t, st.Bytes)
}

func TestSpeculativeEntriesGiveWayToTheEnginesEventsAndItsEvictions(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ix := New(Config{})
	s := NewSpeculative(ix, SpeculativeConfig{TTL: time.Minute, Now: clock.now})
	dest, other := Holder{Pod: "10.0.0.1:8000"}, Holder{Pod: "10.0.0.2:8000"}
	keys := specKeys(100, 8)
	s.Record("m", dest, keys)
	// The engine stores the first 5 blocks for real: they leave the
	// speculative tier, the rest stay.
	s.Store(Blocks{Model: "m", Holder: dest, Tier: TierGPU, Keys: keys[:5]})
	var res Result
	ix.Lookup("m", keys, &res)
	hit := res.Holder(dest)
	require.NotNil(t, hit)
	require.Equal(t, 8, hit.Prefix)
	require.Equal(t, 5, hit.Tier(TierGPU))
	require.Zero(t, hit.Tier(TierSpeculative), "block 0 is no longer a guess")
	require.Equal(t, 3, ix.Run("m", dest, keys, 5, []string{TierSpeculative}), "blocks 5-7 still are")
	// The engine evicts block 6: the guess of it goes too.
	s.Remove("m", dest, TierGPU, 0, keys[6:7])
	require.Equal(t, 1, ix.Run("m", dest, keys, 5, []string{TierSpeculative}))
	// Another holder's events do not touch dest's guesses.
	s.Store(Blocks{Model: "m", Holder: other, Tier: TierGPU, Keys: keys})
	require.Equal(t, 1, ix.Run("m", dest, keys, 5, []string{TierSpeculative}))
	require.Positive(t, s.Stats().Replaced)
}

func TestSpeculativeEntriesAreBoundedInBytesOldestFirst(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ix := New(Config{})
	per := int64(8*16 + specEntryOverhead)
	s := NewSpeculative(ix, SpeculativeConfig{TTL: time.Hour, MaxBytes: 3 * per, Now: clock.now})
	var prompts [][]uint64
	for i := range 5 {
		keys := specKeys(uint64(1000*(i+1)), 16)
		prompts = append(prompts, keys)
		s.Record("m", Holder{Pod: "10.0.0.1:8000", Rank: i}, keys)
		clock.step(time.Millisecond)
	}
	st := s.Stats()
	require.Equal(t, 3, st.Entries)
	require.LessOrEqual(t, st.Bytes, 3*per)
	for i, keys := range prompts {
		prefix, _ := specHit(ix, keys, Holder{Pod: "10.0.0.1:8000", Rank: i})
		if i < 2 {
			require.Zero(t, prefix, "the oldest went first")
		} else {
			require.Equal(t, 16, prefix)
		}
	}
	// An entry larger than the whole bound is not kept, nor makes room.
	s.Record("m", Holder{Pod: "10.0.0.9:8000"}, specKeys(9000, 1000))
	prefix, _ := specHit(ix, specKeys(9000, 1000), Holder{Pod: "10.0.0.9:8000"})
	require.Zero(t, prefix)
	require.Equal(t, 3, s.Stats().Entries)
}
