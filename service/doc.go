// Package service is kvsource's HTTP service, the SDK for routers not
// written in Go, as a library: a subscriber receives the engines' KV events
// into an index, and a picker answers over HTTP with JSON (block keys as
// decimal strings). The kvsource serve command runs it; a Go gateway mounts
// its Handler beside its own routes instead of running a second binary:
//
//	svc, err := service.New(ctx, service.Config{EventsBind: []string{"tcp://*:5557"}})
//	...
//	svc.Start(ctx)
//	mux.Handle("/kv/", http.StripPrefix("/kv", svc.Handler()))
//	...
//	svc.Shutdown(ctx) // saves the snapshot
//
// The API:
//
//	POST /v1/score  {"model", "tokens", "lora_name"?, "cache_salt"?, "mm_items"?, "pods"?}
//	                -> {"model", "blocks", "pods": [{"pod", "dp_rank", "matched_blocks", "tiers": {"GPU", "CPU"}, "score"}]}, best first
//	POST /v1/pick   {"model", "tokens", "lora_name"?, "cache_salt"?, "mm_items"?, "request_id"?, "destination",
//	                 "destination_dp_rank"?, "candidates"?: [{"pod", "dp_rank"?, "waiting"?, "load"?}], "min_cached_token_delta"?}
//	                -> {"destination", "source" (or null), "reason", "destination_cached_blocks", "source_blocks",
//	                    "best_source_blocks", "recompute_blocks", "missing_blocks", "header", "kv_transfer_params",
//	                    "predicted_saving_ms" (with --calibration), "skipped_sources", "skipped_state"?, ...,
//	                    "kv_hints"? and "hint_reason"? (with KVCR endpoints)}
//	POST /v1/done   {"request_id"} releases a pull so its source no longer counts it in flight: the
//	                pick's request_id, or the kv_request_id its answer made up when it had none
//	GET  /v1/pods   {"pods": [{"pod", "model", "dp_rank", "blocks", "last_seq", "state", "inflight_pulls",
//	                 and each per-holder counter of events.Counters: "gaps", "replays", "decode_errors",
//	                 "hash_mismatches", ...}], "endpoints": [{"pod", "endpoint", "connected"}] (--events-connect)}
//	GET  /metrics   Prometheus; GET /healthz
//
// A prompt's "tokens" may come as "tokens_b64" instead: base64 (standard,
// padded) of the token ids as little-endian uint32s. A candidate without
// "dp_rank" stands for every rank of its pod. Errors
// are {"error"}: 400 for a bad request (identifiers are at most 4 KiB), 405
// for another method, 404 for an unknown path and for /v1/score of a model
// the index knows no holder of while it knows others, which /v1/pick answers
// with reason "unknown_model", 413 for more tokens than --max-tokens or a
// body over its limit, 503 with Retry-After beyond --max-inflight-requests
// or past --request-timeout (see Limits). SIGINT or SIGTERM shuts
// down gracefully, saving the --snapshot file, which start-up loads; it is
// also saved every --snapshot-interval, so a crash loses at most that (see
// SnapshotConfig). A holder loaded from the snapshot is listed "stale" in
// /v1/pods, with its saved last_seq, until its pod publishes again; it
// scores but is never a pull source, and if it does not publish within
// --snapshot-expiry its entries are removed (so that saves drop it).
//
// /v1/pods states: "live" (heard from since start and connected: the only
// pull sources), "stale", "disconnected" (its connection went down: the
// socket monitor sees a closed connection at once, a silent one within
// three heartbeats) and "conflict" (two sequence streams under one name).
// A pick that passed over holders in another state says so in
// "skipped_sources" and "skipped_state", and answers "no_live_source" when
// only they could have extended the prefix.
//
// With KVCR control endpoints (--kvcr-endpoint, or --kvcr-config from a
// pod's vLLM --kv-transfer-config), a pull whose source and destination
// both have one, of one worker type, also carries a KV hint for vLLM's
// KVCR tier (package picker/kvhints): a kv.fetch@1.0 envelope naming the
// source's control endpoint and the prompt's engine block hashes from
// block 0, with the pick's kv_request_id as message_id, in the answer's
// kv_transfer_params as kv_hint (the default --hint-placement), as
// router_hint (Dynamo's legacy payload), or as the answer's top-level
// kv_hints (vLLM's native field). A router sets the kv_transfer_params
// members in the engine request's own, and kv_hints at its top level.
// "hint_reason" is "hinted" or why a pick has none (no_pull,
// no_source_endpoint, destination_not_kvcr, worker_type, decode_leg,
// content_keys with --keys content).
//
// On --events-bind, a topic naming a pod by an IP ("kv@10.0.0.7:8000@m") is
// accepted only from that IP, and one naming it by a DNS name only from
// --events-allow networks (default loopback); see events/doc.go for the
// threat model.
package service
