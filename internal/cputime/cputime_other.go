//go:build !linux

package cputime

import "time"

// Thread is zero: no thread clock here.
func Thread() time.Duration { return 0 }
