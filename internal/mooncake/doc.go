// Package mooncake reads Mooncake request traces and turns them into the
// workload of NVIDIA Dynamo's KV-router indexer benchmark (mooncake_bench),
// so that the index can be measured by the same method as Dynamo's
// published figures and compared with them.
//
// Read parses the trace format of the Mooncake FAST'25 release: one JSON
// object a line with a timestamp, token lengths and prefix block ids. It
// leaves the ids' block size to the caller, so that the same records serve
// a replay with the trace's own 512-token blocks.
//
// Generate is a port of the benchmark's event generation: the requests are
// spread over mock vLLM engines with rand 0.9.2's StdRng (StdRng here, bit
// for bit), each engine's requests are run through an offline simulation of
// Dynamo's mock engine (its scheduler, KV block manager and timing model),
// and what comes out per engine is the benchmark's input: the prompts it was
// asked to match and the KV events it published, with simulated timestamps.
// Worker.Timeline merges and stretches them onto the benchmark's window.
// The port follows the version of Dynamo behind its published indexer
// tables; where it differs from Dynamo it says so (random decode tokens are
// seeded, a trace that would make Dynamo's engine preempt is an error).
package mooncake
