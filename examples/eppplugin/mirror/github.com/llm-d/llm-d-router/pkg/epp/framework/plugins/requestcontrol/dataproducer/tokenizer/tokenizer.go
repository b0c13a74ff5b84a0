// Package tokenizer mirrors the data key of llm-d-router v0.10.0's
// token-producer, whose TokenizedPrompt prefix producers consume.
package tokenizer

import "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"

// PluginType is the token producer's type.
const PluginType = "token-producer"

// TokenizedPromptDataKey is the key of the request's TokenizedPrompt.
var TokenizedPromptDataKey = plugin.NewDataKey("TokenizedPrompt", PluginType)
