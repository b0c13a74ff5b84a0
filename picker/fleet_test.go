package picker

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
)

// mapFleet is a Fleet in one process: other pickers' pulls are set by the
// test, this picker's are recorded.
type mapFleet struct {
	mu      sync.Mutex
	others  map[index.Holder]int
	started map[uint64]index.Holder
	next    uint64
}

func (f *mapFleet) Started(h index.Holder) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next++
	f.started[f.next] = h
	return f.next
}

func (f *mapFleet) Ended(token uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.started, token)
}

func (f *mapFleet) Inflight(h index.Holder) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.others[h]
}

func TestPickCountsOtherPickersPullsFromTheFleet(t *testing.T) {
	keys := seqKeys(8)
	idx := fleet(keys, holding{peerA, index.TierCPU, 0, 8}, holding{peerB, index.TierCPU, 0, 8})
	f := &mapFleet{others: map[index.Holder]int{peerA: 3}, started: map[uint64]index.Holder{}}
	p := newPicker(t, idx, Config{Fleet: f})
	// Equal weights would put 0.45 on peerA; its three pulls from other
	// replicas weigh it 1/4 against peerB's 1, so 0.45 of 1.25 is past it.
	d, err := p.Pick(Request{Model: model, Keys: keys, Destination: dst, Rand: constRand(0.45)})
	require.NoError(t, err)
	require.Equal(t, peerB, d.Source)
	require.Equal(t, map[uint64]index.Holder{1: peerB}, f.started, "the fleet hears of the pull")
	d.Done()
	d.Done()
	require.Empty(t, f.started, "and of its end, once")
}
