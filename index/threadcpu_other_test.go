//go:build !linux

package index

import "time"

// threadCPU is unknown here; the latency benchmark then skips its CPU metrics.
func threadCPU() time.Duration { return 0 }
