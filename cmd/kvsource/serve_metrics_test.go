package main

import (
	"reflect"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/index"
)

// TestServeExportsEveryEventsCounter gives each events.Stats field its own
// value and requires a metric reporting it, so that a counter added to the
// subscriber is not left out of /metrics.
func TestServeExportsEveryEventsCounter(t *testing.T) {
	t.Parallel()
	typ := reflect.TypeFor[events.Stats]()
	for i := range typ.NumField() {
		f := typ.Field(i)
		t.Run(f.Name, func(t *testing.T) {
			var st events.Stats
			reflect.ValueOf(&st).Elem().Field(i).SetUint(1000 + uint64(i))
			var names []string
			for _, d := range serveStatDescs {
				if d.value(st, index.Stats{}) == float64(1000+i) {
					names = append(names, d.desc.String())
				}
			}
			require.Len(t, names, 1, "metrics reporting events.Stats.%s", f.Name)
		})
	}
}
