package index

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestHolderListAndModelsNameEveryModelHolderPairSortedIncludingLoadedOnes(t *testing.T) {
	ix := New(Config{})
	require.Empty(t, ix.HolderList())
	a, b1, b0 := Holder{Pod: "a:1"}, Holder{Pod: "b:1", Rank: 1}, Holder{Pod: "b:1"}
	ix.Store(Blocks{Model: "m2", Holder: a, Tier: TierCPU, Keys: []uint64{1}})
	ix.Store(Blocks{Model: "m1", Holder: b1, Tier: TierGPU, Keys: []uint64{1, 2}})
	ix.Store(Blocks{Model: "m1", Holder: b0, Tier: TierGPU, Keys: []uint64{3}})
	ix.Store(Blocks{Model: "m1", Holder: a, Tier: TierGPU, Keys: []uint64{4}})
	want := []HolderModel{{"m1", a}, {"m1", b0}, {"m1", b1}, {"m2", a}}
	require.Equal(t, want, ix.HolderList())
	require.Equal(t, []string{"m1", "m2"}, ix.Models(nil))

	// Cleared holders keep their place; removed ones are gone.
	ix.ClearHolder("m1", b0, "")
	require.Equal(t, want, ix.HolderList())
	ix.RemoveHolder(a)
	require.Equal(t, []HolderModel{{"m1", b0}, {"m1", b1}}, ix.HolderList())
	require.Equal(t, []string{"m1"}, ix.Models(nil), "a model whose holders are all removed is gone")

	path := filepath.Join(t.TempDir(), "snap")
	require.NoError(t, ix.SaveFile(path, nil))
	loaded, _, err := LoadFile(path, Config{})
	require.NoError(t, err)
	require.Equal(t, []HolderModel{{"m1", b0}, {"m1", b1}}, loaded.HolderList())
}
