package kvhints

import (
	"errors"
	"fmt"

	"github.com/kvsource/kvsource/picker"
)

// Reason says whether a decision got a hint and, when not, why.
type Reason string

// The reasons, checked in this order.
const (
	// ReasonNoPull: the picker decided no pull (Decision.Reason is not
	// picker.ReasonPull): its cost, load, liveness, tier and in-flight
	// rules are the hint's.
	ReasonNoPull Reason = "no_pull"
	// ReasonContentKeys: the index holds kvsource content keys, not the
	// engines' block hashes, so it has no hashes KVCR knows.
	ReasonContentKeys Reason = "content_keys"
	// ReasonDestinationNotKVCR: the destination has no KVCR endpoint, so
	// it is not known to run the KVCR tier, nor its worker type.
	ReasonDestinationNotKVCR Reason = "destination_not_kvcr"
	// ReasonDecodeLeg: the destination is a decode worker; a hint goes to
	// the leg that computes the prefix.
	ReasonDecodeLeg Reason = "decode_leg"
	// ReasonSameHolder: the source is the destination.
	ReasonSameHolder Reason = "same_holder"
	// ReasonNoSourceEndpoint: the source has no KVCR endpoint.
	ReasonNoSourceEndpoint Reason = "no_source_endpoint"
	// ReasonWorkerType: the source's worker type is not the
	// destination's.
	ReasonWorkerType Reason = "worker_type"
	// ReasonNotLonger: the source's prefix is not strictly longer than the
	// destination's.
	ReasonNotLonger Reason = "not_longer"
	// ReasonHinted: the decision has a hint.
	ReasonHinted Reason = "hinted"
)

// Config configures a Hinter.
type Config struct {
	// Endpoints are the fleet's KVCR control endpoints; a holder without
	// one is neither a hint source nor a hint destination.
	Endpoints *Endpoints
	// ContentKeys says the index is keyed by kvsource content keys
	// (hashing.Content): no decision then gets a hint.
	ContentKeys bool
}

// Hinter turns the picker's pull decisions into KV hints. It is safe for
// concurrent use once its Endpoints are filled.
type Hinter struct {
	eps     *Endpoints
	content bool
}

// New returns a Hinter for cfg.
func New(cfg Config) *Hinter {
	eps := cfg.Endpoints
	if eps == nil {
		eps = &Endpoints{}
	}
	return &Hinter{eps: eps, content: cfg.ContentKeys}
}

// ErrKeys reports keys given to Hint that are not the prompt's the
// decision was made for.
var ErrKeys = errors.New("kvhints: keys do not match the decision")

// Hint returns the hint for d, whose prompt's block keys, from block 0, are
// keys (the Request.Keys the decision was picked with, or the picker's
// Hasher's BlockKeys of its prompt), under messageID (the request id).
//
// There is a hint only where the picker decided a pull, and only when the
// spec's eligibility rules hold too: the destination and the source have
// KVCR endpoints and the same worker type, the destination is no decode
// worker, the source is not the destination and its prefix (Cached+Gain
// blocks) is strictly longer than the destination's (Cached). Otherwise
// the hint is zero and the reason says why. The hint's BlockHashes are
// keys[:Cached+Gain], root-aligned as KVCR reads them (it looks up only
// the blocks its engine lacks, by membership), and alias keys.
//
// An error wraps ErrKeys when keys are not d's prompt's, or ErrInvalid
// when messageID is empty.
func (h *Hinter) Hint(d *picker.Decision, keys []uint64, messageID string) (Hint, Reason, error) {
	if d.Reason != picker.ReasonPull {
		return Hint{}, ReasonNoPull, nil
	}
	if h.content {
		return Hint{}, ReasonContentKeys, nil
	}
	dst, ok := h.eps.Lookup(d.Destination)
	if !ok {
		return Hint{}, ReasonDestinationNotKVCR, nil
	}
	if dst.WorkerType == Decode {
		return Hint{}, ReasonDecodeLeg, nil
	}
	if d.Source == d.Destination {
		return Hint{}, ReasonSameHolder, nil
	}
	src, ok := h.eps.Lookup(d.Source)
	if !ok {
		return Hint{}, ReasonNoSourceEndpoint, nil
	}
	if src.WorkerType != dst.WorkerType {
		return Hint{}, ReasonWorkerType, nil
	}
	if d.Gain <= 0 || d.Cached < 0 {
		return Hint{}, ReasonNotLonger, nil
	}
	end := d.Cached + d.Gain
	if len(keys) < end || len(d.Missing) != d.Gain {
		return Hint{}, "", fmt.Errorf("%w: %d keys, the pull needs %d", ErrKeys, len(keys), end)
	}
	for i, k := range d.Missing {
		if keys[d.Cached+i] != k {
			return Hint{}, "", fmt.Errorf("%w: block %d has key %d, the decision's is %d", ErrKeys, d.Cached+i, keys[d.Cached+i], k)
		}
	}
	hint := Hint{MessageID: messageID, SourceControlEndpoint: src.Address, BlockHashes: keys[:end:end]}
	if err := hint.Check(); err != nil {
		return Hint{}, "", err
	}
	return hint, ReasonHinted, nil
}
