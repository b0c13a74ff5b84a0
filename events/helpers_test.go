package events

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/index"
)

var (
	_ Sink = (*index.Index)(nil)
	_ Sink = (*eventstest.RecSink)(nil)
	_ Sink = (*eventstest.TeeSink)(nil)
)

// startProcessor starts a Processor logging nowhere (unless cfg has a
// Logger) and closes it when the test ends.
func startProcessor(t testing.TB, cfg Config) *Processor {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p, err := NewProcessor(cfg)
	require.NoError(t, err)
	require.NoError(t, p.Start(t.Context()))
	t.Cleanup(p.Close)
	return p
}

func storedTokens(parent *uint64, tokens []uint32, keys ...uint64) Event {
	e := Event{Type: EventBlockStored, BlockHashes: keys, BlockSize: 4, Medium: "GPU", TokenIDs: tokens}
	if parent != nil {
		e.Parent = Some(*parent)
	}
	return e
}

func ptr(v uint64) *uint64 { return &v }

func seqTokens(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

func statusOf(p *Processor, h index.Holder) HolderStatus {
	for _, st := range p.Status() {
		if st.Holder() == h {
			return st
		}
	}
	return HolderStatus{}
}

func batchOf(evs ...Event) Batch { return Batch{TS: 1, DPRank: Some(0), Events: evs} }
