package index

import (
	"fmt"
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

func TestSpeculativeEntriesStayBesideTheEnginesStoresAndGoWithItsEvictions(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ix := New(Config{})
	s := NewSpeculative(ix, SpeculativeConfig{TTL: time.Minute, Now: clock.now})
	dest, other := Holder{Pod: "10.0.0.1:8000"}, Holder{Pod: "10.0.0.2:8000"}
	keys := specKeys(100, 8)
	s.Record("m", dest, keys)
	// The engine stores the first 5 blocks for real: the guesses stay
	// beside them, so that the prompt still counts whole as guessed.
	s.Store(Blocks{Model: "m", Holder: dest, Tier: TierGPU, Keys: keys[:5]})
	var res Result
	ix.Lookup("m", keys, &res)
	hit := res.Holder(dest)
	require.NotNil(t, hit)
	require.Equal(t, 8, hit.Prefix)
	require.Equal(t, 5, hit.Tier(TierGPU))
	require.Equal(t, 8, hit.Tier(TierSpeculative))
	// The engine evicts block 6: the guess of it goes too.
	s.Remove("m", dest, TierGPU, 0, keys[6:7])
	require.Equal(t, 1, ix.Run("m", dest, keys, 5, []string{TierSpeculative}))
	// Another holder's events do not touch dest's guesses.
	s.Store(Blocks{Model: "m", Holder: other, Tier: TierGPU, Keys: keys})
	s.Remove("m", other, TierGPU, 0, keys)
	require.Equal(t, 1, ix.Run("m", dest, keys, 5, []string{TierSpeculative}))
	require.Equal(t, uint64(2), s.Stats().Replaced, "dest's store met guesses, and its eviction took one out")
}

func TestSpeculativeEntriesAreBoundedInBytesOldestFirst(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ix := New(Config{})
	per := specCost(16, 16)
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

func TestSpeculativeExpiryRemovesTheHoldersItCreatedAndKeepsTheEnginesOwn(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ix := New(Config{})
	s := NewSpeculative(ix, SpeculativeConfig{TTL: time.Second, Now: clock.now})
	engine := Holder{Pod: "10.0.0.1:8000"}
	ix.Store(Blocks{Model: "m", Holder: engine, Tier: TierGPU, Keys: specKeys(500, 4)})
	emptied := Holder{Pod: "10.0.0.2:8000"}
	ix.Store(Blocks{Model: "m", Holder: emptied, Tier: TierGPU, Keys: specKeys(600, 4)})
	ix.ClearHolder("m", emptied, "")
	keys := specKeys(100, 8)
	for i := range 100 {
		s.Record("m", Holder{Pod: fmt.Sprintf("made-up-%d:1", i)}, keys)
	}
	s.Record("m", engine, keys)
	s.Record("m", emptied, keys)
	require.Equal(t, 102, ix.Stats().Holders)

	clock.step(time.Second)
	s.Expire()
	list := ix.HolderList()
	require.Equal(t, 2, len(list), "the made-up destinations are gone")
	require.Equal(t, []HolderModel{{Model: "m", Holder: engine}, {Model: "m", Holder: emptied}}, list,
		"the engines' holders stay, even one holding nothing")
	var res Result
	ix.Lookup("m", keys, &res)
	require.Empty(t, res.Hits)
	require.Zero(t, s.Stats().Entries)
}

func TestSpeculativeHoldersTheIndexDidNotKnowAreCapped(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ix := New(Config{})
	s := NewSpeculative(ix, SpeculativeConfig{TTL: time.Second, MaxHolders: 3, Now: clock.now})
	engine := Holder{Pod: "10.0.0.1:8000"}
	ix.Store(Blocks{Model: "m", Holder: engine, Tier: TierGPU, Keys: specKeys(500, 4)})
	keys := specKeys(100, 8)
	for i := range 5 {
		s.Record("m", Holder{Pod: fmt.Sprintf("made-up-%d:1", i)}, keys)
	}
	// A second entry of a holder it keeps, and a holder the engine's
	// events made, are not new holders.
	s.Record("m", Holder{Pod: "made-up-0:1"}, keys)
	s.Record("m", engine, keys)
	st := s.Stats()
	require.Equal(t, 5, st.Entries)
	require.Equal(t, uint64(2), st.Refused)
	require.Equal(t, 4, ix.Stats().Holders)
	prefix, _ := specHit(ix, keys, Holder{Pod: "made-up-4:1"})
	require.Zero(t, prefix)
	_, spec := specHit(ix, keys, engine)
	require.Equal(t, 8, spec)

	// Once they expire, new ones fit again.
	clock.step(time.Second)
	s.Record("m", Holder{Pod: "made-up-4:1"}, keys)
	_, spec = specHit(ix, keys, Holder{Pod: "made-up-4:1"})
	require.Equal(t, 8, spec)
}

func TestSpeculativeBlocksNeitherCountInTheHoldersCapacityNorEvictStoredBlocks(t *testing.T) {
	gpu := specKeys(1, 10)
	tests := []struct {
		name string
		cfg  Config
	}{
		{"holder capacity", Config{HolderCapacity: 10}},
		{"holding budget", Config{MaxHolderBlocks: 10}},
		// The budget holds the model's state and the 10 stored blocks.
		{"memory budget", Config{MemoryBytes: modelStateBytes + int64(len("m")) + 10*HolderBlockBytes}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix := New(tt.cfg)
			s := NewSpeculative(ix, SpeculativeConfig{TTL: time.Hour})
			h := Holder{Pod: "10.0.0.1:8000"}
			s.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: gpu})
			for i := range 5 {
				s.Record("m", h, specKeys(uint64(1000*(i+1)), 3))
			}
			require.Equal(t, map[string]int{TierGPU: 10, TierSpeculative: 15}, ix.HolderBlocks("m", h))
			st := ix.Stats()
			require.Equal(t, int64(10), st.HolderBlocks, "guesses are not holdings of the budget")
			require.Zero(t, st.EvictedCapacity+st.EvictedBudget)
			// Stored blocks still evict each other as before.
			s.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: specKeys(100, 2)})
			require.Equal(t, 10, ix.HolderBlocks("m", h)[TierGPU])
			require.Equal(t, 15, ix.HolderBlocks("m", h)[TierSpeculative])
		})
	}
}

func TestSpeculativeKeysStayWhileANewerEntryHoldsThem(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ix := New(Config{})
	s := NewSpeculative(ix, SpeculativeConfig{TTL: time.Second, Now: clock.now})
	dest := Holder{Pod: "10.0.0.1:8000"}
	prompt := specKeys(100, 8)
	s.Record("m", dest, prompt)
	clock.step(500 * time.Millisecond)
	// The same prompt again, and one sharing its first 4 blocks.
	s.Record("m", dest, prompt)
	other := append(specKeys(100, 4), specKeys(900, 4)...)
	s.Record("m", dest, other)
	clock.step(560 * time.Millisecond)
	s.Expire()
	_, spec := specHit(ix, prompt, dest)
	require.Equal(t, 8, spec, "the second pick keeps the prompt alive past the first's TTL")
	_, spec = specHit(ix, other, dest)
	require.Equal(t, 8, spec)
	clock.step(500 * time.Millisecond)
	s.Expire()
	prefix, _ := specHit(ix, prompt, dest)
	require.Zero(t, prefix, "gone with the last entry holding it")
	require.Zero(t, s.Stats().Bytes)
}

func TestSpeculativeEntriesLeaveNoBlocksBehindUnderConcurrentRecords(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	ix := New(Config{})
	// Room for about two entries: nearly every Record evicts another's.
	s := NewSpeculative(ix, SpeculativeConfig{TTL: time.Hour, MaxBytes: 2 * specCost(16, 16), Now: clock.now})
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 2000 {
				s.Record("m", Holder{Pod: "10.0.0.1:8000", Rank: g}, specKeys(uint64(g<<20|i<<5), 16))
			}
		})
	}
	wg.Wait()
	clock.step(time.Hour)
	s.Expire()
	require.Zero(t, s.Stats().Entries)
	left := 0
	for g := range 4 {
		left += ix.HolderBlocks("m", Holder{Pod: "10.0.0.1:8000", Rank: g})[TierSpeculative]
	}
	require.Zero(t, left, "speculative blocks of entries already removed")
}
