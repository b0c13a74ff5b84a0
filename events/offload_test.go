package events

import (
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"

	"github.com/kvsource/kvsource/internal/testenv"
)

const chunkedWarning = "CPU-tier lookups will undercount: configure the offloading connector's block_size equal to the GPU block size"

// cpuStored is a token-less CPU-tier BlockStored of the given block size,
// as vLLM's offloading connector sends it.
func cpuStored(blockSize int, keys ...uint64) Event {
	return Event{Type: EventBlockStored, BlockHashes: keys, BlockSize: blockSize, Medium: "CPU"}
}

// sorted returns keys in increasing order, as recSink.keys lists them.
func sorted(keys ...uint64) []uint64 { return slices.Sorted(slices.Values(keys)) }

func TestChunkedOffloadIsCountedAndWarnedOncePerHolderAndStillApplied(t *testing.T) {
	t.Parallel()
	hasher, err := hashing.New(hashing.Config{BlockSize: 4})
	require.NoError(t, err)
	// The GPU tier's keys are real, so that the hash agreement check passes
	// on them and any mismatch counted comes from the offload events.
	k, err := hasher.BlockKeys(nil, hashing.Request{Tokens: seqTokens(0, 16)})
	require.NoError(t, err)
	gpu := storedTokens(nil, seqTokens(0, 16), k...) // block size 4
	type msg struct {
		rank   int
		events []Event
	}
	cases := []struct {
		name   string
		hasher *hashing.Hasher
		msgs   []msg
		// want is each rank's chunked_offload count; logs the warnings'
		// text fragments, in order (none when empty).
		want    map[int]uint64
		logs    []string
		cpuKeys map[int][]uint64
	}{
		{
			name: "k=4 against the GPU tier's events is counted per event and warned once",
			msgs: []msg{
				{0, []Event{gpu}},
				{0, []Event{cpuStored(16, k[3])}},
				{0, []Event{cpuStored(16, 8)}},
			},
			want:    map[int]uint64{0: 2},
			logs:    []string{"pod=pod rank=0 model=m seq=1 tier=CPU block_size=16 expected_block_size=4 expected_from=gpu_events chunked_offload=1 blocks_per_chunk=4"},
			cpuKeys: map[int][]uint64{0: sorted(k[3], 8)},
		},
		{
			name: "each rank is its own holder with its own warning",
			msgs: []msg{
				{0, []Event{gpu}},
				{1, []Event{gpu}},
				{0, []Event{cpuStored(8, k[1])}},
				{1, []Event{cpuStored(8, k[1]), cpuStored(8, k[3])}},
			},
			want: map[int]uint64{0: 1, 1: 2},
			logs: []string{
				"rank=0 model=m seq=1 tier=CPU block_size=8 expected_block_size=4",
				"rank=1 model=m seq=1 tier=CPU block_size=8 expected_block_size=4",
			},
			cpuKeys: map[int][]uint64{0: {k[1]}, 1: sorted(k[1], k[3])},
		},
		{
			name:    "before any GPU-tier event the router's hasher sets the expected size",
			hasher:  hasher,
			msgs:    []msg{{0, []Event{cpuStored(12, k[2])}}},
			want:    map[int]uint64{0: 1},
			logs:    []string{"seq=0 tier=CPU block_size=12 expected_block_size=4 expected_from=router_hasher chunked_offload=1 blocks_per_chunk=3"},
			cpuKeys: map[int][]uint64{0: {k[2]}},
		},
		{
			name:    "k=1 is exact and silent",
			hasher:  hasher,
			msgs:    []msg{{0, []Event{gpu}}, {0, []Event{cpuStored(4, k...)}}},
			want:    map[int]uint64{0: 0},
			cpuKeys: map[int][]uint64{0: sorted(k...)},
		},
		{
			name:    "block size 0 cannot be told apart and is assumed exact",
			hasher:  hasher,
			msgs:    []msg{{0, []Event{gpu}}, {0, []Event{cpuStored(0, k[3])}}},
			want:    map[int]uint64{0: 0},
			cpuKeys: map[int][]uint64{0: {k[3]}},
		},
		{
			name:    "without a GPU-tier event or a hasher there is nothing to compare with",
			msgs:    []msg{{0, []Event{cpuStored(16, k[3])}}},
			want:    map[int]uint64{0: 0},
			cpuKeys: map[int][]uint64{0: {k[3]}},
		},
	}
	for _, tc := range cases {
		for _, layout := range []Layout{LayoutMap, LayoutArray} {
			t.Run(tc.name+"/"+layout.String(), func(t *testing.T) {
				logs := &testenv.SyncBuffer{}
				sink := eventstest.NewRecSink()
				s, err := NewProcessor(Config{Sink: sink, Hasher: tc.hasher, Logger: testenv.TextLogger(logs)})
				require.NoError(t, err)
				w := newWorker(s)
				seqs := map[int]uint64{}
				for _, m := range tc.msgs {
					b := batchOf(m.events...)
					b.DPRank = Some(m.rank)
					// Each rank numbers its own batches: a shared count
					// would be a gap, and the gap policy a clear.
					w.handle(message{Message: Message{Pod: "pod", Model: "m", Seq: seqs[m.rank], Payload: AppendBatch(nil, &b, layout, 0)}})
					seqs[m.rank]++
				}
				require.Equal(t, uint64(len(tc.msgs)), s.Stats().Batches, "every batch applied")

				var total uint64
				for rank, want := range tc.want {
					h := index.Holder{Pod: "pod", Rank: rank}
					require.Equal(t, want, statusOf(s, h).ChunkedOffload, "rank %d", rank)
					require.Equal(t, tc.cpuKeys[rank], sink.Keys("m", h, "CPU"), "rank %d: CPU events applied as before", rank)
					total += want
				}
				require.Equal(t, total, s.Stats().ChunkedOffload)
				require.Zero(t, s.Stats().HashMismatches, "a chunked event is not a hashing mismatch")

				got := strings.Count(logs.String(), chunkedWarning)
				require.Equal(t, len(tc.logs), got, "warnings in %q", logs.String())
				for _, frag := range tc.logs {
					require.Contains(t, logs.String(), frag)
				}
			})
		}
	}
}

func TestChunkedOffloadEventWithTokensIsNotReportedAsAHashMismatch(t *testing.T) {
	t.Parallel()
	hasher, err := hashing.New(hashing.Config{BlockSize: 4})
	require.NoError(t, err)
	s, err := NewProcessor(Config{Sink: eventstest.NewRecSink(), Hasher: hasher, Logger: testenv.TextLogger(discard{})})
	require.NoError(t, err)
	w := newWorker(s)
	// A self-describing chunk of four GPU blocks from block 0: its tokens
	// are consistent with its block size, which is not the hashing one.
	cpu := storedTokens(nil, seqTokens(0, 16), 99)
	cpu.BlockSize, cpu.Medium = 16, "CPU"
	b := batchOf(cpu)
	w.handle(message{Message: Message{Pod: "pod", Model: "m", Seq: 0, Payload: AppendBatch(nil, &b, LayoutMap, 0)}})

	st := s.Stats()
	require.Equal(t, uint64(1), st.ChunkedOffload)
	require.Zero(t, st.HashChecks)
	require.Zero(t, st.HashMismatches)
}
