package picker

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
)

func TestPickAndScoreContextAnswerAsPickAndScoreWhenNotStopped(t *testing.T) {
	p, req := benchFleet(t, 4096, 8)
	req.Keys = nil
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	want, err := p.Pick(req)
	require.NoError(t, err)
	want.Done()
	got, err := p.PickContext(ctx, req)
	require.NoError(t, err)
	got.Done()
	require.Equal(t, want.Reason, got.Reason)
	require.Equal(t, want.Source, got.Source)
	require.Equal(t, want.Gain, got.Gain)
	ws, err := p.Score(req, nil)
	require.NoError(t, err)
	gs, err := p.ScoreContext(ctx, req, nil)
	require.NoError(t, err)
	require.Equal(t, ws, gs)
}

func TestPickAndScoreContextStopWithTheContextsError(t *testing.T) {
	p, req := benchFleet(t, 4096, 8)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, name := range []string{"hashing", "keys"} {
		t.Run(name, func(t *testing.T) {
			r := req
			if name == "hashing" {
				r.Keys = nil
			}
			d, err := p.PickContext(ctx, r)
			require.ErrorIs(t, err, context.Canceled)
			require.NotErrorIs(t, err, ErrHash)
			require.Empty(t, d.Reason)
			for _, c := range r.Candidates {
				require.Zero(t, p.Inflight(c.Holder), "a stopped pick counts no pull")
			}
			_, err = p.ScoreContext(ctx, r, nil)
			require.ErrorIs(t, err, context.Canceled)
		})
	}
}

// The attack: a 4 MiB LoRA name hashed into each of 4,096 blocks
// took 45 s; under a deadline the pick stops within it.
func TestPickContextStopsCostlyHashingAtTheDeadline(t *testing.T) {
	p, req := benchFleet(t, 4096*16, 4)
	req.Keys = nil
	req.Prompt = hashing.Request{Tokens: req.Prompt.Tokens, LoRAName: strings.Repeat("l", 4<<20)}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := p.PickContext(ctx, req)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorIs(t, err, hashing.ErrStopped)
	require.Less(t, time.Since(start), 2*time.Second)
}
