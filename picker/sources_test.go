package picker

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/index"
)

func TestPickPullsOnlyFromSourcesConfigAllowsAndSaysWhatItSkipped(t *testing.T) {
	keys := seqKeys(8)
	states := map[index.Holder]string{peerA: "disconnected", peerB: "conflict"}
	sources := func(h index.Holder) (string, bool) {
		st, bad := states[h]
		if bad {
			return st, false
		}
		return "live", true
	}
	for _, tc := range []struct {
		name      string
		hs        []holding
		reason    Reason
		source    index.Holder
		skipped   int
		skipState string
	}{
		{"only skipped holders extend the prefix",
			[]holding{{dst, index.TierGPU, 0, 2}, {peerA, index.TierCPU, 0, 8}, {peerB, index.TierCPU, 0, 6}},
			ReasonNoLiveSource, index.Holder{}, 2, "disconnected"},
		{"a live holder with a shorter run is chosen",
			[]holding{{dst, index.TierGPU, 0, 1}, {peerA, index.TierCPU, 0, 8}, {peerC, index.TierCPU, 0, 6}},
			ReasonPull, peerC, 1, "disconnected"},
		{"nothing skipped",
			[]holding{{dst, index.TierGPU, 0, 1}, {peerC, index.TierCPU, 0, 6}},
			ReasonPull, peerC, 0, ""},
		{"no holder at all",
			[]holding{{peerB, index.TierCPU, 0, 8}},
			ReasonNoLiveSource, index.Holder{}, 1, "conflict"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPicker(t, fleet(keys, tc.hs...), Config{Sources: sources})
			d, err := p.Pick(Request{Model: model, Keys: keys, Destination: dst})
			require.NoError(t, err)
			require.Equal(t, tc.reason, d.Reason)
			require.Equal(t, tc.source, d.Source)
			require.Equal(t, tc.skipped, d.Skipped)
			require.Equal(t, tc.skipState, d.SkippedState)
			d.Done()
		})
	}
}
