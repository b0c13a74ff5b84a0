//go:build !linux

package index_test

import "time"

// threadCPU and processCPU are unknown here; the Mooncake benchmarks then
// skip their CPU metrics.
func threadCPU() time.Duration  { return 0 }
func processCPU() time.Duration { return 0 }
