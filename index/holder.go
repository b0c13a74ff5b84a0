package index

import (
	"cmp"
	"strconv"
	"strings"
)

// Holder identifies one cache: a vLLM engine process, named by the pod address
// the router uses for it and its data-parallel rank. Ranks of one pod have
// separate caches, so they are separate holders.
type Holder struct {
	Pod  string
	Rank int
}

// String renders the holder as "pod" for rank 0 and "pod#rank" otherwise.
func (h Holder) String() string {
	if h.Rank == 0 {
		return h.Pod
	}
	return h.Pod + "#" + strconv.Itoa(h.Rank)
}

// Compare orders holders by pod, then rank: -1 when h sorts before o, +1
// when after, 0 when equal. Every listing of holders in the SDK and the
// service uses this order.
func (h Holder) Compare(o Holder) int {
	return cmp.Or(strings.Compare(h.Pod, o.Pod), cmp.Compare(h.Rank, o.Rank))
}

// Tiers vLLM reports in KV events. Engines may report other media; the index
// takes any non-empty string.
const (
	TierGPU = "GPU"
	TierCPU = "CPU"
)
