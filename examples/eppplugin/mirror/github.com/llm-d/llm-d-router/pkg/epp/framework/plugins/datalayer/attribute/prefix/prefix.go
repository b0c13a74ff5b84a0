// Package prefix mirrors llm-d-router v0.10.0's
// pkg/epp/framework/plugins/datalayer/attribute/prefix: the per-endpoint
// prefix match that prefix producers write and the prefix-cache scorer and
// p2p-source-producer read.
package prefix

import (
	"maps"

	fwkdl "github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
)

// PrefixCacheMatchInfoDataKey is the match's key, bound by default to
// approx-prefix-cache-producer; other producers bind it to their name.
var PrefixCacheMatchInfoDataKey = plugin.NewDataKey("PrefixCacheMatchInfoDataKey", "approx-prefix-cache-producer")

// SpeculativeTierKey is the CachedBlocksByTier key of speculative entries.
const SpeculativeTierKey = "speculative"

// PrefixCacheMatchInfo is how much of a request's prompt an endpoint holds.
type PrefixCacheMatchInfo struct {
	matchBlocks        int
	totalBlocks        int
	blockSizeTokens    int
	cachedBlockCount   int
	cachedBlocksByTier map[string]int
}

// NewPrefixCacheMatchInfo returns a match of matchBlocks (tier-weighted for
// precise producers) out of totalBlocks blocks of blockSizeTokens tokens.
func NewPrefixCacheMatchInfo(matchBlocks, totalBlocks, blockSizeTokens int) *PrefixCacheMatchInfo {
	return &PrefixCacheMatchInfo{matchBlocks: matchBlocks, totalBlocks: totalBlocks, blockSizeTokens: blockSizeTokens, cachedBlockCount: matchBlocks}
}

// WithCachedBlockCount sets the unweighted consecutive cached prefix.
func (p *PrefixCacheMatchInfo) WithCachedBlockCount(cachedBlockCount int) *PrefixCacheMatchInfo {
	p.cachedBlockCount = cachedBlockCount
	return p
}

// WithCachedBlocksByTier sets each tier's own consecutive prefix, keyed by
// lower-case tier; the match owns the map.
func (p *PrefixCacheMatchInfo) WithCachedBlocksByTier(cachedBlocksByTier map[string]int) *PrefixCacheMatchInfo {
	p.cachedBlocksByTier = cachedBlocksByTier
	return p
}

func (p *PrefixCacheMatchInfo) MatchBlocks() int     { return p.matchBlocks }
func (p *PrefixCacheMatchInfo) TotalBlocks() int     { return p.totalBlocks }
func (p *PrefixCacheMatchInfo) BlockSizeTokens() int { return p.blockSizeTokens }

// CachedBlockCount is the unweighted consecutive cached prefix, any tier.
func (p *PrefixCacheMatchInfo) CachedBlockCount() int { return p.cachedBlockCount }

// CachedBlocksByTier is each tier's consecutive prefix; nil when the
// producer has no tier data. Callers must not modify it.
func (p *PrefixCacheMatchInfo) CachedBlocksByTier() map[string]int { return p.cachedBlocksByTier }

// Clone implements Cloneable.
func (p *PrefixCacheMatchInfo) Clone() fwkdl.Cloneable {
	c := *p
	c.cachedBlocksByTier = maps.Clone(p.cachedBlocksByTier)
	return &c
}
