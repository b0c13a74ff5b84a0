// Package render turns the OpenAI requests a router holds into what package
// hashing keys: the engine's exact token ids, multimodal items and cache
// salt, rendered by vLLM itself.
//
// A router in front of vLLM has completions and chat bodies (messages,
// tools, images), not token ids, and the block keys of a prompt depend on
// every token of the chat template vLLM applies, on its tokenizer, and on
// the hashes and placeholder ranges of the prompt's images. Reproducing
// that outside vLLM gets scores wrong; estimating it (llm-d's "estimate"
// backend, about 4 bytes a token) matches no engine at all. So, like
// llm-d's token producer, a Client posts the body to vLLM's own render
// endpoints, /v1/completions/render, /v1/chat/completions/render and
// /v1/messages/render (Anthropic Messages bodies), which any vLLM OpenAI
// server has and which `vllm launch render MODEL` serves without a GPU as
// a sidecar, and turns the answer (vLLM's GenerateRequest JSON: token_ids;
// features.mm_hashes and features.mm_placeholders per modality;
// cache_salt) into a hashing.Request.
//
// # The body
//
// The body is forwarded as it came, unknown members and all, with two
// splices: Config.Model stamped into "model" (a render-only server needs
// it), and "return_mm_kwargs": false, as llm-d sends it (vLLM's render
// requests have no such field: the tensors come anyway, see Cost). The
// client reads only "model", "cache_salt", whether it has a top-level
// "system" (an Anthropic Messages body: Render sends it to the messages
// endpoint, Chat refuses it, since the chat endpoint would render it
// without its system prompt) and whether a message's content is an array
// of parts (a multimodal render, which gets Config.MMTimeout instead of
// Config.Timeout), with a scanner that validates the JSON without
// decoding it, so a body of base64 images costs a pass over its bytes.
//
// # Failures
//
// Every error is an *Error naming the endpoint and, for an error answer,
// vLLM's status, type and message, and wraps one of three sentinels:
// ErrUnavailable (the backend is down, timed out or overloaded: a service
// answers 503), ErrBadRequest (the body is refused: 400) or ErrBadResponse
// (the answer is not what vLLM gives: 502). An answer is read up to
// Config.MaxResponseBytes and checked as vLLM's own validators check it, so
// a broken backend cannot hand the hasher impossible items; a prompt of
// more than Config.MaxTokens tokens is ErrBadRequest wrapping
// ErrTooManyTokens (413), found without reading further. A render the
// client's own timeout ended says which (Error.Timeout, Error.Multimodal).
// A render whose caller's context ended wraps the context's error and none
// of them.
//
// # Cost
//
// A render is an HTTP/1.1 round trip over a keep-alive pool (vLLM speaks no
// HTTP/2) plus the backend's tokenization, and far more for images, which
// the backend downloads and processes. The answer is parsed as it arrives,
// through a pooled 32 KiB window: its token ids are read without
// reflection into an array doubled as they come (no more than
// Config.MaxTokens), and what the client does not keep, above all the
// processed tensors vLLM sends for every image (features.kwargs_data,
// about 33 MiB for one of 1024x1024), streams past validated but never
// held. An answer's memory is thus the window, 4 to 8 bytes a token and
// its items' hashes, whatever its size; RenderCharged tells a caller's
// Charge of it before it is allocated, so that a service can bound the
// answers being read with the bodies it holds. Config.CacheBytes keeps
// recent renders, keyed by a hash of the body sent, for routers that see
// the same body more than once (retries, a pick then a score). Warm checks
// the backend at start-up and opens the pool's connections.
package render
