//go:build race

package picker

// sync.Pool drops items at random under the race detector, so allocation
// counts are meaningful only without it.
const raceEnabled = true
