//go:build !unix

package index

import "time"

// cpuTime is unknown here; benchmarks then skip their per-CPU-second metric.
func cpuTime() time.Duration { return 0 }
