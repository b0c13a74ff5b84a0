package hashing

import (
	"fmt"
	"slices"
	"strings"
)

// Diagnosis is what Diagnose found out about an engine whose block keys
// disagree with a router's configuration.
type Diagnosis struct {
	// Router is the router's configuration, defaults filled in.
	Router Config
	// Found, when Reproduced, is a configuration that reproduces the
	// engine's keys: the settings in which it differs from Router are the
	// likely cause.
	Found      Config
	Reproduced bool
}

// diagnoseSeeds are the seeds Diagnose tries besides the router's: vLLM's
// default, the empty string (PYTHONHASHSEED="") and "0", which llm-d's
// guides set.
var diagnoseSeeds = []string{DefaultSeed, "", "0"}

// Diagnose looks for the configuration an engine hashes with, given the
// engine's event-form keys of the leading full blocks of req (a chain that
// starts at block 0) and the engine's block size. It tries every vLLM
// algorithm with the router's seed and a few common ones, then the other
// engines' (EngineAlgos: SGLang's, TensorRT-LLM's), so it costs a few dozen
// hashes per block: call it when reporting a mismatch, not on every event.
// For SGLang's EAGLE keys req.Tokens must hold the token after the last
// block too.
func Diagnose(router Config, engineBlockSize int, req Request, keys []uint64) Diagnosis {
	d := Diagnosis{Router: router}
	if h, err := New(router); err == nil {
		d.Router = h.Config()
	}
	if engineBlockSize < 1 || len(keys) == 0 {
		return d
	}
	// Only the blocks the engine's keys cover are compared, and each
	// configuration is tried once.
	tokens := req.Tokens
	req.Tokens = tokens[:min(len(tokens), len(keys)*engineBlockSize)]
	seeds := slices.Compact(slices.Sorted(slices.Values(append([]string{d.Router.Seed}, diagnoseSeeds...))))
	algos := slices.Compact(slices.Sorted(slices.Values(append([]Algo{d.Router.Algo}, Algos...))))
	var got []uint64
	try := func(cfg Config) bool {
		h, err := New(cfg)
		if err != nil {
			return false
		}
		got, err = h.BlockKeys(got[:0], req)
		if err == nil && len(got) >= len(keys) && slices.Equal(got[:len(keys)], keys) {
			d.Found, d.Reproduced = h.Config(), true
			return true
		}
		return false
	}
	for _, seed := range seeds {
		for _, algo := range algos {
			if IsEngineAlgo(algo) {
				continue
			}
			if try(Config{Algo: algo, Seed: seed, SeedSet: true, BlockSize: engineBlockSize}) {
				return d
			}
		}
	}
	for _, algo := range EngineAlgos {
		if algo == SGLangEAGLE {
			// Its blocks reach one token further.
			req.Tokens = tokens[:min(len(tokens), len(keys)*engineBlockSize+1)]
		}
		if try(Config{Algo: algo, BlockSize: engineBlockSize}) {
			return d
		}
	}
	return d
}

// Engine names the engine whose keys an algorithm reproduces: "vLLM",
// "SGLang", "TensorRT-LLM", or "kvsource" for Content.
func (a Algo) Engine() string {
	switch a {
	case SGLang, SGLangEAGLE:
		return "SGLang"
	case TRTV1, TRTV2SHA256_64, TRTV2SHA256:
		return "TensorRT-LLM"
	case Content:
		return "kvsource"
	}
	return "vLLM"
}

// DefaultSeedChange is the diagnosis of keys no configuration reproduces
// from the router's or a common seed.
const DefaultSeedChange = "engines older than vLLM's August-2026 default-seed change hash with a random seed " +
	"when PYTHONHASHSEED is unset: set PYTHONHASHSEED on every engine and pass the same --seed"

// Explain says what the likely cause is and how to fix it. contentKeys
// names how the caller turns content-key mode on (kvsource serve's
// "--keys content"), the remedy for engines whose keys no router can
// reproduce.
func (d Diagnosis) Explain(contentKeys string) string {
	if d.Reproduced && d.Found.Algo.Engine() != d.Router.Algo.Engine() {
		return fmt.Sprintf("the engine's keys are %s's %s keys (block size %d), not %s's: set --algo %s and --block-size %d, or use %s",
			d.Found.Algo.Engine(), d.Found.Algo, d.Found.BlockSize, d.Router.Algo.Engine(), d.Found.Algo, d.Found.BlockSize, contentKeys)
	}
	if !d.Reproduced {
		return "no vLLM, SGLang or TensorRT-LLM algorithm reproduces the engine's keys from the router's seed or a common one (" +
			strings.Join(quoteSeeds(), ", ") + "). Likely causes: " + DefaultSeedChange +
			"; or the engine's keys are not vLLM's (llm-d's simulator hashes with its own scheme): " +
			"use " + contentKeys + ", which keys blocks by the tokens the events carry"
	}
	var diffs []string
	if d.Found.BlockSize != d.Router.BlockSize {
		diffs = append(diffs, fmt.Sprintf("block size: the engine uses %d, the router %d (set --block-size %d)",
			d.Found.BlockSize, d.Router.BlockSize, d.Found.BlockSize))
	}
	if d.Found.Algo != d.Router.Algo {
		diffs = append(diffs, fmt.Sprintf("algorithm: the engine hashes with %s, the router with %s (set --algo %s, the engine's --prefix-caching-hash-algo)",
			d.Found.Algo, d.Router.Algo, d.Found.Algo))
	}
	if d.Found.Seed != d.Router.Seed {
		diffs = append(diffs, fmt.Sprintf("seed: the engine hashes with PYTHONHASHSEED=%q, the router with %q (set --seed %s)",
			d.Found.Seed, d.Router.Seed, shellQuote(d.Found.Seed)))
	}
	if len(diffs) == 0 {
		return "the router's configuration reproduces these keys: the mismatch came from extra keys " +
			"(LoRA, multimodal items, cache salt) the event did not carry"
	}
	return "the engine's keys are reproduced with a different " + strings.Join(diffs, "; and ")
}

func quoteSeeds() []string {
	out := make([]string, len(diagnoseSeeds))
	for i, s := range diagnoseSeeds {
		out[i] = fmt.Sprintf("%q", s)
	}
	return out
}

func shellQuote(s string) string {
	if s != "" && !strings.ContainsAny(s, " \t\n'\"\\$`*?[]{}()<>|&;#~") {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
