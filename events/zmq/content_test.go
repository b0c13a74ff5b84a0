//go:build cgo

package zmq

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

func storedTokens(parent *uint64, tokens []uint32, keys ...uint64) events.Event {
	e := events.Event{Type: events.EventBlockStored, BlockHashes: keys, BlockSize: 4, Medium: "GPU", TokenIDs: tokens}
	if parent != nil {
		e.Parent = events.Some(*parent)
	}
	return e
}

func batchOf(evs ...events.Event) events.Batch {
	return events.Batch{DPRank: events.Some(0), TS: 1, Events: evs}
}

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
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, ContentKeys: ck}, Bind: []string{localEP(port)}})
	p := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@pod@m"})
	warmUp(t, p, s, 0)
	h := index.Holder{Pod: "pod"}

	// Engine keys no router can reproduce: 901-902-903, chained.
	publish(t, p, batchOf(storedTokens(nil, tokens[:8], 901, 902)))
	publish(t, p, batchOf(storedTokens(ptr(902), tokens[8:], 903)))
	requireKeys(t, sink, "m", h, "GPU", sorted(want...)...)

	// A legacy CPU-offload event names blocks by engine key only.
	publish(t, p, batchOf(events.Event{Type: events.EventBlockStored, BlockHashes: []uint64{902, 999}, BlockSize: 4, Medium: "CPU"}))
	requireKeys(t, sink, "m", h, "CPU", want[1])
	// Eviction by engine key.
	publish(t, p, batchOf(events.Event{Type: events.EventBlockRemoved, BlockHashes: []uint64{901}, Medium: "GPU"}))
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

func TestHashCheckRunsOnlyOnEventsStartingAtBlockZero(t *testing.T) {
	t.Parallel()
	hs, err := hashing.New(hashing.Config{Algo: hashing.SHA256, BlockSize: 4})
	require.NoError(t, err)
	tokens := seqTokens(7, 8)
	keys, err := hs.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	port := testenv.FreePort(t)
	sink := eventstest.NewRecSink()
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, Hasher: hs, MismatchLogInterval: time.Hour}, Bind: []string{localEP(port)}})
	p := newPublisher(t, PublisherConfig{Connect: localEP(port), Topic: "kv@pod@m"})
	warmUp(t, p, s, 0)
	withExtras := func(e events.Event) events.Event {
		e.ExtraKeys = events.Some(make([][]byte, len(e.BlockHashes)))
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

func sorted(keys ...uint64) []uint64 { return slices.Sorted(slices.Values(keys)) }
