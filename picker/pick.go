package picker

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/transfer"
)

// Reason explains a Decision.
type Reason string

// The reasons of a decision, checked in this order.
const (
	// ReasonNoHolder: the destination holds no block of the prompt and no
	// allowed holder can serve block 0 from a pullable tier, or the prompt
	// has no full block. Everything is computed.
	ReasonNoHolder Reason = "no_holder"
	// ReasonUnknownModel is ReasonNoHolder for a model the index knows no
	// holder of while it knows holders of other models: most likely a
	// misspelled model name, or one whose engines publish no events.
	// Everything is computed. An index that holds nothing yet (a cold
	// start) cannot tell and answers ReasonNoHolder.
	ReasonUnknownModel Reason = "unknown_model"
	// ReasonLocalHit: the destination holds every full block of the prompt
	// in some tier. Nothing is missing.
	ReasonLocalHit Reason = "local_hit"
	// ReasonSelf: the destination holds a prefix and no allowed holder can
	// serve the block after it from a pullable tier: the destination's own
	// cache is the best source there is.
	ReasonSelf Reason = "self"
	// ReasonBelowThreshold: some holder could extend the destination's
	// prefix, but not by the minimum cached-token delta (or, with a cost
	// model, not with a large enough predicted saving). Decision.Best
	// says by how much it could have.
	ReasonBelowThreshold Reason = "below_threshold"
	// ReasonPull: the destination should pull Decision.Missing from
	// Decision.Source.
	ReasonPull Reason = "pull"
	// ReasonNoLiveSource: some holder could extend the destination's
	// prefix, but none may serve a pull now (Config.Sources);
	// Decision.Skipped says how many and why.
	ReasonNoLiveSource Reason = "no_live_source"
)

// HeaderKVCacheSource is the header by which llm-d's router names the peer a
// pod's routing sidecar pulls from.
const HeaderKVCacheSource = "x-kv-cache-source-host-port"

// Decision is the answer of Pick.
type Decision struct {
	Destination index.Holder
	// Source is the holder to pull from; the zero Holder unless Reason is
	// ReasonPull.
	Source index.Holder
	Reason Reason
	// Blocks is the number of full blocks of the prompt.
	Blocks int
	// Cached is the destination's consecutive prefix in any tier, in blocks.
	Cached int
	// Gain is the number of blocks pulled from Source, right after Cached.
	Gain int
	// Best is the longest pullable run any allowed holder other than the
	// destination offers right after Cached, pulled or not.
	Best int
	// Recompute is the number of full blocks left to compute after the pull:
	// Blocks - Cached - Gain. The prompt's trailing partial block is always
	// computed and not counted.
	Recompute int
	// Missing are the event keys of the blocks to pull, in prompt order:
	// keys[Cached:Cached+Gain]. TransferKeys turns them into the keys a
	// transfer.Session takes.
	Missing []uint64
	// BlockSize is the number of tokens per block.
	BlockSize int
	// SavingMillis is the predicted saving of the pull, when the picker has
	// a cost model.
	SavingMillis float64
	// Skipped counts the holders that could have extended the prefix but
	// were no source now (Config.Sources), once per tier the index lists
	// them in; SkippedState is the state of
	// the one offering the longest run, SkippedBest that run in blocks.
	// A pull may still have been decided from another holder.
	Skipped      int
	SkippedState string
	SkippedBest  int

	p2pPort int
	pull    *pull
}

// pull is a pull decision's claim on its source's in-flight count. Copies of
// the Decision share it, so that the claim is released once however many
// copies are marked done. It is an allocation of its own, not a word past
// the end of Missing's: a caller that keeps a decision for Done and clears
// Missing (service's kept pulls) would otherwise keep every missing key
// alive through the claim, 512 KiB for a pull of a million tokens.
type pull struct {
	load     *holderLoad
	epoch    uint64
	released atomic.Bool
	// fleet, when the picker shares pulls with other replicas, hears of
	// the release too.
	fleet Fleet
	token uint64
}

// Done tells the picker the pull has finished (or failed), so its source no
// longer counts it as in flight. Pulls never marked done expire after the
// picker's InflightTTL. Done on a decision without a pull does nothing. A
// pull is released once: Done again, on the decision or on any copy of it,
// does nothing, so a caller that keeps a copy (say, by request id) and
// also defers Done on the original cannot release a pull that is still in
// flight.
func (d *Decision) Done() {
	if d.pull != nil && d.pull.released.CompareAndSwap(false, true) {
		d.pull.load.release(d.pull.epoch)
		if d.pull.fleet != nil {
			d.pull.fleet.Ended(d.pull.token)
		}
	}
}

// TransferKeys returns the keys a transfer.Session looks up and fetches for
// the pull, in prompt order: the full digests of blocks[Cached:Cached+Gain]
// in KV-cache group g (0 for a model with one KV-cache group). blocks are
// the prompt's blocks as hashing.Hasher.Blocks returns them. A vLLM peer
// names a block by its full digest, of which Missing holds only the 64-bit
// event form, so the keys come from the blocks. TransferKeys returns nil
// when nothing is pulled, and an error wrapping ErrBlocks when blocks are
// not the prompt's the decision was made for (fewer than Cached+Gain, or a
// block whose key is not the decision's). An offload tier that stores
// several blocks per chunk names chunks instead: see transfer.OffloadKeys.
func (d *Decision) TransferKeys(blocks []hashing.Block, g uint32) ([]transfer.Key, error) {
	if d.Reason != ReasonPull {
		return nil, nil
	}
	end := d.Cached + d.Gain
	if len(blocks) < end {
		return nil, fmt.Errorf("%w: %d blocks, the pull needs %d", ErrBlocks, len(blocks), end)
	}
	keys := make([]transfer.Key, d.Gain)
	for i, b := range blocks[d.Cached:end] {
		if b.Key != d.Missing[i] {
			return nil, fmt.Errorf("%w: block %d has key %d, the decision's is %d", ErrBlocks, d.Cached+i, b.Key, d.Missing[i])
		}
		keys[i] = transfer.NewKey(b.Digest.Bytes(), g)
	}
	return keys, nil
}

// Header returns llm-d's source header for the decision: its name and the
// address of the source's serving endpoint, as llm-d's router sets it. Both
// are empty when nothing is pulled. llm-d's sidecar serves data-parallel rank
// r on its base serving port plus r, and reads the source's rank back from
// the header's port (rank = port - base). So a source of rank 0 is named by
// its pod address as is, and a source of rank r > 0 by the pod's host with r
// added to the pod's port ("10.0.0.2:8003" for "10.0.0.2:8000" rank 3,
// "[fd00::2]:8002" for "[fd00::2]:8000" rank 2). A pod address without a
// numeric port cannot carry a rank: the value is then the pod address, which
// the sidecar takes for rank 0, and only KVTransferParams reaches the source.
func (d *Decision) Header() (name, value string) {
	if d.Reason != ReasonPull {
		return "", ""
	}
	return HeaderKVCacheSource, rankAddress(d.Source)
}

// rankAddress returns the serving address of h: its pod address with h's
// rank added to the port.
func rankAddress(h index.Holder) string {
	if h.Rank <= 0 {
		return h.Pod
	}
	host, port, ok := podHostPort(h.Pod)
	if !ok || port > 65535-h.Rank {
		return h.Pod
	}
	return joinHostPort(host, port+h.Rank)
}

// joinHostPort returns "host:port", with an IPv6 host in brackets.
func joinHostPort(host string, port int) string {
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	return host + ":" + strconv.Itoa(port)
}

// podHostPort splits a pod address "host:port" or "[v6]:port" into its host
// and numeric port; ok is false when it has no such port.
func podHostPort(pod string) (host string, port int, ok bool) {
	var p string
	if strings.HasPrefix(pod, "[") {
		i := strings.Index(pod, "]:")
		if i < 0 {
			return "", 0, false
		}
		host, p = pod[1:i], pod[i+2:]
	} else {
		i := strings.LastIndexByte(pod, ':')
		if i < 0 || strings.IndexByte(pod, ':') != i {
			return "", 0, false
		}
		host, p = pod[:i], pod[i+1:]
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 0 || n > 65535 || p[0] == '+' {
		return "", 0, false
	}
	return host, n, true
}

// RemoteKVSource is the object vLLM's P2P offload tier reads from a request's
// kv_transfer_params["remote_kv_source"].
type RemoteKVSource struct {
	KVRequestID string `json:"kv_request_id"`
	RemoteHost  string `json:"remote_host"`
	RemotePort  int    `json:"remote_port"`
}

// KVTransferParams is the part of a request's kv_transfer_params that names
// the source of a pull.
type KVTransferParams struct {
	RemoteKVSource *RemoteKVSource `json:"remote_kv_source,omitempty"`
}

// KVTransferParams returns the kv_transfer_params that make the destination
// pull from the source directly: the source pod's host and its P2P port (the
// picker's P2PPort plus the source's data-parallel rank), under the transfer
// id kvRequestID. RemoteKVSource is nil when nothing is pulled.
func (d *Decision) KVTransferParams(kvRequestID string) KVTransferParams {
	if d.Reason != ReasonPull {
		return KVTransferParams{}
	}
	return KVTransferParams{RemoteKVSource: &RemoteKVSource{
		KVRequestID: kvRequestID,
		RemoteHost:  podHost(d.Source.Pod),
		RemotePort:  d.p2pPort + d.Source.Rank,
	}}
}

// P2PAddress returns the source's P2P control address, "host:port", or ""
// when nothing is pulled.
func (d *Decision) P2PAddress() string {
	src := d.KVTransferParams("").RemoteKVSource
	if src == nil {
		return ""
	}
	return joinHostPort(src.RemoteHost, src.RemotePort)
}

// nonNegative returns x, or 0 when x is negative or NaN.
func nonNegative(x float64) float64 {
	if x > 0 {
		return x
	}
	return 0
}

// podHost returns the host of a pod address "host:port", "[v6]:port" or
// bare "host". It avoids package net, whose resolver would bring cgo in.
func podHost(pod string) string {
	if strings.HasPrefix(pod, "[") {
		if i := strings.IndexByte(pod, ']'); i > 0 {
			return pod[1:i]
		}
		return pod
	}
	if i := strings.LastIndexByte(pod, ':'); i >= 0 && strings.IndexByte(pod, ':') == i {
		return pod[:i]
	}
	return pod
}

// Pick decides whether req's destination should pull a prefix from a peer,
// from which, and which blocks.
//
// The destination's local prefix L is its consecutive run of the prompt's
// blocks in any tier. Every other allowed holder's gain is its consecutive
// run from block L in the pullable tiers. Holders whose gain is within one
// block of the best and reaches the threshold are eligible; one is drawn with
// weight 1/(1 + waiting + load + pulls this picker directed to it that are
// still in flight). A pull counts as in flight until Decision.Done or the
// TTL.
//
// Pick allocates only the decision's Missing keys and, for a pull, its claim
// on the source.
func (p *Picker) Pick(req Request) (Decision, error) {
	return p.PickContext(context.Background(), req)
}

// PickContext is Pick that stops when ctx is done: between blocks while
// hashing the prompt, before the lookup and between the holders it
// weighs, returning an error that wraps ctx's and no decision.
func (p *Picker) PickContext(ctx context.Context, req Request) (Decision, error) {
	if req.Destination.Pod == "" {
		return Decision{}, ErrNoDestination
	}
	s := p.getScratch()
	defer p.putScratch(s)
	keys, err := p.keys(ctx, &req, s)
	if err != nil {
		return Decision{}, err
	}
	done := ctx.Done()
	if err := stopped(ctx, done, "before the lookup"); err != nil {
		return Decision{}, err
	}
	d := Decision{Destination: req.Destination, Blocks: len(keys), BlockSize: p.blockSize, p2pPort: p.p2pPort}
	if len(keys) == 0 {
		d.Reason = ReasonNoHolder
		return d, nil
	}
	l := p.idx.Run(req.Model, req.Destination, keys, 0, nil)
	d.Cached = l
	d.Recompute = len(keys) - l
	if l == len(keys) {
		d.Reason = ReasonLocalHit
		return d, nil
	}

	if p.holdersAt != nil {
		s.hold = p.holdersAt.HoldersAt(req.Model, keys, l, s.hold)
	} else {
		s.hold = p.idx.Holders(req.Model, keys[l], s.hold)
	}
	for _, h := range s.hold {
		if h == req.Destination {
			continue
		}
		if err := stopped(ctx, done, "weighing sources"); err != nil {
			return Decision{}, err
		}
		c, ok := candidate(req.Candidates, h)
		if !ok {
			continue
		}
		g := p.idx.Run(req.Model, h, keys, l, p.pullTiers)
		if g == 0 {
			continue
		}
		if p.sources != nil {
			if state, ok := p.sources(h); !ok {
				d.Skipped++
				if g > d.SkippedBest {
					d.SkippedBest, d.SkippedState = g, state
				}
				continue
			}
		}
		s.cands = append(s.cands, cand{h: h, gain: g, weight: 1 + float64(max(c.Waiting, 0)) + nonNegative(c.Load)})
		d.Best = max(d.Best, g)
	}
	if d.Best == 0 {
		d.Reason = ReasonSelf
		if d.Skipped > 0 {
			d.Reason = ReasonNoLiveSource
		} else if l == 0 {
			d.Reason = p.noHolder(req.Model, len(s.hold) == 0, s)
		}
		return d, nil
	}

	threshold := p.minDelta
	if req.MinCachedTokenDelta > 0 {
		threshold = req.MinCachedTokenDelta
	}
	// Ceiling division without threshold+blockSize-1, which overflows for
	// Calibration.Threshold's math.MaxInt ("never pull").
	minGain := threshold / p.blockSize
	if threshold%p.blockSize != 0 {
		minGain++
	}
	floor := max(d.Best-1, minGain)
	band := s.cands[:0]
	for _, c := range s.cands {
		if c.gain < floor {
			continue
		}
		if p.cost != nil {
			c.saving = p.cost.Saving(l*p.blockSize, c.gain*p.blockSize)
			if c.saving <= p.minSaving {
				continue
			}
		}
		band = append(band, c)
	}
	// A fixed order makes the draw depend on the request alone, not on the
	// order the index lists holders in.
	slices.SortFunc(band, func(a, b cand) int { return a.h.Compare(b.h) })
	now := p.epoch()
	var total float64
	n := 0
	for i, c := range band {
		// An index may list a holder once per tier; count it once.
		if i > 0 && c.h == band[n-1].h {
			continue
		}
		c.slot = p.inflight.get(c.h)
		if c.slot != nil {
			c.weight += float64(c.slot.count(now))
		}
		if p.fleet != nil {
			c.weight += float64(p.fleet.Inflight(c.h))
		}
		c.weight = 1 / c.weight
		total += c.weight
		band[n] = c
		n++
	}
	band = band[:n]
	if len(band) == 0 {
		d.Reason = ReasonBelowThreshold
		return d, nil
	}

	target := p.draw(&req) * total
	chosen := band[len(band)-1]
	for _, c := range band {
		if target < c.weight {
			chosen = c
			break
		}
		target -= c.weight
	}
	if chosen.slot == nil {
		chosen.slot = p.inflight.getOrCreate(chosen.h)
	}
	chosen.slot.add(now)
	d.Reason = ReasonPull
	d.Source = chosen.h
	d.Gain = chosen.gain
	d.Recompute -= chosen.gain
	d.SavingMillis = chosen.saving
	d.Missing = slices.Clone(keys[l : l+chosen.gain])
	d.pull = &pull{load: chosen.slot, epoch: now}
	if p.fleet != nil {
		d.pull.fleet, d.pull.token = p.fleet, p.fleet.Started(chosen.h)
	}
	return d, nil
}
