package events

import (
	"reflect"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every Stats field is one entry of Counters, every HolderStatus counter
// field at most one, and names are unique: the table is the one definition.
func TestCountersTableCoversEveryStatsFieldOnce(t *testing.T) {
	var st Stats
	var hs HolderStatus
	seenStat := map[*uint64]string{}
	seenHolder := map[*uint64]string{}
	names := map[string]bool{}
	for i, c := range Counters {
		require.False(t, names[c.Name], "name %q twice", c.Name)
		names[c.Name] = true
		require.Equal(t, counter(i), c.id, "%s is out of order", c.Name)
		p := c.Stat(&st)
		other, dup := seenStat[p]
		require.False(t, dup, "%s and %s share a Stats field", c.Name, other)
		seenStat[p] = c.Name
		if c.Holder != nil {
			p := c.Holder(&hs)
			other, dup := seenHolder[p]
			require.False(t, dup, "%s and %s share a HolderStatus field", c.Name, other)
			seenHolder[p] = c.Name
		}
	}
	require.Len(t, Counters, int(numCounters))
	require.Len(t, seenStat, reflect.TypeFor[Stats]().NumField(), "a Stats field without a Counters entry")
}
