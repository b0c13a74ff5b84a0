// Package requesthandling mirrors the part of llm-d-router v0.10.0's
// pkg/epp/framework/interface/requesthandling that kvsource's EPP plugins
// use: the parsed request body's token ids and the response's usage.
package requesthandling

// InferenceRequestBody is the parsed request body. Upstream's has a field
// per API (completions, chat completions, ...) and the payload; the mirror
// keeps the one field the plugins read.
type InferenceRequestBody struct {
	// TokenizedPrompt is the token producer's result, nil when the request
	// was not tokenized.
	TokenizedPrompt *TokenizedPrompt `json:"-"`
}

// Modality is a multimodal item's kind.
type Modality string

// Modalities.
const (
	ModalityImage Modality = "image"
	ModalityAudio Modality = "audio"
	ModalityVideo Modality = "video"
)

// TokenizedPrompt is a request's prompts as token ids.
type TokenizedPrompt struct {
	// PerPromptTokens holds one slice per prompt: one for chat and
	// single-string completions, several for multi-string completions.
	PerPromptTokens [][]uint32
	// MultiModalFeatures are the multimodal items of PerPromptTokens[0],
	// in prompt order; nil without multimodal content.
	MultiModalFeatures []MultiModalFeature
	// CacheSalt isolates prefix caches across tenants.
	CacheSalt string
}

// MultiModalFeature is one multimodal item: its content hash and its
// placeholder tokens [Offset, Offset+Length).
type MultiModalFeature struct {
	Modality Modality
	Hash     string
	Offset   int
	Length   int
}

// Usage is the token usage a response reports.
type Usage struct {
	PromptTokens       int                 `json:"prompt_tokens"`
	CompletionTokens   int                 `json:"completion_tokens"`
	TotalTokens        int                 `json:"total_tokens"`
	PromptTokenDetails *PromptTokenDetails `json:"prompt_tokens_details,omitempty"`
}

// PromptTokenDetails are the prompt's cached tokens.
type PromptTokenDetails struct {
	CachedTokens int `json:"cached_tokens"`
}
