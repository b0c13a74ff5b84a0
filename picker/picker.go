package picker

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

// Index is the part of an index the picker reads; *index.Index implements it.
type Index interface {
	// Lookup fills res with one hit per holder whose consecutive prefix of
	// keys is non-empty.
	Lookup(model string, keys []uint64, res *index.Result)
	// Run returns the length of the consecutive run keys[start:] that h
	// holds, counting a block when any of tiers holds it (nil: any tier).
	Run(model string, h index.Holder, keys []uint64, start int, tiers []string) int
	// Holders appends to dst[:0] every holder of key, in any tier.
	Holders(model string, key uint64, dst []index.Holder) []index.Holder
	// Models appends to dst[:0] the models the index knows holders of.
	// The picker calls it only for a prompt no holder has a block of, to
	// tell an unknown model from a cold prompt.
	Models(dst []string) []string
}

// Errors callers may branch on.
var (
	// ErrNoIndex reports a Config without an Index.
	ErrNoIndex = errors.New("picker: no index")
	// ErrNoKeys reports a request with neither keys nor a hasher to compute
	// them from its prompt.
	ErrNoKeys = errors.New("picker: request has no keys and the picker no hasher")
	// ErrNoDestination reports a Pick without a destination.
	ErrNoDestination = errors.New("picker: no destination")
	// ErrHash reports a prompt the hasher rejected.
	ErrHash = errors.New("picker: hashing the prompt")
	// ErrUnknownModel reports a Score for a model the index knows no
	// holder of while it knows holders of other models; Pick answers such
	// a request with ReasonUnknownModel.
	ErrUnknownModel = errors.New("picker: unknown model")
	// ErrBlocks reports blocks given to Decision.TransferKeys that are not
	// the prompt's the decision was made for.
	ErrBlocks = errors.New("picker: blocks do not match the decision")
)

// Defaults of Config.
const (
	DefaultBlockSize           = hashing.DefaultBlockSize
	DefaultMinCachedTokenDelta = 1
	DefaultInflightTTL         = 30 * time.Second
	// DefaultP2PPort is vLLM's VLLM_P2P_SIDE_CHANNEL_PORT default. Data
	// parallel rank r listens on the base port plus r. llm-d's routing
	// sidecar defaults its --p2p-connector-port to 7777 instead; deployments
	// that use it set VLLM_P2P_SIDE_CHANNEL_PORT=7777 on the engines and
	// Config.P2PPort to match.
	DefaultP2PPort = 5710
)

// Config configures a Picker. Only Index is required.
type Config struct {
	// Index is where the picker reads which holder has which block.
	Index Index
	// Hasher computes a request's block keys from its prompt when the
	// request carries none. Nil: requests must carry keys.
	Hasher *hashing.Hasher
	// HashCache, when set, remembers recently hashed prompts so that a
	// prompt whose leading blocks were hashed recently (the next turn of a
	// conversation, a forked agent) is hashed only past them; the keys are
	// the Hasher's all the same. It may be shared with other pickers and
	// Hashers. Nil: every prompt is hashed in full.
	HashCache *hashing.Cache
	// BlockSize is the number of tokens per block, used to express gains in
	// tokens. Default: the Hasher's block size, else DefaultBlockSize.
	BlockSize int
	// Weights are the per-tier weights of Score. Default: GPU 1.0, CPU 0.8,
	// and speculative 1.0 (index.TierSpeculative: blocks a request just
	// routed there is computing into the GPU).
	// A tier without a weight counts as the lowest weight given.
	Weights map[string]float64
	// PullTiers are the tiers a source can serve a pull from. Default: CPU
	// only (index.TierCPU), since vLLM producers serve P2P pulls from the
	// CPU offload tier: a holder with a prefix on GPU alone is no source.
	// A transport that reads GPU memory directly (NIXL) sets
	// []string{index.TierGPU, index.TierCPU}.
	PullTiers []string
	// MinCachedTokenDelta is the smallest gain, in tokens, worth a pull.
	// Default DefaultMinCachedTokenDelta, llm-d's default: any full block.
	MinCachedTokenDelta int
	// Cost, when set, also requires a pull's predicted saving to exceed
	// MinSavingMillis, so each request is decided by its own length and
	// the destination's cached prefix rather than by a fixed threshold
	// alone. Fit returns one from measurements.
	Cost *Model
	// MinSavingMillis is the smallest predicted saving worth a pull when
	// Cost is set. Default 0: any positive saving.
	MinSavingMillis float64
	// InflightTTL is how long a pull counts against its source when the
	// caller never calls Decision.Done. Default DefaultInflightTTL, vLLM's
	// consumer load timeout. Expiry is accurate to an eighth of the TTL.
	InflightTTL time.Duration
	// P2PPort is the base P2P port of the engines, used by
	// Decision.KVTransferParams. Default DefaultP2PPort.
	P2PPort int
	// Now is the clock in-flight pulls expire by. Default time.Now.
	Now func() time.Time
	// Fleet, when set, shares in-flight pulls with the pickers of other
	// router replicas, so that a source's load counts every replica's
	// pulls and not only this picker's. Nil: this picker's alone.
	Fleet Fleet
	// Sources, when set, says whether a holder may serve a pull now and,
	// when it may not, its state ("stale", "disconnected", "reconnected",
	// "conflict"), which a decision that skipped it reports
	// (Decision.Skipped). A router feeding its index from events sets it
	// to events.Processor.Source, so that only holders heard from since it
	// started, with their connection up and a message applied since it
	// last came up (a restarted engine has not the blocks), are pulled
	// from; a holder
	// known only from a snapshot still scores. Nil: every holder may.
	// It is called for each holder that could extend the prefix, so it
	// must be cheap and safe for concurrent use.
	Sources func(h index.Holder) (state string, ok bool)
}

// Fleet shares in-flight pulls among the pickers of several router
// replicas; natsfleet.Pulls implements it over NATS JetStream. Pick calls
// it on its hot path: every method must return at once (publish in the
// background) and be safe for concurrent use.
type Fleet interface {
	// Started records a pull from h that this picker directed; the token
	// it returns is passed to Ended when the pull is done.
	Started(h index.Holder) (token uint64)
	// Ended records that the pull of token is done.
	Ended(token uint64)
	// Inflight returns the pulls from h other pickers have in flight,
	// the ones this picker directed excluded.
	Inflight(h index.Holder) int
}

// Candidate is a holder the router allows as a source, with its load.
type Candidate struct {
	Holder index.Holder
	// Waiting is the holder's queue depth (vLLM's num_requests_waiting).
	Waiting int
	// Load is any further load the caller tracks, in units of waiting
	// requests; it is added to Waiting in the selection weight.
	Load float64
}

// Request is one prompt to score or decide on.
type Request struct {
	// ID identifies the request. Among equally good sources the picker
	// draws one from a hash of ID, so equal IDs get equal decisions under
	// equal state; an empty ID draws from a picker-wide sequence instead.
	ID string
	// Model is the model name as the engines report it in their events.
	Model string
	// Keys are the prompt's block keys. When nil, the picker hashes Prompt
	// with its Hasher.
	Keys []uint64
	// Prompt is the prompt to hash when Keys is nil.
	Prompt hashing.Request
	// Destination is the holder the router chose to compute the prefill
	// (Pick only). In a prefill/decode split it is the prefill pod.
	Destination index.Holder
	// Candidates, when non-empty, restricts the holders considered (as
	// sources for Pick, as entries for Score) and carries their load.
	// Empty: every holder the index knows, with no load.
	Candidates []Candidate
	// MinCachedTokenDelta overrides Config.MinCachedTokenDelta when > 0.
	MinCachedTokenDelta int
	// Rand, when set, draws the source instead of ID's hash. A *rand.Rand
	// is not safe for concurrent use: give each goroutine its own.
	Rand *rand.Rand
}

// holdersAt is what an index that finds a block's holders from the prompt
// before it implements (*index.Index does): Pick then asks it instead of
// Holders, at a cost that follows the prompt rather than the fleet.
type holdersAt interface {
	HoldersAt(model string, keys []uint64, i int, dst []index.Holder) []index.Holder
}

// Picker scores holders and decides pulls. It is safe for concurrent use.
type Picker struct {
	idx         Index
	holdersAt   holdersAt
	hasher      *hashing.Hasher
	hashCache   *hashing.Cache
	blockSize   int
	weights     []tierWeight
	minWeight   float64
	pullTiers   []string
	minDelta    int
	cost        *Model
	minSaving   float64
	p2pPort     int
	sources     func(index.Holder) (string, bool)
	now         func() time.Time
	fleet       Fleet
	gran        int64 // in-flight bucket width, ns
	inflight    inflight
	seq         atomic.Uint64
	scratchPool sync.Pool
}

type tierWeight struct {
	tier   string
	weight float64
}

// scratch is the per-call working memory, pooled so that a steady-state
// call allocates only the decision's missing keys and its pull's claim.
type scratch struct {
	keys   []uint64
	models []string
	res    index.Result
	hold   []index.Holder
	cands  []cand
}

type cand struct {
	h      index.Holder
	gain   int
	weight float64
	saving float64
	slot   *holderLoad
}

// New returns a Picker for cfg.
func New(cfg Config) (*Picker, error) {
	if cfg.Index == nil {
		return nil, ErrNoIndex
	}
	p := &Picker{idx: cfg.Index, hasher: cfg.Hasher, hashCache: cfg.HashCache, cost: cfg.Cost, minSaving: cfg.MinSavingMillis, sources: cfg.Sources}
	p.holdersAt, _ = cfg.Index.(holdersAt)
	p.blockSize = cfg.BlockSize
	if p.blockSize <= 0 {
		p.blockSize = DefaultBlockSize
		if cfg.Hasher != nil {
			p.blockSize = cfg.Hasher.Config().BlockSize
		}
	}
	if cfg.Hasher != nil && cfg.Hasher.Config().BlockSize != p.blockSize {
		return nil, fmt.Errorf("picker: block size %d differs from the hasher's %d", p.blockSize, cfg.Hasher.Config().BlockSize)
	}
	w := cfg.Weights
	if len(w) == 0 {
		w = map[string]float64{index.TierGPU: 1.0, index.TierCPU: 0.8, index.TierSpeculative: 1.0}
	}
	p.minWeight = -1
	for t, v := range w {
		if v < 0 {
			return nil, fmt.Errorf("picker: negative weight %v for tier %q", v, t)
		}
		p.weights = append(p.weights, tierWeight{t, v})
		if p.minWeight < 0 || v < p.minWeight {
			p.minWeight = v
		}
	}
	slices.SortFunc(p.weights, func(a, b tierWeight) int { return strings.Compare(a.tier, b.tier) })
	p.pullTiers = slices.Clone(cfg.PullTiers)
	if len(p.pullTiers) == 0 {
		p.pullTiers = []string{index.TierCPU}
	}
	p.minDelta = cfg.MinCachedTokenDelta
	if p.minDelta <= 0 {
		p.minDelta = DefaultMinCachedTokenDelta
	}
	p.p2pPort = cfg.P2PPort
	if p.p2pPort <= 0 {
		p.p2pPort = DefaultP2PPort
	}
	p.now = cfg.Now
	p.fleet = cfg.Fleet
	if p.now == nil {
		p.now = time.Now
	}
	ttl := cfg.InflightTTL
	if ttl <= 0 {
		ttl = DefaultInflightTTL
	}
	p.gran = max(int64(ttl)/inflightBuckets, 1)
	p.inflight.init()
	p.scratchPool.New = func() any { return new(scratch) }
	return p, nil
}

// BlockSize returns the number of tokens per block the picker counts with.
func (p *Picker) BlockSize() int { return p.blockSize }

// keys returns req's block keys, hashing its prompt into s when needed.
// Hashing stops when ctx is done, with an error wrapping ctx's.
func (p *Picker) keys(ctx context.Context, req *Request, s *scratch) ([]uint64, error) {
	if req.Keys != nil {
		return req.Keys, nil
	}
	if p.hasher == nil {
		return nil, ErrNoKeys
	}
	var err error
	s.keys, err = p.hashCache.BlockKeysContext(ctx, p.hasher, s.keys, req.Prompt)
	switch {
	case errors.Is(err, hashing.ErrStopped):
		return nil, fmt.Errorf("picker: %w", err)
	case err != nil:
		return nil, fmt.Errorf("%w: %w", ErrHash, err)
	}
	return s.keys, nil
}

// stopped returns ctx's error, wrapped, when done is closed; done is
// ctx.Done(), nil for a context that is never done.
func stopped(ctx context.Context, done <-chan struct{}, stage string) error {
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return fmt.Errorf("picker: stopped %s: %w", stage, context.Cause(ctx))
	default:
		return nil
	}
}

// noHolder is the reason for a prompt no allowed holder has a block of:
// ReasonUnknownModel when no holder has any block of the prompt's first
// one (none) and the index knows holders of other models but not of model.
func (p *Picker) noHolder(model string, none bool, s *scratch) Reason {
	if none && p.unknownModel(model, s) {
		return ReasonUnknownModel
	}
	return ReasonNoHolder
}

// unknownModel reports whether the index knows holders of other models but
// none of model.
func (p *Picker) unknownModel(model string, s *scratch) bool {
	s.models = p.idx.Models(s.models)
	return len(s.models) > 0 && !slices.Contains(s.models, model)
}

func (p *Picker) getScratch() *scratch { return p.scratchPool.Get().(*scratch) }

func (p *Picker) putScratch(s *scratch) {
	clear(s.cands)
	s.cands = s.cands[:0]
	p.scratchPool.Put(s)
}

// candidate returns the load entry of h in cs and whether h is allowed.
func candidate(cs []Candidate, h index.Holder) (Candidate, bool) {
	if len(cs) == 0 {
		return Candidate{Holder: h}, true
	}
	for _, c := range cs {
		if c.Holder == h {
			return c, true
		}
	}
	return Candidate{}, false
}

// draw returns a number in [0, 1) for req: from its Rand, its ID's hash, or
// the picker's sequence.
func (p *Picker) draw(req *Request) float64 {
	var v uint64
	switch {
	case req.Rand != nil:
		return req.Rand.Float64()
	case req.ID != "":
		v = xxhash.Sum64String(req.ID)
	default:
		v = splitmix64(p.seq.Add(1))
	}
	return float64(v>>11) / (1 << 53)
}

func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}
