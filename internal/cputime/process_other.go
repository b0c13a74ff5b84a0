//go:build !unix

package cputime

import "time"

// Process is zero: no process clock here.
func Process() time.Duration { return 0 }
