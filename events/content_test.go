package events

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

func storedTokens(parent *uint64, tokens []uint32, keys ...uint64) Event {
	e := Event{Type: EventBlockStored, BlockHashes: keys, BlockSize: 4, Medium: "GPU", TokenIDs: tokens}
	if parent != nil {
		e.Parent, e.HasParent = *parent, true
	}
	return e
}

func batchOf(events ...Event) Batch { return Batch{TS: 1, HasDPRank: true, Events: events} }

func TestContentModeKeysBlocksByTokensAndResolvesEngineKeys(t *testing.T) {
	t.Parallel()
	ck, err := hashing.New(hashing.Config{Algo: hashing.Content, BlockSize: 4})
	require.NoError(t, err)
	tokens := seqTokens(0, 12)
	want, err := ck.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	withLoRA, err := ck.BlockKeys(nil, hashing.Request{Tokens: tokens[:4], LoRAName: "ad"})
	require.NoError(t, err)

	port := testenv.FreePort(t)
	sink := newRecSink()
	s := startSubscriber(t, Config{Sink: sink, Bind: []string{localEP(port)}, ContentKeys: ck})
	p := newPublisher(t, PublisherConfig{Endpoint: localEP(port), Topic: "kv@pod@m"})
	warmUp(t, p, s, 0)
	h := index.Holder{Pod: "pod"}

	// Engine keys no router can reproduce: 901-902-903, chained.
	publish(t, p, batchOf(storedTokens(nil, tokens[:8], 901, 902)))
	publish(t, p, batchOf(storedTokens(ptr(902), tokens[8:], 903)))
	requireKeys(t, sink, "m", h, "GPU", sorted(want...)...)

	// A legacy CPU-offload event names blocks by engine key only.
	publish(t, p, batchOf(Event{Type: EventBlockStored, BlockHashes: []uint64{902, 999}, BlockSize: 4, Medium: "CPU"}))
	requireKeys(t, sink, "m", h, "CPU", want[1])
	// Eviction by engine key.
	publish(t, p, batchOf(Event{Type: EventBlockRemoved, BlockHashes: []uint64{901}, Medium: "GPU"}))
	requireKeys(t, sink, "m", h, "GPU", sorted(want[1:]...)...)
	// A chain continuing from a block the holder never stored cannot be keyed.
	publish(t, p, batchOf(storedTokens(ptr(12345), tokens[:4], 904)))
	// The LoRA name is part of the content key, as on the request side.
	lora := storedTokens(nil, tokens[:4], 905)
	lora.LoRAName = "ad"
	publish(t, p, batchOf(lora))
	requireKeys(t, sink, "m", h, "GPU", sorted(append([]uint64{withLoRA[0]}, want[1:]...)...)...)
	require.Equal(t, uint64(2), s.Stats().Unresolved, "block 999 and block 904")
}

func TestContentMapStaysBoundedAndKeepsRecentEntries(t *testing.T) {
	m := newContentMap(100)
	for k := range uint64(1000) {
		m.put(k, k+1)
		if k%10 == 0 {
			// Entry 0 is used often and must survive rotations.
			v, ok := m.get(0)
			require.True(t, ok, "after %d inserts", k)
			require.Equal(t, uint64(1), v)
		}
		require.LessOrEqual(t, m.len(), 100)
	}
	v, ok := m.get(999)
	require.True(t, ok)
	require.Equal(t, uint64(1000), v)
	_, ok = m.get(500)
	require.False(t, ok, "old entries are dropped")
	m.reset()
	_, ok = m.get(999)
	require.False(t, ok)
}

func TestExtraKeysConvertsEventTuplesToHashingKeys(t *testing.T) {
	tests := []struct {
		name string
		raw  []byte
		want []hashing.ExtraKey
		err  bool
	}{
		{"none", nil, nil, false},
		{"lora, mm item, salt", []byte{0x93, 0xa2, 'l', 'o', 0x92, 0xa2, 'i', 'm', 0xfe, 0xa1, 's'},
			[]hashing.ExtraKey{hashing.Str("lo"), hashing.Tuple(hashing.Str("im"), hashing.Int(-2)), hashing.Str("s")}, false},
		{"bytes and big ints", []byte{0x92, 0xc4, 0x02, 0xde, 0xad, 0xcd, 0x12, 0x34},
			[]hashing.ExtraKey{hashing.Bytes([]byte{0xde, 0xad}), hashing.Int(0x1234)}, false},
		{"not a tuple", []byte{0xa1, 'x'}, nil, true},
		{"a map inside", []byte{0x91, 0x80}, nil, true},
		{"uint64 beyond int64", []byte{0x91, 0xcf, 0xff, 0, 0, 0, 0, 0, 0, 0}, nil, true},
		{"truncated", []byte{0x92, 0xa1}, nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ExtraKeys(tc.raw)
			if tc.err {
				require.ErrorIs(t, err, ErrMalformed)
				return
			}
			require.NoError(t, err)
			require.True(t, hashing.EqualKeys(tc.want, got), "got %v", got)
		})
	}
}

func TestHashCheckRunsOnlyOnEventsStartingAtBlockZero(t *testing.T) {
	t.Parallel()
	hs, err := hashing.New(hashing.Config{Algo: hashing.SHA256, BlockSize: 4})
	require.NoError(t, err)
	tokens := seqTokens(7, 8)
	keys, err := hs.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	port := testenv.FreePort(t)
	sink := newRecSink()
	s := startSubscriber(t, Config{Sink: sink, Bind: []string{localEP(port)}, Hasher: hs, MismatchLogInterval: time.Hour})
	p := newPublisher(t, PublisherConfig{Endpoint: localEP(port), Topic: "kv@pod@m"})
	warmUp(t, p, s, 0)
	withExtras := func(e Event) Event {
		e.HasExtraKeys, e.ExtraKeys = true, make([][]byte, len(e.BlockHashes))
		return e
	}
	publish(t, p,
		batchOf(storedTokens(nil, tokens, keys...)),        // checked, agrees
		batchOf(storedTokens(ptr(keys[0]), tokens[4:], 1)), // has a parent: not checked
		batchOf(storedTokens(nil, nil, 2)),                 // no tokens: not checked
		// Checked, disagrees, but without extra keys an unseen multimodal
		// item or salt may explain it on an engine that agreed before.
		batchOf(storedTokens(nil, tokens[:4], keys[0]^1)),
		// Checked, disagrees, with the event's complete extra keys.
		batchOf(withExtras(storedTokens(nil, tokens[:4], keys[0]^1))),
	)
	h := index.Holder{Pod: "pod"}
	require.Eventually(t, func() bool { return statusOf(s, h).HashChecks == 3 }, waitLong, 10*time.Millisecond)
	require.Eventually(t, func() bool { return statusOf(s, h).HashMismatches == 1 }, waitLong, 10*time.Millisecond)
}

func TestHashCheckConvertsOnlyTheCheckedBlocksExtraKeys(t *testing.T) {
	hs, err := hashing.New(hashing.Config{Algo: hashing.SHA256, BlockSize: 4})
	require.NoError(t, err)
	s, err := NewSubscriber(Config{Sink: newRecSink(), Hasher: hs, Logger: newTextLogger(discard{})})
	require.NoError(t, err)
	w := newWorker(s)
	h := w.holder(&source{pod: "pod"}, 0, "m", 0)
	loraTuple := []byte{0x91, 0xa7, 'm', 'y', '-', 'l', 'o', 'r', 'a'}
	event := func(blocks int) *Event {
		tokens := seqTokens(0, 4*blocks)
		raw := make([][]byte, blocks)
		for i := range raw {
			raw[i] = loraTuple
		}
		withLoRA, err := hs.BlockKeys(nil, hashing.Request{Tokens: tokens, LoRAName: "my-lora"})
		require.NoError(t, err)
		return &Event{Type: EventBlockStored, BlockHashes: withLoRA, TokenIDs: tokens, BlockSize: 4,
			Medium: "GPU", ExtraKeys: raw, HasExtraKeys: true}
	}
	short, long := event(2), event(256)
	allocs := func(e *Event) float64 {
		return testing.AllocsPerRun(20, func() { w.checkAgreement(h, e, 0) })
	}
	a2, a256 := allocs(short), allocs(long)
	require.Zero(t, h.hashMismatches.Load(), "the LoRA tuples reproduce the engine's keys")
	require.NotZero(t, h.hashChecks.Load())
	require.Less(t, a256, a2+10, "allocations for 256 blocks (%v) against 2 (%v)", a256, a2)
}
