// Package picker answers the two questions a KV-cache-aware router asks on
// every request: how much of this prompt does each pod already hold (Score),
// and, given the pod the router chose, should that pod pull the missing
// prefix from a peer instead of recomputing it, from which peer, and which
// blocks (Pick).
//
// # Scores
//
// A holder (a vLLM engine: pod and data-parallel rank) matches a prompt by its
// consecutive prefix of the prompt's block keys, in any tier and in each tier.
// Score weighs the blocks by tier (GPU 1.0, CPU 0.8 by default), ready for a
// router's scorer.
//
// # Pull decisions
//
// Pick compares like with like. The destination's local prefix L counts the
// blocks it holds in any tier, since it can use all of them. A peer's gain
// counts the blocks it can serve from a pullable tier (by default the CPU
// offload tier that vLLM's P2P producers serve from) starting at block L,
// because those are the blocks the destination lacks; blocks before L are
// worth nothing to it. The decision is a pull when the best gain reaches the
// threshold (Config.MinCachedTokenDelta, in tokens; optionally also a
// positive predicted saving from a cost Model), and otherwise one of
// local_hit, self, no_holder, unknown_model or below_threshold, each defined
// on Reason. unknown_model is no_holder for a model the index knows no holder
// of while it knows others: a misspelled model name is not silent.
//
// Only the CPU tier is pullable by default (Config.PullTiers), as vLLM's P2P
// producers serve pulls from their CPU offload tier: a peer holding the
// prefix on GPU alone scores but is not a source. A deployment whose
// transport reads GPU memory (NIXL) sets PullTiers to
// []string{index.TierGPU, index.TierCPU}.
//
// Peers whose gain is within one block of the best are equally good sources.
// Pick draws one with weight 1/(1 + waiting + load + pulls it directed there
// that are still in flight), from a hash of the request id so decisions are
// reproducible, or from a caller's random source. Counting its own in-flight
// pulls keeps a burst of requests for one hot prefix from landing on a single
// producer before any load report shows it. The caller marks a pull finished
// with Decision.Done; unmarked pulls expire after Config.InflightTTL.
//
// Any holder can be a source whatever its role: in a prefill/decode split the
// destination is the pod that computes the prefill, and the decode pod that
// produced a previous turn is a source like any other.
//
// A decision carries the missing keys in prompt order, the blocks left to
// recompute, and renders the two ways of telling a pod to pull: llm-d's
// x-kv-cache-source-host-port header (Decision.Header) and vLLM's
// kv_transfer_params remote_kv_source object (Decision.KVTransferParams). A
// router that moves the blocks itself takes Decision.TransferKeys, the
// full-digest keys a transfer.Session fetches. Decision.Done releases the
// pull once, however many copies of the decision call it.
//
// # Calibration
//
// Whether a pull pays depends on the model and the hardware. Fit takes
// measured recompute and pull times as transfer.Samples (the type
// transfer.MeasurePull returns), fits recompute as a + b·t + c·t² and a
// pull as floor + d·t, and returns the crossover and a threshold with a safety
// margin; its Model can also be set as Config.Cost to decide each request by
// its predicted saving.
//
// # Prefetch
//
// A Prefetcher moves a session's known prefix to the pod its next request
// will probably go to before that request arrives (an agent's tool call is
// running), deciding by Pick's rule, counting the move against its source
// like any pull, never moving the same prefix to the same pod twice for a
// session, and forgetting it after a TTL. With vLLM as it is, the move is a
// one-token completion of the prefix naming the source in
// kv_transfer_params (Prefetch.Warmup).
//
// A steady-state Pick allocates only the decision's missing keys and, for a
// pull, its claim on the source (its own allocation, so that a decision kept
// for Done with Missing cleared keeps no key alive); Score with a reused
// destination slice allocates nothing.
package picker
