package kvplugin

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requestcontrol"
	"github.com/kvsource/kvsource/examples/eppplugin/mirror/github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	"github.com/kvsource/kvsource/index"
)

// One request through both producers, both PreRequest hooks and the
// response's end, over 8 candidates of which 3 hold the prompt: what the
// plugins add to an EPP's request path, without and with speculative
// indexing. Reported per request; allocs include the PrefixCacheMatchInfo
// written to each candidate, which the API requires. With speculative
// indexing every request is recorded on its destination, so from the second
// on the destination holds the prompt (speculatively) and pulls nothing.
func BenchmarkRequestPath(b *testing.B) {
	for _, spec := range []bool{false, true} {
		b.Run(fmt.Sprintf("speculative=%v", spec), func(b *testing.B) {
			benchmarkRequestPath(b, spec)
		})
	}
}

func benchmarkRequestPath(b *testing.B, spec bool) {
	w := newWorldWith(b, func(c *PrefixConfig) { c.SpeculativeIndexing = spec }, SourceConfig{})
	var eps []scheduling.Endpoint
	for i := range 8 {
		ep := endpoint(ip(i+1), i)
		if i < 3 {
			w.hold(ep, index.TierGPU, 0, promptBlocks)
			w.hold(ep, index.TierCPU, 0, promptBlocks)
		}
		eps = append(eps, ep)
	}
	res := result(eps[7], nil, "")
	ids := make([]string, 1024)
	for i := range ids {
		ids[i] = fmt.Sprintf("req-%d", i)
	}
	ctx := context.Background()
	end := &requestcontrol.Response{EndOfStream: true}
	pulls := 0
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		req := w.request(ids[i%len(ids)])
		_ = w.prefix.Produce(ctx, req, eps)
		_ = w.src.Produce(ctx, req, eps)
		_ = w.prefix.PreRequest(ctx, req, res)
		_ = w.src.PreRequest(ctx, req, res)
		if header(req) != "" {
			pulls++
		}
		w.src.ResponseBody(ctx, req, end, nil)
	}
	if pulls == 0 {
		b.Fatal("no request pulled")
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/request")
}
