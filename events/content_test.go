package events

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

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

func TestHashCheckConvertsOnlyTheCheckedBlocksExtraKeys(t *testing.T) {
	hs, err := hashing.New(hashing.Config{Algo: hashing.SHA256, BlockSize: 4})
	require.NoError(t, err)
	p, err := NewProcessor(Config{Sink: index.New(index.Config{}), Hasher: hs, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	w := newWorker(p)
	h := w.holder(&message{Message: Message{Pod: "pod", Model: "m"}}, 0)
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
			Medium: "GPU", ExtraKeys: Some(raw)}
	}
	short, long := event(2), event(256)
	allocs := func(e *Event) float64 {
		return testing.AllocsPerRun(20, func() { w.checkAgreement(h, e, 0) })
	}
	a2, a256 := allocs(short), allocs(long)
	require.Zero(t, h.c[cHashMismatches].Load(), "the LoRA tuples reproduce the engine's keys")
	require.NotZero(t, h.c[cHashChecks].Load())
	require.Less(t, a256, a2+10, "allocations for 256 blocks (%v) against 2 (%v)", a256, a2)
}
