package events

import (
	"fmt"
	"strings"

	"github.com/kvsource/kvsource/hashing"
)

// Engine is the inference engine a pod runs, for the habits of its event
// stream that the payloads do not show. The zero value is vLLM. Every
// engine's layouts decode whatever the pod's Engine (signed hashes,
// SGLang's metadata and EAGLE pairs, CPU_PINNED); what the engine changes:
//
//   - TensorRT-LLM numbers its batches from time.time_ns() when it starts,
//     so a restart shows as a jump forward by billions, not as a sequence
//     going backwards: for an EngineTRTLLM pod a jump of TRTRestartJump or
//     more is an engine restart (its entries cleared, its new batches
//     fetched from replay), not a gap to replay.
//   - Each engine's default keys (Engine.Hashing), for a service that
//     configures a router's hashing from the engines it follows.
//
// Habits every engine shares are handled for all: a first sequence number
// far from 0 is where a holder joins, not a gap; an empty batch repeating
// the last applied sequence number (a heartbeat) is liveness, not a
// restart (Stats.Heartbeats); replay replies in either frame form.
type Engine uint8

// The engines.
const (
	EngineVLLM Engine = iota
	EngineSGLang
	EngineTRTLLM
)

// TRTRestartJump is the forward sequence jump that is a restart of an
// EngineTRTLLM pod: 2^32 nanoseconds (4.3 s) between its old and new
// process's first numbers. Batches come at most once per scheduler step,
// so a real gap is never this large.
const TRTRestartJump = 1 << 32

// ParseEngine reads an engine name: "" or "vllm", "sglang", "trtllm"
// (also "tensorrt-llm" and "tensorrt_llm"), case-insensitive.
func ParseEngine(s string) (Engine, error) {
	switch strings.ToLower(s) {
	case "", "vllm":
		return EngineVLLM, nil
	case "sglang":
		return EngineSGLang, nil
	case "trtllm", "tensorrt-llm", "tensorrt_llm":
		return EngineTRTLLM, nil
	}
	return 0, fmt.Errorf("%w: unknown engine %q (want vllm, sglang or trtllm)", ErrConfig, s)
}

func (e Engine) String() string {
	switch e {
	case EngineSGLang:
		return "sglang"
	case EngineTRTLLM:
		return "trtllm"
	}
	return "vllm"
}

// Hashing is the engine's default keys: vLLM's sha256 with its default
// seed and 16-token blocks; SGLang's page keys at its default page size,
// 1; TensorRT-LLM's v1_block_key at its default tokens_per_block, 32.
// Engines started with other settings need them set to match.
func (e Engine) Hashing() hashing.Config {
	switch e {
	case EngineSGLang:
		return hashing.Config{Algo: hashing.SGLang, BlockSize: 1}
	case EngineTRTLLM:
		return hashing.Config{Algo: hashing.TRTV1, BlockSize: 32}
	}
	return hashing.Config{Algo: hashing.SHA256, BlockSize: hashing.DefaultBlockSize}
}
