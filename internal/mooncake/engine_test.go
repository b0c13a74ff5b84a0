package mooncake

import (
	"math"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/internal/testenv"
)

// Block hashes of 128 tokens each hash_id 0, 1, 2 and their chain, computed
// with libxxhash 0.8.1's XXH3_64bits_withSeed(…, 1337).
const (
	local0   = 9536694438970776937
	local1   = 4136650367586629977
	chain01  = 5575236196163458334
	chain012 = 14833944776506497994
)

func oneWorker(bs int) Config {
	return Config{Workers: 1, Seed: 42, BlockSize: bs, GPUBlocks: 16384, SimulationMS: 10000, SpeedupRatio: 10}
}

func generateOne(t *testing.T, cfg Config, recs ...Record) Worker {
	t.Helper()
	ws, err := Generate(recs, cfg)
	require.NoError(t, err)
	require.Len(t, ws, 1)
	return ws[0]
}

func TestRequestKeysAreTheEnginesChainedBlockHashes(t *testing.T) {
	// 300 tokens of 3 ids: 2 full blocks and a tail, which is not a key.
	// An input_length past the ids' 3 × 128 tokens is clamped to them.
	w := generateOne(t, oneWorker(128), Record{InputLength: 300, OutputLength: 1, HashIDs: []uint64{0, 1, 2}})
	require.Equal(t, []Request{{Keys: []uint64{local0, chain01}}}, w.Requests)
	require.Equal(t, []Event{{Kind: EventStored, Keys: []uint64{local0, chain01}}}, w.Events)

	w = generateOne(t, oneWorker(128), Record{InputLength: 1 << 20, OutputLength: 1, HashIDs: []uint64{0, 1, 2}})
	require.Equal(t, []uint64{local0, chain01, chain012}, w.Requests[0].Keys)
}

func TestAPromptStoresOnlyTheBlocksTheWorkerLacksUnderTheLastItHas(t *testing.T) {
	w := generateOne(t, oneWorker(128),
		Record{Timestamp: 0, InputLength: 1 << 20, OutputLength: 1, HashIDs: []uint64{0, 1}},
		Record{Timestamp: 0, InputLength: 1 << 20, OutputLength: 1, HashIDs: []uint64{0, 1, 2}},
		Record{Timestamp: 5, InputLength: 1 << 20, OutputLength: 1, HashIDs: []uint64{0, 1, 2}},
	)
	require.Len(t, w.Requests, 3)
	require.Equal(t, []Event{
		{Kind: EventStored, Keys: []uint64{local0, chain01}},
		{Kind: EventStored, Parent: chain01, HasParent: true, Keys: []uint64{chain012}},
	}, w.Events, "the third prompt is cached whole (inactive by then): no event")
	require.Equal(t, w.Requests[0].TimestampUS, w.Events[0].TimestampUS, "admitted and stored in one pass")
	require.Equal(t, uint64(10_000_000), w.Requests[2].TimestampUS, "arrivals span the 10 s simulation")
}

func TestDecodeStoresOneBlockPerFilledBlockButNotTheLastPartialOne(t *testing.T) {
	for _, tc := range []struct{ out, stored int }{{1, 0}, {128, 0}, {129, 1}, {256, 1}, {257, 2}, {500, 3}} {
		w := generateOne(t, oneWorker(128), Record{InputLength: 256, OutputLength: tc.out, HashIDs: []uint64{0, 1}})
		decode := w.Events[1:]
		require.Len(t, decode, tc.stored, "output %d", tc.out)
		parent := uint64(chain01)
		for _, ev := range decode {
			require.True(t, ev.Decode)
			require.True(t, ev.HasParent)
			require.Equal(t, parent, ev.Parent, "each promoted block hangs under the one before")
			require.Len(t, ev.Keys, 1)
			parent = ev.Keys[0]
		}
	}
}

func TestAPartialPromptTailIsStoredWhenDecodeFillsIt(t *testing.T) {
	// Blocks of 4 tokens: a 6-token prompt is one full block and a tail of
	// 2; two generated tokens fill it, the third promotes it.
	w := generateOne(t, oneWorker(4), Record{InputLength: 6, OutputLength: 3, HashIDs: []uint64{7, 8}})
	require.Equal(t, []uint64{16259602842512645169}, w.Requests[0].Keys)
	require.Len(t, w.Events, 2)
	require.Equal(t, Event{Kind: EventStored, Keys: []uint64{16259602842512645169}}, w.Events[0])
	require.True(t, w.Events[1].Decode)
	require.Equal(t, uint64(16259602842512645169), w.Events[1].Parent)
}

func TestDecodePassesTakeThePolynomialModelsTime(t *testing.T) {
	// One 128-token prompt, 129 tokens out: its decode block is stored at the
	// start of pass 129. Pass 1 is the prefill of 128 tokens and a decode
	// step over 1 active block; passes 2-128 decode over 2 (the prompt's and
	// the partial one).
	w := generateOne(t, oneWorker(128), Record{InputLength: 128, OutputLength: 129, HashIDs: []uint64{0}})
	require.Len(t, w.Events, 2)
	// Each time is rounded to the nanosecond before and after the speedup,
	// as Rust's Duration does.
	ns := func(ms float64) float64 { return math.Round(math.Round(ms*1e6) / 10) }
	step := func(blocks float64) float64 {
		p := blocks * 128 / 16384
		return ns(max(-25.74*p*p+54.01*p+5.74, 1))
	}
	prefill := ns(4.209989e-07*128*128 + 1.518344e-02*128 + 1.650142e+01)
	require.Equal(t, uint64(prefill+step(1)+127*step(2))/1000, w.Events[1].TimestampUS)
}

func TestAFullCacheEvictsTheOldestInactiveBlock(t *testing.T) {
	cfg := oneWorker(128)
	cfg.GPUBlocks = 3
	w := generateOne(t, cfg,
		Record{Timestamp: 0, InputLength: 256, OutputLength: 1, HashIDs: []uint64{0, 1}},
		Record{Timestamp: 10, InputLength: 256, OutputLength: 1, HashIDs: []uint64{2, 3}},
	)
	// The first request frees its blocks last first, so its last block is
	// the oldest inactive one; its partial decode block is destroyed.
	require.Equal(t, EventRemoved, w.Events[1].Kind)
	require.Equal(t, []uint64{chain01}, w.Events[1].Keys)
	require.Equal(t, EventStored, w.Events[2].Kind)
	require.Len(t, w.Events[2].Keys, 2)
}

func TestACacheFullOfBlocksInUseIsAnError(t *testing.T) {
	cfg := oneWorker(128)
	cfg.GPUBlocks = 1
	_, err := Generate([]Record{{InputLength: 256, OutputLength: 1, HashIDs: []uint64{0, 1}}}, cfg)
	require.ErrorIs(t, err, ErrPreempt)
}

func TestGenerateRejectsWhatDynamosEngineCannotRun(t *testing.T) {
	_, err := Generate([]Record{{InputLength: 0, OutputLength: 1, HashIDs: []uint64{1}}}, oneWorker(128))
	require.ErrorIs(t, err, ErrTrace)
	_, err = Generate([]Record{{InputLength: 5, OutputLength: 0, HashIDs: []uint64{1}}}, oneWorker(128))
	require.ErrorIs(t, err, ErrTrace)
	_, err = Generate(nil, Config{})
	require.ErrorIs(t, err, ErrConfig)
}

func TestDurationRoundsAsRustsFromSecsF64(t *testing.T) {
	for _, tc := range []struct {
		secs float64
		want rustDuration
	}{
		{0, rustDuration{}},
		{1e-20, rustDuration{}},
		{math.Float64frombits(1), rustDuration{}},
		{4.2e-7, rustDuration{nanos: 420}},
		{0.999e-9, rustDuration{nanos: 1}},
		{2.7, rustDuration{secs: 2, nanos: 700_000_000}},
		{3e10, rustDuration{secs: 30_000_000_000}},
		{1.0 / 1024, rustDuration{nanos: 976_562}},   // 976562.5: ties to even, down
		{3.0 / 1024, rustDuration{nanos: 2_929_688}}, // 2929687.5: ties to even, up
		{1 + 1.0/1024, rustDuration{secs: 1, nanos: 976_562}},
		{0.9999999999, rustDuration{secs: 1}}, // 999999999.9 ns rounds up to a second
		{math.Nextafter(1, 0), rustDuration{secs: 1}},
	} {
		require.Equal(t, tc.want, durationFromSecs(tc.secs), "%v", tc.secs)
	}
	require.InDelta(t, 2.7, rustDuration{secs: 2, nanos: 700_000_000}.seconds(), 0)
	require.Equal(t, uint64(0), timestampUS(-1))
	require.Equal(t, uint64(0), timestampUS(math.NaN()))
	require.Equal(t, uint64(1234), timestampUS(1.2345))
}

func TestTimelinePutsARequestBeforeItsEventAndStretchesToTheWindow(t *testing.T) {
	w := Worker{
		Requests: []Request{{TimestampUS: 0}, {TimestampUS: 300}},
		Events:   []Event{{TimestampUS: 0}, {TimestampUS: 200}, {TimestampUS: 300}, {TimestampUS: 400}},
	}
	tl := w.Timeline(2)
	var kinds []string
	var times []uint64
	for _, e := range tl {
		require.True(t, (e.Request == nil) != (e.Event == nil))
		kind := "event"
		if e.Request != nil {
			kind = "request"
		}
		kinds = append(kinds, kind)
		times = append(times, e.TimestampUS)
	}
	require.Equal(t, []string{"request", "event", "event", "request", "event", "event"}, kinds)
	require.Equal(t, []uint64{0, 0, 1000, 1500, 1500, 2000}, times)
	require.Empty(t, (&Worker{}).Timeline(2))
}

// TestDynamoWorkloadCounts is the check of faithfulness: Dynamo's
// BENCH_SETUP gives 355,824 ops for the conversation trace at -d 7, and
// 2,128,077 blocks in one shard, 7 × 304,011.
func TestDynamoWorkloadCounts(t *testing.T) {
	f, err := os.Open(testenv.MooncakeTrace(t))
	require.NoError(t, err)
	defer f.Close()
	recs, err := Read(f)
	require.NoError(t, err)
	ws, err := Generate(recs, DynamoConfig())
	require.NoError(t, err)
	got := Count(ws)
	require.Equal(t, Totals{
		Requests:      12_031,
		RequestBlocks: 288_500,
		PrefillStored: 12_031,
		DecodeStored:  26_770,
		StoredBlocks:  304_011,
	}, got)
	require.Equal(t, 38_801, got.Events())
	require.Equal(t, 50_832, got.Ops())
	require.Equal(t, 355_824, 7*got.Ops())
	atZero := 0
	for i, w := range ws {
		tl := w.Timeline(30_000)
		require.NotEmpty(t, tl, "worker %d", i)
		end := tl[len(tl)-1].TimestampUS
		if end == 0 { // all at t = 0: one short request, as in Dynamo
			atZero++
			continue
		}
		require.Equal(t, uint64(30_000_000), end, "worker %d ends at the window", i)
	}
	require.Less(t, atZero, 10)
}
