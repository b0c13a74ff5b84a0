// Package kvhints tells a vLLM engine's KVCR tier to pull a prefix from a
// peer: the KV hints contract (a versioned envelope with one kv.fetch@1.0
// action naming the source's KVCR control endpoint and the engine block
// hashes) for the pulls kvsource's picker decides.
//
// # Which decisions get a hint
//
// The decision is the picker's: a hint only where Decision.Reason is a pull
// (its threshold or cost model, load, liveness, pullable tiers and
// in-flight spreading all applied), and then only when Dynamo's
// eligibility rules hold too: the source and the destination have KVCR
// endpoints of the same worker type, the destination is no decode worker,
// the source is not the destination and its prefix is strictly longer than
// the destination's. Where they do not, Hinter.Hint says why (Reason). An
// index keyed by kvsource content keys has no hashes KVCR knows and gives
// no hint (ReasonContentKeys).
//
// The block hashes are the prompt's engine block keys (the 64-bit form the
// engines' KV events publish, which the index holds) from block 0 through
// the pull's last block, root-aligned as Dynamo sends them; KVCR reads
// them as a set and looks up only the blocks its engine lacks.
//
// # Endpoints
//
// vLLM advertises no KVCR endpoint to a router: Endpoints holds them per
// holder (pod and data-parallel rank), from configuration
// (ParseControlEndpoint: tcp://host:port, IPv6 in brackets, never an
// unspecified address) or from a pod's --kv-transfer-config JSON
// (FromKVTransferConfig: its kvcr secondary tier's control_ports and
// control_advertise_host). A holder without one is no hint source.
//
// # Encoding
//
// Hint.AppendEnvelope and Hint.AppendRouterHint append the JSON without
// reflection, block hashes as unsigned integers, with the key order of
// Dynamo's encoder (the envelope's payload keys sorted); they refuse
// (ErrInvalid) what KVCR's parser would refuse. A Placement says where a
// request carries the hint: kv_transfer_params.kv_hint (the default, what
// released vLLM's KVCR tier reads), the top-level kv_hints (vLLM's native
// field) or Dynamo's legacy kv_transfer_params.router_hint.
// AppendKVTransferParams and MergeIntoBody merge it into a request,
// keeping every other member.
package kvhints
