package mooncake

import (
	"math"
	"math/bits"
)

// rustDuration is Rust's std::time::Duration, whole seconds and
// nanoseconds: the mock engine's pass times go through it, and its
// rounding to the nanosecond moves the simulated clock.
type rustDuration struct {
	secs  uint64
	nanos uint32
}

const nanosPerSec = 1_000_000_000

// durationFromSecs is Duration::from_secs_f64 for a finite x in [0, 2^64):
// the exact value rounded to the nearest nanosecond, ties to even.
func durationFromSecs(x float64) rustDuration {
	b := math.Float64bits(x)
	mant := b&(1<<52-1) | 1<<52
	exp := int(b>>52&0x7ff) - 1023
	switch {
	case exp < -31: // under a nanosecond
		return rustDuration{}
	case exp < 0:
		hi, lo := bits.Mul64(mant, nanosPerSec)
		n := shiftRoundEven(hi, lo, uint(52-exp))
		if n == nanosPerSec {
			return rustDuration{secs: 1}
		}
		return rustDuration{nanos: uint32(n)}
	case exp < 52:
		secs := mant >> (52 - exp)
		hi, lo := bits.Mul64((mant<<exp)&(1<<52-1), nanosPerSec)
		n := shiftRoundEven(hi, lo, 52)
		if n == nanosPerSec {
			return rustDuration{secs: secs + 1}
		}
		return rustDuration{secs: secs, nanos: uint32(n)}
	default:
		return rustDuration{secs: mant << (exp - 52)}
	}
}

// shiftRoundEven is the 128-bit hi:lo shifted right by s (1..127), rounded
// to nearest, ties to even.
func shiftRoundEven(hi, lo uint64, s uint) uint64 {
	var q, remHi, remLo, halfHi, halfLo uint64
	if s < 64 {
		q = hi<<(64-s) | lo>>s
		remLo = lo & (1<<s - 1)
	} else {
		q = hi >> (s - 64)
		remHi, remLo = hi&(1<<(s-64)-1), lo
	}
	if s-1 < 64 {
		halfLo = 1 << (s - 1)
	} else {
		halfHi = 1 << (s - 65)
	}
	if remHi > halfHi || (remHi == halfHi && remLo > halfLo) || (remHi == halfHi && remLo == halfLo && q&1 == 1) {
		q++
	}
	return q
}

// seconds is Duration::as_secs_f64.
func (d rustDuration) seconds() float64 {
	return float64(d.secs) + float64(d.nanos)/nanosPerSec
}

func (d rustDuration) isZero() bool { return d.secs == 0 && d.nanos == 0 }

// timestampUS is the offline replay's timestamp_us_from_ms: milliseconds to
// whole microseconds, truncated, 0 for what is not positive.
func timestampUS(ms float64) uint64 {
	us := ms * 1000
	switch {
	case !(us > 0):
		return 0
	case us >= math.MaxUint64:
		return math.MaxUint64
	}
	return uint64(us)
}
