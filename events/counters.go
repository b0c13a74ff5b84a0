package events

import (
	"encoding/json"
	"strconv"
	"sync/atomic"
)

// counter identifies one of the processor's counters.
type counter int

const (
	cMessages counter = iota
	cBadMessages
	cBatches
	cEvents
	cBlocks
	cUnknown
	cDecodeErrors
	cGaps
	cReplays
	cReplayErrors
	cReplayTimeouts
	cReplayed
	cReplayRounds
	cReplayRecovered
	cUnrecovered
	cRestarts
	cDups
	cQueueFull
	cHashChecks
	cHashMismatches
	cUnresolved
	cTokenless
	cEmptyTopic
	cUnknownTopic
	cNoModel
	cZeroParents
	cEvicted
	cChunkedOffload
	cBadTopic
	cSenderMismatch
	cSenderHolders
	cConflicts
	cConflictDropped
	cDisconnects
	cExpired
	cHeartbeats
	numCounters
)

// counters holds the processor's counters, and each holder's.
type counters [numCounters]atomic.Uint64

// Counter is one of the processor's counters. Each is defined once, in
// Counters, from which Stats, HolderStatus and the service's Prometheus
// metrics are rendered.
type Counter struct {
	// Name is the counter's snake_case name; Prometheus exports it as
	// kvsource_events_<Name>_total.
	Name string
	// Help says what it counts.
	Help string
	// Stat returns the counter's field in a Stats.
	Stat func(*Stats) *uint64
	// Holder returns its field in a HolderStatus; nil when it is counted
	// only globally.
	Holder func(*HolderStatus) *uint64
	id     counter
}

// Counters lists every counter of a Processor, in Stats order.
var Counters = []Counter{
	{"messages", "Event messages received.", func(s *Stats) *uint64 { return &s.Messages }, nil, cMessages},
	{"bad_messages", "Messages dropped for a wrong frame count, sequence frame or topic.", func(s *Stats) *uint64 { return &s.BadMessages }, nil, cBadMessages},
	{"batches", "Event batches applied, live and replayed.", func(s *Stats) *uint64 { return &s.Batches }, nil, cBatches},
	{"events", "Events applied.", func(s *Stats) *uint64 { return &s.Events }, nil, cEvents},
	{"blocks", "Blocks in applied BlockStored and BlockRemoved events.", func(s *Stats) *uint64 { return &s.Blocks }, nil, cBlocks},
	{"unknown_events", "Events of unknown type, skipped.", func(s *Stats) *uint64 { return &s.UnknownEvents }, nil, cUnknown},
	{"decode_errors", "Malformed payloads, dropped.", func(s *Stats) *uint64 { return &s.DecodeErrors },
		func(h *HolderStatus) *uint64 { return &h.DecodeErrors }, cDecodeErrors},
	{"gaps", "Forward sequence jumps.", func(s *Stats) *uint64 { return &s.Gaps },
		func(h *HolderStatus) *uint64 { return &h.Gaps }, cGaps},
	{"replays", "Replay requests answered in full (gaps, resyncs, joins).", func(s *Stats) *uint64 { return &s.Replays },
		func(h *HolderStatus) *uint64 { return &h.Replays }, cReplays},
	{"replay_errors", "Replay requests that failed or timed out.", func(s *Stats) *uint64 { return &s.ReplayErrors }, nil, cReplayErrors},
	{"replay_timeouts", "Of the failed replay requests, those that timed out.", func(s *Stats) *uint64 { return &s.ReplayTimeouts }, nil, cReplayTimeouts},
	{"replayed_batches", "Batches applied from replay.", func(s *Stats) *uint64 { return &s.Replayed }, nil, cReplayed},
	{"replay_rounds", "Replay requests repeated because replies were lost in transit.", func(s *Stats) *uint64 { return &s.ReplayRounds }, nil, cReplayRounds},
	{"replay_recovered_batches", "Batches applied by repeated replay requests.", func(s *Stats) *uint64 { return &s.ReplayRecovered }, nil, cReplayRecovered},
	{"unrecovered_gaps", "Gaps replay did not close; the gap policy applied.", func(s *Stats) *uint64 { return &s.Unrecovered },
		func(h *HolderStatus) *uint64 { return &h.Unrecovered }, cUnrecovered},
	{"restarts", "Engine restarts (sequences going backwards, or a holder publishing another model).", func(s *Stats) *uint64 { return &s.Restarts },
		func(h *HolderStatus) *uint64 { return &h.Restarts }, cRestarts},
	{"duplicates", "Live batches dropped as already applied from replay.", func(s *Stats) *uint64 { return &s.Duplicates }, nil, cDups},
	{"queue_full", "Messages dropped because a worker queue, or the queue behind a pod's replay, was full.", func(s *Stats) *uint64 { return &s.QueueFull }, nil, cQueueFull},
	{"hash_checks", "Hash agreement checks run.", func(s *Stats) *uint64 { return &s.HashChecks },
		func(h *HolderStatus) *uint64 { return &h.HashChecks }, cHashChecks},
	{"hash_mismatches", "Hash agreement checks that failed: engine and router hash differently.", func(s *Stats) *uint64 { return &s.HashMismatches },
		func(h *HolderStatus) *uint64 { return &h.HashMismatches }, cHashMismatches},
	{"unresolved_blocks", "Content-key mode: blocks whose content key was unknown.", func(s *Stats) *uint64 { return &s.Unresolved }, nil, cUnresolved},
	{"tokenless_events", "Content-key mode: BlockStored events without token ids whose blocks could not be keyed.", func(s *Stats) *uint64 { return &s.Tokenless },
		func(h *HolderStatus) *uint64 { return &h.Tokenless }, cTokenless},
	{"empty_topic", "Of the bad messages, bind-mode messages with vLLM's default empty topic, which names no pod.", func(s *Stats) *uint64 { return &s.EmptyTopic }, nil, cEmptyTopic},
	{"unknown_topic", "Of the bad messages, bind-mode messages whose topic is not kv@POD@MODEL.", func(s *Stats) *uint64 { return &s.UnknownTopic }, nil, cUnknownTopic},
	{"no_model", "Of the bad messages, those of a pod whose model neither its topic nor its configuration names.", func(s *Stats) *uint64 { return &s.NoModel }, nil, cNoModel},
	{"zero_parents", "BlockStored events with parent 0 (llm-d's empty block hash), read as starting a chain.", func(s *Stats) *uint64 { return &s.ZeroParents }, nil, cZeroParents},
	{"holders_evicted", "Holders forgotten, their entries cleared, to make room for a new one at the holder limit.", func(s *Stats) *uint64 { return &s.Evicted }, nil, cEvicted},
	{"chunked_offload", "Offload-tier events whose block size differs from the GPU tier's: their CPU-tier lookups undercount.", func(s *Stats) *uint64 { return &s.ChunkedOffload },
		func(h *HolderStatus) *uint64 { return &h.ChunkedOffload }, cChunkedOffload},
	{"bad_topic", "Messages dropped because their pod name is not host:port, [v6]:port or dns-name:port of printable ASCII, at most 253 bytes, or their model name is over 512 bytes.", func(s *Stats) *uint64 { return &s.BadTopic }, nil, cBadTopic},
	{"sender_mismatch", "Messages dropped because their sender may not publish for the pod they name (bind mode).", func(s *Stats) *uint64 { return &s.SenderMismatch }, nil, cSenderMismatch},
	{"sender_holders", "Messages dropped because they would make a holder past the bound of holders per sender.", func(s *Stats) *uint64 { return &s.SenderHolders }, nil, cSenderHolders},
	{"conflicts", "Holders put in state conflict: two interleaved sequence streams under one name.", func(s *Stats) *uint64 { return &s.Conflicts },
		func(h *HolderStatus) *uint64 { return &h.Conflicts }, cConflicts},
	{"conflict_dropped", "Messages of holders in state conflict, dropped.", func(s *Stats) *uint64 { return &s.ConflictDropped }, nil, cConflictDropped},
	{"disconnects", "Pods whose connection went down.", func(s *Stats) *uint64 { return &s.Disconnects }, nil, cDisconnects},
	{"snapshot_expired", "Holders restored from a snapshot and never heard from, removed after Config.SnapshotExpiry.", func(s *Stats) *uint64 { return &s.SnapshotExpired }, nil, cExpired},
	{"heartbeats", "Empty batches repeating the last applied sequence number: liveness, not a restart.", func(s *Stats) *uint64 { return &s.Heartbeats }, nil, cHeartbeats},
}

// MarshalJSON renders a holder's status with its counters named as in
// Counters, in the table's order.
func (s HolderStatus) MarshalJSON() ([]byte, error) {
	b, err := json.Marshal(struct {
		Pod     string `json:"pod"`
		Model   string `json:"model"`
		Rank    int    `json:"dp_rank"`
		LastSeq uint64 `json:"last_seq"`
		State   string `json:"state"`
	}{s.Pod, s.Model, s.Rank, s.LastSeq, s.State})
	if err != nil {
		return nil, err
	}
	b = b[:len(b)-1]
	for _, c := range Counters {
		if c.Holder != nil {
			b = append(b, ',')
			b = strconv.AppendQuote(b, c.Name)
			b = append(b, ':')
			b = strconv.AppendUint(b, *c.Holder(&s), 10)
		}
	}
	return append(b, '}'), nil
}
