package index

import (
	"slices"
	"strings"
)

// HolderModel names one (model, holder) pair the index keeps state for.
type HolderModel struct {
	Model  string
	Holder Holder
}

// Models appends to dst[:0] the models the index keeps state for a holder
// of, sorted, and returns the extended slice. It reads without locks, like
// HolderList.
func (ix *Index) Models(dst []string) []string {
	dst = dst[:0]
	ix.models.Range(func(name string, ms *modelState) bool {
		if len(*ms.list.Load()) > 0 {
			dst = append(dst, name)
		}
		return true
	})
	slices.Sort(dst)
	return dst
}

// HolderList returns every (model, holder) pair the index keeps state for,
// including holders whose blocks were all removed or cleared (RemoveHolder
// forgets them), sorted by model, pod and rank. It is what Stats.Holders
// counts, e.g. the holders a snapshot brought in. It reads without locks,
// so pairs added or removed meanwhile may or may not be listed.
func (ix *Index) HolderList() []HolderModel {
	var out []HolderModel
	ix.models.Range(func(name string, ms *modelState) bool {
		for _, hs := range *ms.list.Load() {
			out = append(out, HolderModel{Model: name, Holder: hs.h})
		}
		return true
	})
	slices.SortFunc(out, func(a, b HolderModel) int {
		if c := strings.Compare(a.Model, b.Model); c != 0 {
			return c
		}
		return a.Holder.Compare(b.Holder)
	})
	return out
}
