package picker

import (
	"context"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/transfer"
	"github.com/kvsource/kvsource/transfer/fake"
)

func TestDoneReleasesAPullOnceAcrossCopies(t *testing.T) {
	keys := seqKeys(8)
	p := newPicker(t, fleet(keys, holding{peerA, index.TierCPU, 0, 8}), Config{})
	req := Request{ID: "r", Model: model, Keys: keys, Destination: dst}
	first, err := p.Pick(req)
	require.NoError(t, err)
	second, err := p.Pick(req)
	require.NoError(t, err)
	require.Equal(t, 2, p.Inflight(peerA))

	kept := first // as a service keeps a decision by request id
	first.Done()
	kept.Done()
	first.Done()
	require.Equal(t, 1, p.Inflight(peerA), "the second pull is still in flight")

	// Concurrent Done on copies of one decision releases once too.
	var wg sync.WaitGroup
	for range 8 {
		c := second
		wg.Go(c.Done)
	}
	wg.Wait()
	require.Zero(t, p.Inflight(peerA))

	third, err := p.Pick(req)
	require.NoError(t, err)
	require.Equal(t, 1, p.Inflight(peerA), "a released copy does not release a later pull")
	second.Done()
	require.Equal(t, 1, p.Inflight(peerA))
	third.Done()
	require.Zero(t, p.Inflight(peerA))
}

// TestAKeptDecisionWithoutItsMissingKeysDoesNotKeepThemAlive keeps a pull
// decision for Done, as a service keeps it by request id, with Missing
// cleared: the keys must then be garbage, and Done must still release the
// pull.
func TestAKeptDecisionWithoutItsMissingKeysDoesNotKeepThemAlive(t *testing.T) {
	keys := seqKeys(1024)
	p := newPicker(t, fleet(keys, holding{peerA, index.TierCPU, 0, 1024}), Config{})
	d, err := p.Pick(Request{ID: "r", Model: model, Keys: keys, Destination: dst})
	require.NoError(t, err)
	require.Equal(t, ReasonPull, d.Reason)
	freed := make(chan struct{})
	runtime.AddCleanup(&d.Missing[0], func(c chan struct{}) { close(c) }, freed)
	kept := d
	kept.Missing = nil
	d = Decision{}
	require.Eventually(t, func() bool {
		runtime.GC()
		select {
		case <-freed:
			return true
		default:
			return false
		}
	}, 10*time.Second, 10*time.Millisecond, "the kept decision keeps its 1,024 missing keys alive")
	require.Equal(t, 1, p.Inflight(peerA))
	kept.Done()
	require.Zero(t, p.Inflight(peerA), "the kept decision still releases its pull")
}

func TestTransferKeysFeedAFakePull(t *testing.T) {
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	tokens := make([]uint32, 16*12+5)
	for i := range tokens {
		tokens[i] = uint32(i * 7)
	}
	prompt := hashing.Request{Tokens: tokens}
	blocks, err := h.Blocks(nil, prompt)
	require.NoError(t, err)
	require.Len(t, blocks, 12)
	keys := make([]uint64, len(blocks))
	for i, b := range blocks {
		keys[i] = b.Key
	}

	// The destination holds 4 blocks; peerA's offload tier holds all 12,
	// named by full digests as a vLLM producer names them.
	idx := fleet(keys, holding{dst, index.TierGPU, 0, 4}, holding{peerA, index.TierCPU, 0, 12})
	p := newPicker(t, idx, Config{Hasher: h})
	net := fake.New(fake.Config{})
	src := net.AddPeer(peerA.Pod)
	for _, b := range blocks {
		src.Hold(transfer.NewKey(b.Digest.Bytes(), 0))
	}

	d, err := p.Pick(Request{ID: "r", Model: model, Prompt: prompt, Destination: dst})
	require.NoError(t, err)
	require.Equal(t, ReasonPull, d.Reason)
	defer d.Done()
	tk, err := d.TransferKeys(blocks, 0)
	require.NoError(t, err)
	require.Len(t, tk, d.Gain)
	for i, k := range tk {
		require.Equal(t, blocks[d.Cached+i].Digest.Bytes(), k.Digest(), "key %d is the full digest", i)
		require.Equal(t, d.Missing[i], k.Uint64(), "key %d names the missing block", i)
	}

	dstMem := make([]byte, len(tk)*net.BlockLen())
	sess, err := net.Client(dstMem).Connect(context.Background(), d.Source.Pod)
	require.NoError(t, err)
	defer sess.Close()
	hits, err := sess.Lookup(context.Background(), tk)
	require.NoError(t, err)
	require.Equal(t, len(tk), transfer.Prefix(hits), "the source holds every key the decision names")
	idxs := make([]int, len(tk))
	for i := range idxs {
		idxs[i] = i
	}
	st, err := sess.Fetch(context.Background(), tk, idxs)
	require.NoError(t, err)
	require.Equal(t, d.Gain, st.Blocks)
	for i, k := range tk {
		bl := net.BlockLen()
		require.Equal(t, fake.Content(k, bl), dstMem[i*bl:(i+1)*bl], "block %d has the source's content", i)
	}
}

func TestTransferKeysRejectOtherBlocks(t *testing.T) {
	keys := seqKeys(8)
	p := newPicker(t, fleet(keys, holding{dst, index.TierGPU, 0, 2}, holding{peerA, index.TierCPU, 0, 8}), Config{})
	d, err := p.Pick(Request{ID: "r", Model: model, Keys: keys, Destination: dst})
	require.NoError(t, err)
	require.Equal(t, ReasonPull, d.Reason)
	defer d.Done()
	blocks := make([]hashing.Block, len(keys))
	for i, k := range keys {
		blocks[i] = hashing.Block{Key: k}
	}

	_, err = d.TransferKeys(blocks[:7], 0)
	require.ErrorIs(t, err, ErrBlocks, "too few blocks")
	blocks[5].Key++
	_, err = d.TransferKeys(blocks, 0)
	require.ErrorIs(t, err, ErrBlocks, "a block that is not the decision's")

	none, err := p.Pick(Request{ID: "r", Model: model, Keys: keys[:2], Destination: dst})
	require.NoError(t, err)
	require.Equal(t, ReasonLocalHit, none.Reason)
	tk, err := none.TransferKeys(nil, 0)
	require.NoError(t, err)
	require.Nil(t, tk, "nothing to pull, no keys")
}

func TestUnknownModelIsNotNoHolder(t *testing.T) {
	keys := seqKeys(8)
	cases := []struct {
		name   string
		idx    *bruteIndex
		model  string
		reason Reason
	}{
		{"a model the index knows no holder of", fleet(keys, holding{peerA, index.TierCPU, 0, 8}), "M", ReasonUnknownModel},
		{"a cold prompt of a known model", fleet(keys, holding{peerA, index.TierCPU, 4, 8}), model, ReasonNoHolder},
		{"an empty index cannot tell", newBrute(), "M", ReasonNoHolder},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPicker(t, tc.idx, Config{})
			req := Request{ID: "r", Model: tc.model, Keys: keys, Destination: dst}
			d, err := p.Pick(req)
			require.NoError(t, err)
			require.Equal(t, tc.reason, d.Reason)
			require.Equal(t, len(keys), d.Recompute, "everything is computed")

			scores, err := p.Score(req, nil)
			if tc.reason == ReasonUnknownModel {
				require.ErrorIs(t, err, ErrUnknownModel)
				require.ErrorContains(t, err, `"M"`)
				return
			}
			require.NoError(t, err)
			require.Empty(t, scores)
		})
	}
}

func TestPickOfAnUnknownModelAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts need a build without -race")
	}
	keys := seqKeys(8)
	p := newPicker(t, fleet(keys, holding{peerA, index.TierCPU, 0, 8}), Config{})
	req := Request{ID: "r", Model: "M", Keys: keys, Destination: dst}
	allocs := testing.AllocsPerRun(100, func() {
		if d, err := p.Pick(req); err != nil || d.Reason != ReasonUnknownModel {
			t.Fatal(d.Reason, err)
		}
	})
	require.Zero(t, allocs, "a cold prompt costs no allocation for telling the model unknown")
}
