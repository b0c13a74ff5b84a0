package index

import (
	"flag"
	"testing"
)

// long runs the property and concurrency tests at their full sizes under
// the race detector and -short too: go test -race ./index -long.
var long = flag.Bool("long", false, "run the randomised index tests at their full sizes, also under -race and -short")

// sized returns full, or reduced under the race detector or -short unless
// -long is given: `make test` runs every package under -race, where the
// full sizes took the index package past 5 minutes on 2 shared cores, and
// what the race detector adds is found at the reduced sizes as well; the
// full sizes run in plain go test ./index.
func sized(full, reduced int) int {
	if (raceEnabled || testing.Short()) && !*long {
		return reduced
	}
	return full
}
