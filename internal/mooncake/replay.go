package mooncake

import "math/bits"

// Entry is one step of a worker's benchmark timeline: a prompt to match or
// an event to apply, exactly one of them set.
type Entry struct {
	TimestampUS uint64
	Request     *Request
	Event       *Event
}

// Timeline is mooncake_bench's prepare_worker_traces for one worker: its
// requests and events merged in time order (a request before an event of
// the same time, as the stable sort of requests-then-events puts it), the
// times then stretched so that the last entry lands at windowMS
// (rescale_trace_timestamps: t × window / t_last, in whole microseconds).
func (w *Worker) Timeline(windowMS uint64) []Entry {
	out := make([]Entry, 0, len(w.Requests)+len(w.Events))
	i, j := 0, 0
	for i < len(w.Requests) || j < len(w.Events) {
		if j == len(w.Events) || (i < len(w.Requests) && w.Requests[i].TimestampUS <= w.Events[j].TimestampUS) {
			out = append(out, Entry{TimestampUS: w.Requests[i].TimestampUS, Request: &w.Requests[i]})
			i++
		} else {
			out = append(out, Entry{TimestampUS: w.Events[j].TimestampUS, Event: &w.Events[j]})
			j++
		}
	}
	if len(out) == 0 {
		return out
	}
	last := max(out[len(out)-1].TimestampUS, 1)
	target := windowMS * 1000
	for k := range out {
		hi, lo := bits.Mul64(out[k].TimestampUS, target)
		if hi >= last { // past 2^64 µs: Rust's u64 would overflow first
			out[k].TimestampUS = ^uint64(0)
			continue
		}
		out[k].TimestampUS, _ = bits.Div64(hi, lo, last)
	}
	return out
}

// Totals counts what the benchmark counts, for one replica of the workers.
type Totals struct {
	Requests      int // find_matches calls
	RequestBlocks int // their keys
	PrefillStored int // Stored events of prompts
	DecodeStored  int // Stored events of blocks filled while generating
	Removed       int // Removed events
	StoredBlocks  int // blocks of the Stored events
}

// Count adds up the workers' requests and events.
func Count(workers []Worker) Totals {
	var t Totals
	for _, w := range workers {
		t.Requests += len(w.Requests)
		for _, r := range w.Requests {
			t.RequestBlocks += len(r.Keys)
		}
		for _, ev := range w.Events {
			switch {
			case ev.Kind == EventRemoved:
				t.Removed++
			case ev.Decode:
				t.DecodeStored++
			default:
				t.PrefillStored++
			}
			if ev.Kind == EventStored {
				t.StoredBlocks += len(ev.Keys)
			}
		}
	}
	return t
}

// Events is the events of all kinds.
func (t Totals) Events() int { return t.PrefillStored + t.DecodeStored + t.Removed }

// Ops is the benchmark's operations: requests and events (it counts every
// event kind as one, as it does for indexers that support removal).
func (t Totals) Ops() int { return t.Requests + t.Events() }

// Blocks is the benchmark's block operations: the requests' keys and the
// Stored events' blocks (a Removed event counts none).
func (t Totals) Blocks() int { return t.RequestBlocks + t.StoredBlocks }
