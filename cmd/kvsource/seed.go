package main

import "github.com/kvsource/kvsource/hashing"

// seedFlag is --seed: the engines' PYTHONHASHSEED. It records whether the
// flag was given at all, because an empty --seed (PYTHONHASHSEED="", which vLLM
// hashes as the empty string) is not the same as no --seed (vLLM's default).
type seedFlag struct {
	value string
	set   bool
}

func (f *seedFlag) String() string {
	if f == nil {
		return ""
	}
	return f.value
}

func (f *seedFlag) Set(v string) error {
	f.value, f.set = v, true
	return nil
}

// config returns the hashing configuration for algo, the seed and blockSize.
func (f *seedFlag) config(algo string, blockSize int) hashing.Config {
	return hashing.Config{Algo: hashing.Algo(algo), Seed: f.value, SeedSet: f.set, BlockSize: blockSize}
}
