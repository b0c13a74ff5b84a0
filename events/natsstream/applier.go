package natsstream

// This file is the temporary bridge to the events state machine: today's
// package events runs its per-holder sequencing only inside its ZMQ
// Subscriber, so a replica applies stream batches with this copy of its
// rules (first batch, next, gap, restart; GapClear) and of its Sink calls.
// It goes when the transport-independent events core lands, which a
// replica then drives instead.

import (
	"log/slog"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/index"
)

// applier applies a replica's stream batches, in stream order, to a Sink
// with the rules an events.Subscriber applies engine messages with, so
// that a replica's index equals a subscriber's fed the same batches. One
// goroutine calls it.
type applier struct {
	sink    events.Sink
	dec     *events.Decoder
	batch   events.Batch
	holders map[index.Holder]*seqState
	log     *slog.Logger

	batches, gaps, restarts, decodeErrors, rankMismatch uint64
}

type seqState struct {
	next  uint64 // sequence number expected next
	model string
}

func newApplier(sink events.Sink, initial map[index.Holder]uint64, log *slog.Logger) *applier {
	a := &applier{sink: sink, dec: events.NewDecoder(), holders: map[index.Holder]*seqState{}, log: log}
	for h, seq := range initial {
		a.holders[h] = &seqState{next: seq + 1}
	}
	return a
}

// apply applies one batch; an undecodable payload is counted, logged and
// dropped, as a subscriber does.
func (a *applier) apply(b Batch) {
	if err := a.dec.Decode(b.Payload, &a.batch); err != nil {
		a.decodeErrors++
		a.log.Warn("natsstream: dropped malformed payload", "pod", b.Pod, "rank", b.Rank, "seq", b.Seq, "err", err)
		return
	}
	if a.batch.DPRank != b.Rank {
		a.rankMismatch++
	}
	id := index.Holder{Pod: b.Pod, Rank: a.batch.DPRank}
	h := a.holders[id]
	switch {
	case h == nil:
		h = &seqState{}
		a.holders[id] = h
	case b.Seq == h.next:
	case b.Seq > h.next:
		// The relay could not repair it from the engine's replay either.
		a.gaps++
		a.sink.ClearHolder(b.Model, id, "")
	default:
		a.restarts++
		a.sink.ClearHolder(h.modelOr(b.Model), id, "")
	}
	h.model = b.Model
	h.next = b.Seq + 1
	a.batches++
	for i := range a.batch.Events {
		e := &a.batch.Events[i]
		switch e.Type {
		case events.EventBlockStored:
			switch {
			case len(e.BlockHashes) == 0:
			case len(e.TokenIDs) > len(e.BlockHashes)*e.BlockSize:
				for j := range e.BlockHashes {
					a.sink.Store(b.Model, id, e.Medium, e.GroupIdx, 0, false, e.BlockHashes[j:j+1])
				}
			default:
				a.sink.Store(b.Model, id, e.Medium, e.GroupIdx, e.Parent, e.HasParent, e.BlockHashes)
			}
		case events.EventBlockRemoved:
			if len(e.BlockHashes) > 0 {
				a.sink.Remove(b.Model, id, e.Medium, e.GroupIdx, e.BlockHashes)
			}
		case events.EventAllBlocksCleared:
			a.sink.ClearHolder(b.Model, id, "")
		}
	}
}

func (s *seqState) modelOr(m string) string {
	if s.model != "" {
		return s.model
	}
	return m
}

// seqs returns the last sequence number applied per holder, what a
// snapshot records.
func (a *applier) seqs() map[index.Holder]uint64 {
	out := make(map[index.Holder]uint64, len(a.holders))
	for h, s := range a.holders {
		if s.next > 0 {
			out[h] = s.next - 1
		}
	}
	return out
}
