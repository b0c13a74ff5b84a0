package index

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSnapshotRoundTripAnswersAsBefore(t *testing.T) {
	cases := []propConfig{
		{models: 2, holders: 5, ops: 600, maxLen: 64, tiers: []string{"GPU", "CPU", "disk"}, groups: []int{0, 1, 7, -3}},
		{models: 1, holders: 3, ops: 600, maxLen: 200, tiers: []string{"GPU", "CPU"}, groups: []int{0}, engineLike: true},
	}
	for ci, pc := range cases {
		w := newWorkload(t, pc, uint64(100+ci))
		ix := New(Config{MaxHolderBlocks: -1})
		for range pc.ops {
			w.mutate(ix)
		}
		ix.SetHolderCapacity(w.holders[0], 1<<20)
		seqs := map[Holder]uint64{w.holders[0]: 17, w.holders[1]: 1 << 40}
		path := filepath.Join(t.TempDir(), "index.snap")
		require.NoError(t, ix.SaveFile(path, seqs))

		loaded, gotSeqs, err := LoadFile(path, Config{MaxHolderBlocks: -1})
		require.NoError(t, err)
		require.Equal(t, seqs, gotSeqs)
		require.Equal(t, int64(1<<20), loaded.capacityOf(w.holders[0]))
		w.checkCounts(loaded, -1)
		checkInvariants(t, loaded, -1)
		for op := range 100 {
			w.check(loaded, op)
		}
		// The loaded index keeps working: its chains, gaps and eviction
		// order were rebuilt, not just its answers.
		for op := range 300 {
			w.mutate(loaded)
			if op%10 == 0 {
				w.check(loaded, op)
			}
		}
		w.checkCounts(loaded, -2)
		checkInvariants(t, loaded, -2)
	}
}

func TestSnapshotKeepsEvictionOrder(t *testing.T) {
	ix := New(Config{})
	old, mid := chain(1, 6), chain(2, 6)
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: old})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierCPU, Keys: mid})
	path := filepath.Join(t.TempDir(), "s")
	require.NoError(t, ix.SaveFile(path, nil))
	loaded, seqs, err := LoadFile(path, Config{HolderCapacity: 8})
	require.NoError(t, err)
	require.Empty(t, seqs)
	require.Equal(t, map[string]int{TierGPU: 2, TierCPU: 6}, loaded.HolderBlocks("m", podA), "a lower capacity applies on load, oldest first")
	var res Result
	loaded.Lookup("m", mid, &res)
	require.Equal(t, 6, res.Holder(podA).Prefix)
}

func TestSnapshotReplacesFileAtomically(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "s")
	ix := New(Config{})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: chain(1, 3)})
	require.NoError(t, ix.SaveFile(path, nil))
	ix.Store(Blocks{Model: "m", Holder: podB, Tier: TierGPU, Keys: chain(1, 3)})
	require.NoError(t, ix.SaveFile(path, map[Holder]uint64{podB: 4}))
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "no temporary file left behind")
	loaded, seqs, err := LoadFile(path, Config{})
	require.NoError(t, err)
	require.Equal(t, map[Holder]uint64{podB: 4}, seqs)
	require.Len(t, loaded.Holders("m", chain(1, 3)[2], nil), 2)

	require.Error(t, ix.SaveFile(filepath.Join(dir, "missing", "s"), nil))
	_, _, err = LoadFile(filepath.Join(dir, "absent"), Config{})
	require.ErrorIs(t, err, os.ErrNotExist)
	require.NotErrorIs(t, err, ErrBadSnapshot)
}

func TestSnapshotRejectsDamagedFiles(t *testing.T) {
	ix := New(Config{})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: chain(1, 5)})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierCPU, Group: 9, Parent: ParentKey(chain(1, 5)[4]), Keys: chain(chainKey(chain(1, 5)[4], 0), 3)})
	ix.Store(Blocks{Model: "m2", Holder: podB, Tier: "disk", Group: 1, Keys: chain(2, 4)})
	path := filepath.Join(t.TempDir(), "s")
	require.NoError(t, ix.SaveFile(path, map[Holder]uint64{podA: 3}))
	good, err := os.ReadFile(path)
	require.NoError(t, err)

	load := func(t *testing.T, data []byte) error {
		p := filepath.Join(t.TempDir(), "bad")
		require.NoError(t, os.WriteFile(p, data, 0o600))
		got, seqs, err := LoadFile(p, Config{})
		require.Nil(t, got)
		require.Nil(t, seqs)
		return err
	}
	t.Run("every truncation", func(t *testing.T) {
		for n := range len(good) {
			require.ErrorIs(t, load(t, good[:n]), ErrBadSnapshot, "truncated to %d bytes", n)
		}
	})
	t.Run("every flipped byte", func(t *testing.T) {
		for i := range good {
			bad := append([]byte(nil), good...)
			bad[i] ^= 0x40
			require.ErrorIs(t, load(t, bad), ErrBadSnapshot, "byte %d flipped", i)
		}
	})
	t.Run("foreign file", func(t *testing.T) {
		err := load(t, []byte("{\"not\": \"a snapshot\"}"))
		require.ErrorIs(t, err, ErrBadSnapshot)
		require.NotErrorIs(t, err, ErrSnapshotVersion)
	})
	t.Run("other version", func(t *testing.T) {
		bad := append([]byte(nil), good...)
		binary.LittleEndian.PutUint32(bad[len(snapMagic):], snapVersion+1)
		err := load(t, bad)
		require.ErrorIs(t, err, ErrBadSnapshot)
		require.ErrorIs(t, err, ErrSnapshotVersion)
	})
	t.Run("resealed edits load or fail cleanly", func(t *testing.T) {
		body := good[snapHeaderSize : len(good)-snapTrailerSize]
		for i := range body {
			bad := append([]byte(nil), good...)
			bad[snapHeaderSize+i] ^= 0x01
			reseal(bad)
			p := filepath.Join(t.TempDir(), "edited")
			require.NoError(t, os.WriteFile(p, bad, 0o600))
			got, _, err := LoadFile(p, Config{})
			if err != nil {
				require.ErrorIs(t, err, ErrBadSnapshot, "body byte %d", i)
				require.Nil(t, got)
			} else {
				require.NotNil(t, got)
			}
		}
	})
}

func TestSnapshotStructuralErrorsAreBadSnapshots(t *testing.T) {
	ix := New(Config{})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: chain(1, 3)})
	path := filepath.Join(t.TempDir(), "s")
	require.NoError(t, ix.SaveFile(path, nil))
	good, err := os.ReadFile(path)
	require.NoError(t, err)
	// Layout of this file's body: 0 caps, 0 seqs, 1 model "m", 1 holder
	// "a:8000" rank 0, 1 tier "GPU", then 3 holdings of 1+8+1 bytes (tier,
	// key, no groups).
	h := snapHeaderSize + 1 + 1 + 1 + 2 + 1 + (1 + 6 + 1) + 1 + 4 + 1
	cases := []struct {
		name string
		edit func(b []byte)
	}{
		{"key twice", func(b []byte) { copy(b[h+11:h+19], b[h+1:h+9]) }},
		{"tier out of range", func(b []byte) { b[h+10] = 1 }},
		{"holdings past the file", func(b []byte) { b[h-1] = 90 }},
		{"a group list of group 0 alone", func(b []byte) { b[h+9], b[h+10] = 1, 0 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			bad := append([]byte(nil), good...)
			tc.edit(bad)
			reseal(bad)
			p := filepath.Join(t.TempDir(), "bad")
			require.NoError(t, os.WriteFile(p, bad, 0o600))
			got, _, err := LoadFile(p, Config{})
			require.ErrorIs(t, err, ErrBadSnapshot)
			require.Nil(t, got)
		})
	}
	_, _, err = LoadFile(path, Config{})
	require.NoError(t, err, "the unedited file loads")
}

// reseal recomputes a snapshot's checksum after an edit.
func reseal(b []byte) {
	sum := crc32.Checksum(b[:len(b)-snapTrailerSize], crcTable)
	binary.LittleEndian.PutUint32(b[len(b)-snapTrailerSize+8:], sum)
}

// FuzzLoadSnapshot feeds LoadFile's decoder arbitrary bodies under a valid
// checksum, seeded with real snapshots: it must fail cleanly or yield an
// index that answers and saves without panicking.
func FuzzLoadSnapshot(f *testing.F) {
	w := newWorkload(nil, propConfig{models: 2, holders: 3, maxLen: 20, tiers: []string{"GPU", "CPU"}, groups: []int{0, 1, 8}}, 1)
	// Seeds of this format and of formats 1 and 2.
	for _, old := range []string{"testdata/snapshot-v1.snap", "testdata/snapshot-v2.snap"} {
		b, err := os.ReadFile(old)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b[snapHeaderSize : len(b)-snapTrailerSize])
	}
	for range 2 {
		ix := New(Config{MaxHolderBlocks: -1})
		for range 40 {
			w.mutate(ix)
		}
		path := filepath.Join(f.TempDir(), "seed")
		if err := ix.SaveFile(path, map[Holder]uint64{podA: 9}); err != nil {
			f.Fatal(err)
		}
		seed, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(seed[snapHeaderSize : len(seed)-snapTrailerSize])
	}
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, body []byte) {
		data := binary.LittleEndian.AppendUint32([]byte(snapMagic), snapVersion)
		data = append(data, body...)
		data = binary.LittleEndian.AppendUint64(data, uint64(len(body)))
		data = binary.LittleEndian.AppendUint32(data, crc32.Checksum(data, crcTable))
		data = append(data, snapEnd...)
		got, _, err := load(data, Config{})
		if err != nil {
			require.ErrorIs(t, err, ErrBadSnapshot)
			return
		}
		var res Result
		for _, k := range w.u.path(20) {
			got.Lookup("m0", []uint64{k}, &res)
		}
		require.NoError(t, got.SaveFile(filepath.Join(t.TempDir(), "again"), nil))
	})
}

func TestSaveHoldersLeavesOutHoldersWithoutASequenceAndKeepsThemInTheIndex(t *testing.T) {
	ix := New(Config{})
	ix.Store(Blocks{Model: "m", Holder: podA, Tier: TierGPU, Keys: chain(1, 3)})
	ix.Store(Blocks{Model: "m", Holder: podB, Tier: TierCPU, Keys: chain(1, 5)})
	ix.Store(Blocks{Model: "n", Holder: podB, Tier: TierGPU, Keys: chain(2, 2)})
	path := filepath.Join(t.TempDir(), "s")
	require.NoError(t, ix.SaveHolders(path, map[Holder]uint64{podB: 9}))
	loaded, seqs, err := LoadFile(path, Config{})
	require.NoError(t, err)
	require.Equal(t, map[Holder]uint64{podB: 9}, seqs)
	require.Equal(t, []HolderModel{{Model: "m", Holder: podB}, {Model: "n", Holder: podB}}, loaded.HolderList())
	require.Equal(t, map[string]int{TierCPU: 5}, loaded.HolderBlocks("m", podB))
	require.Equal(t, map[string]int{TierGPU: 3}, ix.HolderBlocks("m", podA), "the index keeps what the file leaves out")
	require.Equal(t, int64(7), loaded.Stats().HolderBlocks)
}

// snapshotV1Recipe makes the stores testdata/snapshot-v1.snap was saved
// from (see testdata/README.md), and returns the chains stored, by model.
func snapshotV1Recipe(ix *Index) map[string][][]uint64 {
	chainOf := func(root uint64, n int) []uint64 {
		keys := make([]uint64, n)
		k := root
		for i := range keys {
			if i > 0 {
				x := k*0x9E3779B97F4A7C15 + 0x94D049BB133111EB
				x ^= x >> 31
				x *= 0xD6E8FEB86659FD93
				k = x ^ x>>29
			}
			keys[i] = k
		}
		return keys
	}
	p := chainOf(21, 80)
	chains := map[string][][]uint64{"m": {p}}
	for i := range 5 {
		h := Holder{Pod: fmt.Sprintf("10.11.0.%d:8000", i), Rank: i % 2}
		n := 16 * (i + 1)
		for j := 0; j < n; j += 8 {
			b := Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: p[j:min(j+8, n)]}
			if j > 0 {
				b.Parent = ParentKey(p[j-1])
			}
			ix.Store(b)
		}
		ix.Store(Blocks{Model: "m", Holder: h, Tier: TierCPU, Keys: p[:8]})
		ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Group: 9, Keys: p[:4]})
		own := chainOf(uint64(30+i), 12)
		ix.Store(Blocks{Model: "n", Holder: h, Tier: TierGPU, Keys: own})
		chains["n"] = append(chains["n"], own)
	}
	ix.Remove("m", Holder{Pod: "10.11.0.4:8000"}, TierGPU, 0, p[40:44])
	return chains
}

// TestSnapshotsOfFormats1And2Load loads files of the formats before the
// block-major store, written by the index of their time (format 2 with
// blocks its layer kept once), and checks each answers as the stores it
// was made from do, keeps the eviction order, and takes new stores.
func TestSnapshotsOfFormats1And2Load(t *testing.T) {
	for _, file := range []string{"testdata/snapshot-v1.snap", "testdata/snapshot-v2.snap"} {
		t.Run(file, func(t *testing.T) {
			want := New(Config{MaxHolderBlocks: -1})
			chains := snapshotV1Recipe(want)
			got, seqs, err := LoadFile(file, Config{MaxHolderBlocks: -1})
			require.NoError(t, err)
			require.Equal(t, map[Holder]uint64{{Pod: "10.11.0.0:8000"}: 77}, seqs)
			checkInvariants(t, got, 0)
			require.Equal(t, want.HolderList(), got.HolderList())
			require.Equal(t, want.Stats().HolderBlocks, got.Stats().HolderBlocks)
			require.Equal(t, want.Stats().SharedBlocks, got.Stats().SharedBlocks)
			for _, hm := range want.HolderList() {
				require.Equal(t, want.HolderBlocks(hm.Model, hm.Holder), got.HolderBlocks(hm.Model, hm.Holder))
			}
			var w, g Result
			for model, cs := range chains {
				for _, c := range cs {
					for n := 1; n <= len(c); n++ {
						want.Lookup(model, c[:n], &w)
						got.Lookup(model, c[:n], &g)
						require.Equal(t, hitsByHolder(&w), hitsByHolder(&g), "%s, %d blocks", model, n)
					}
				}
			}
			p := chains["m"][0]
			h := Holder{Pod: "10.11.0.9:8000"}
			for _, ix := range []*Index{want, got} {
				ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: p[:8]})
			}
			checkInvariants(t, got, 1)
			got.Lookup("m", p[:8], &g)
			require.Len(t, g.Hits, 6)
			// The same holdings in the same order: capacity takes the same
			// blocks from both.
			for _, hm := range want.HolderList() {
				for _, ix := range []*Index{want, got} {
					ix.SetHolderCapacity(hm.Holder, 5)
					ix.Store(Blocks{Model: hm.Model, Holder: hm.Holder, Tier: TierCPU, Keys: []uint64{chainKey(uint64(len(hm.Holder.Pod)), 3)}})
				}
			}
			for model, cs := range chains {
				for _, c := range cs {
					want.Lookup(model, c, &w)
					got.Lookup(model, c, &g)
					require.Equal(t, hitsByHolder(&w), hitsByHolder(&g), "%s after evictions", model)
				}
			}
		})
	}
}

// evictionOrder returns the order in which capacity pressure takes h's
// holdings of keys (single-block chains): at capacity, each store of a
// block of its own evicts the oldest holding.
func evictionOrder(t *testing.T, ix *Index, h Holder, keys []uint64) []uint64 {
	t.Helper()
	ix.SetHolderCapacity(h, sumBlocks(ix.HolderBlocks("m", h)))
	var order []uint64
	left := slices.Clone(keys)
	for f := uint64(0); len(left) > 0; f++ {
		ix.Store(Blocks{Model: "m", Holder: h, Tier: TierGPU, Keys: []uint64{chainKey(1<<40+f, 3)}})
		var gone []uint64
		left = slices.DeleteFunc(left, func(k uint64) bool {
			if ix.Run("m", h, []uint64{k}, 0, nil) == 0 {
				gone = append(gone, k)
				return true
			}
			return false
		})
		require.Len(t, gone, 1, "store %d evicts one holding", f)
		order = append(order, gone[0])
	}
	return order
}

func TestSavingASnapshotKeepsTheEvictionOrder(t *testing.T) {
	// A holding removed and stored again keeps its first place in its
	// holder's eviction order: the queue entry from its first store names
	// it again. Saving used to compact the queue, keeping the newest entry
	// instead, so the saving index (and the loaded copy) evicted another
	// holding next.
	a, b := Holder{Pod: "10.11.0.1:8000"}, Holder{Pod: "10.11.0.2:8000"}
	cases := []struct {
		name   string
		shared bool
	}{
		{"a's own blocks", false},
		// b holds them too: a's queue keeps their places all the same.
		{"blocks b holds too", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{MaxHolderBlocks: -1}
			keys := make([]uint64, 8)
			for i := range keys {
				keys[i] = chainKey(uint64(500+i), 1)
			}
			build := func() *Index {
				ix := New(cfg)
				for _, k := range keys {
					ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: []uint64{k}})
					if tc.shared {
						ix.Store(Blocks{Model: "m", Holder: b, Tier: TierGPU, Keys: []uint64{k}})
					}
				}
				for _, k := range keys[:3] {
					ix.Remove("m", a, TierGPU, 0, []uint64{k})
					ix.Store(Blocks{Model: "m", Holder: a, Tier: TierGPU, Keys: []uint64{k}})
				}
				if tc.shared {
					require.Equal(t, int64(len(keys)), ix.Stats().SharedBlocks)
				}
				return ix
			}
			want := evictionOrder(t, build(), a, keys)
			require.Equal(t, keys, want, "re-stored holdings keep their first places")

			saved := build()
			path := filepath.Join(t.TempDir(), "index.snap")
			require.NoError(t, saved.SaveFile(path, nil))
			loaded, _, err := LoadFile(path, cfg)
			require.NoError(t, err)
			checkInvariants(t, saved, 0)
			checkInvariants(t, loaded, 0)
			require.Equal(t, want, evictionOrder(t, saved, a, keys), "the saving index")
			require.Equal(t, want, evictionOrder(t, loaded, a, keys), "the loaded copy")
		})
	}
}
