// Package cliflag holds the flag values the kvsource command's subcommands
// share: a seed that knows whether it was given, and sizes with units.
package cliflag

import "github.com/kvsource/kvsource/hashing"

// Seed is --seed: the engines' PYTHONHASHSEED. It records whether the flag
// was given at all, because an empty --seed (PYTHONHASHSEED="", which vLLM
// hashes as the empty string) is not the same as no --seed (vLLM's default).
type Seed struct {
	Value string
	Given bool
}

func (f *Seed) String() string {
	if f == nil {
		return ""
	}
	return f.Value
}

// Set implements flag.Value.
func (f *Seed) Set(v string) error {
	f.Value, f.Given = v, true
	return nil
}

// Config returns the hashing configuration for algo, the seed and blockSize.
func (f *Seed) Config(algo string, blockSize int) hashing.Config {
	return hashing.Config{Algo: hashing.Algo(algo), Seed: f.Value, SeedSet: f.Given, BlockSize: blockSize}
}
