package picker

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvsource/kvsource/index"
)

// Prefetch ahead of arrival.
//
// A router often knows a session's next prompt before it arrives: while an
// agent's tool call runs, the next prompt is this prompt, its answer and the
// tool's result. A Prefetcher decides, by Pick's rule, whether to move the
// known prefix to the pod the next request will probably go to now, during
// the gap, and from which source; it remembers what it started so that the
// same prefix is not moved to the same pod twice for a session, and it counts
// the move against its source like any pull, so Pick's spreading sees it.
//
// With vLLM as it is, a router triggers a prefetch by sending the destination
// a completion of the known prefix that generates a single token and names
// the source in kv_transfer_params (Prefetch.Warmup renders it): vLLM's P2P
// tier pulls the prefix's blocks from the source to serve it, and the blocks
// stay in the destination's prefix cache and CPU tier, where the real
// request finds them as local hits. The router calls Complete when that
// completion returns and Cancel when it fails or is abandoned.

// Defaults of PrefetchConfig.
const (
	// DefaultPrefetchTTL is how long a started prefetch is remembered:
	// vLLM's consumer load timeout, after which a pull has finished or
	// failed, and by when the destination's KV events have told the index
	// about the blocks it received.
	DefaultPrefetchTTL = DefaultInflightTTL
	// DefaultPrefetchMaxEntries bounds the prefetches remembered at once.
	DefaultPrefetchMaxEntries = 1 << 16
)

// Errors of a Prefetcher callers may branch on.
var (
	// ErrNoSession reports a PrefetchRequest without a session.
	ErrNoSession = errors.New("picker: prefetch without a session")
	// ErrPrefetchFull reports a Prefetcher remembering MaxEntries
	// prefetches that have not expired.
	ErrPrefetchFull = errors.New("picker: too many prefetches remembered")
	// ErrWarmupTokens reports warm-up tokens that do not cover the
	// prefetched blocks.
	ErrWarmupTokens = errors.New("picker: warm-up tokens do not cover the prefetched prefix")
)

// PrefetchConfig configures a Prefetcher. The zero value is usable.
type PrefetchConfig struct {
	// TTL is how long a started prefetch suppresses another of the same
	// session, prefix and destination, and how long one neither completed
	// nor cancelled counts against its source (the picker's InflightTTL
	// ages it out first when shorter). Default DefaultPrefetchTTL.
	TTL time.Duration
	// MaxEntries bounds the prefetches started within one TTL (completed,
	// cancelled or replaced ones included, until they expire); beyond it
	// Prefetch returns ErrPrefetchFull. Default DefaultPrefetchMaxEntries.
	MaxEntries int
	// Now is the clock prefetches expire by; give it the picker's
	// Config.Now. Default time.Now.
	Now func() time.Time
}

// PrefetchRequest is a session's known prefix and the pod its next request
// will probably go to. The embedded Request is read as Pick reads it: Model,
// Keys or Prompt (the known prefix), Destination, Candidates,
// MinCachedTokenDelta, and ID or Rand for the draw among equal sources (ID
// defaults to Session).
type PrefetchRequest struct {
	// Session identifies the session; a prefetch is one session's prefix
	// moved to one destination.
	Session string
	Request
}

// PrefetchState says what Prefetch did.
type PrefetchState uint8

const (
	// PrefetchNotNeeded: the decision is not a pull (Decision.Reason says
	// why: the destination holds the prefix, nobody else does, or the gain
	// is below the threshold). Nothing to send, nothing remembered.
	PrefetchNotNeeded PrefetchState = iota
	// PrefetchStarted: the destination should pull Decision.Missing from
	// Decision.Source now. The caller sends Warmup's request and calls
	// Complete or Cancel.
	PrefetchStarted
	// PrefetchDuplicate: this session's prefix is already on its way to
	// (or was just moved to) this destination. Nothing to send.
	PrefetchDuplicate
)

func (s PrefetchState) String() string {
	switch s {
	case PrefetchNotNeeded:
		return "not_needed"
	case PrefetchStarted:
		return "started"
	case PrefetchDuplicate:
		return "duplicate"
	}
	return fmt.Sprintf("PrefetchState(%d)", uint8(s))
}

// Prefetch is the answer of Prefetcher.Prefetch.
type Prefetch struct {
	Session     string
	Destination index.Holder
	State       PrefetchState
	// Decision is Pick's decision for the prefix (zero for a duplicate).
	Decision Decision
	// Expires is when the prefetch is forgotten (started and duplicate).
	Expires time.Time

	e *prefetchEntry
	f *Prefetcher
}

// Complete tells the prefetcher the destination has received the prefix:
// the source no longer counts the pull as in flight, and the prefetch keeps
// suppressing repeats until it expires. It does nothing unless the prefetch
// was started and is neither completed, cancelled nor expired.
func (pf *Prefetch) Complete() { pf.end(false) }

// Cancel tells the prefetcher the prefetch failed or was abandoned: the
// source no longer counts it, and the prefix may be prefetched again. Cancel
// after Complete forgets a completed prefetch (say, the destination evicted
// it).
func (pf *Prefetch) Cancel() { pf.end(true) }

func (pf *Prefetch) end(forget bool) {
	if pf.e == nil {
		return
	}
	f := pf.f
	f.mu.Lock()
	defer f.mu.Unlock()
	pf.e.release()
	if forget && f.live[pf.e.key] == pf.e {
		delete(f.live, pf.e.key)
	}
}

// WarmupRequest is the body of the /v1/completions request that has a vLLM
// destination perform a prefetch: the prefix's tokens, one generated token,
// and the source in kv_transfer_params.remote_kv_source.
type WarmupRequest struct {
	Model     string   `json:"model"`
	Prompt    []uint32 `json:"prompt"`
	MaxTokens int      `json:"max_tokens"`
	// CacheSalt must equal the real request's cache_salt, or the blocks
	// hash differently and the real request misses them.
	CacheSalt        string           `json:"cache_salt,omitempty"`
	KVTransferParams KVTransferParams `json:"kv_transfer_params"`
}

// Warmup renders the request that triggers a started prefetch on vLLM:
// tokens are the known prefix (at least the prefetched blocks' tokens; the
// tokens the keys were computed from), kvRequestID the transfer id. vLLM
// computes at least a prompt's last token itself, so a prefix ending on a
// block boundary has its last block computed rather than pulled; the real
// request finds it cached either way.
func (pf *Prefetch) Warmup(model string, tokens []uint32, cacheSalt, kvRequestID string) (WarmupRequest, error) {
	d := &pf.Decision
	if need := d.Blocks * d.BlockSize; len(tokens) < need {
		return WarmupRequest{}, fmt.Errorf("%w: %d tokens for %d blocks of %d", ErrWarmupTokens, len(tokens), d.Blocks, d.BlockSize)
	}
	return WarmupRequest{
		Model: model, Prompt: tokens, MaxTokens: 1, CacheSalt: cacheSalt,
		KVTransferParams: d.KVTransferParams(kvRequestID),
	}, nil
}

// Prefetcher decides and remembers prefetches over a Picker. It is safe for
// concurrent use; its calls serialise on one lock, which Pick's readers
// never take.
type Prefetcher struct {
	p   *Picker
	ttl time.Duration
	max int
	now func() time.Time

	mu   sync.Mutex
	live map[prefetchKey]*prefetchEntry
	// queue holds every remembered entry in start order, which is expiry
	// order since the TTL is fixed; queue[head:] are not yet swept.
	queue []*prefetchEntry
	head  int
}

type prefetchKey struct {
	session string
	dest    index.Holder
}

type prefetchEntry struct {
	key     prefetchKey
	last    uint64 // the prefix's last key, which names the whole chain
	blocks  int
	expires time.Time
	open    bool // the pull still counts against its source
	d       Decision
}

// release stops counting the entry's pull against its source, once.
func (e *prefetchEntry) release() {
	if e.open {
		e.open = false
		e.d.Done()
	}
}

// NewPrefetcher returns a Prefetcher deciding with p.
func NewPrefetcher(p *Picker, cfg PrefetchConfig) *Prefetcher {
	f := &Prefetcher{p: p, ttl: cfg.TTL, max: cfg.MaxEntries, now: cfg.Now, live: make(map[prefetchKey]*prefetchEntry)}
	if f.ttl <= 0 {
		f.ttl = DefaultPrefetchTTL
	}
	if f.max <= 0 {
		f.max = DefaultPrefetchMaxEntries
	}
	if f.now == nil {
		f.now = time.Now
	}
	return f
}

// Prefetch decides whether to move req's known prefix to req.Destination
// now. A pull is decided exactly as Pick decides it (local hits first, a
// pull when the gain reaches the threshold, nothing otherwise) and counts
// against its source until Complete, Cancel or the TTL. A second call for
// the same session, prefix (the same keys) and destination while the first
// is remembered is a duplicate and decides nothing; a different prefix for
// the same session and destination (the next turn's) replaces it.
func (f *Prefetcher) Prefetch(req PrefetchRequest) (Prefetch, error) {
	if req.Session == "" {
		return Prefetch{}, ErrNoSession
	}
	if req.Destination.Pod == "" {
		return Prefetch{}, ErrNoDestination
	}
	if req.Keys == nil {
		if f.p.hasher == nil {
			return Prefetch{}, ErrNoKeys
		}
		keys, err := f.p.hashCache.BlockKeys(f.p.hasher, nil, req.Prompt)
		if err != nil {
			return Prefetch{}, fmt.Errorf("%w: %w", ErrHash, err)
		}
		req.Keys = keys
	}
	if req.ID == "" {
		req.ID = req.Session
	}
	out := Prefetch{Session: req.Session, Destination: req.Destination}
	key := prefetchKey{req.Session, req.Destination}
	var last uint64
	if n := len(req.Keys); n > 0 {
		last = req.Keys[n-1]
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.now()
	f.sweep(now)
	if e := f.live[key]; e != nil && e.last == last && e.blocks == len(req.Keys) && now.Before(e.expires) {
		out.State, out.Expires = PrefetchDuplicate, e.expires
		return out, nil
	}
	if len(f.queue)-f.head >= f.max {
		return Prefetch{}, fmt.Errorf("%w: %d", ErrPrefetchFull, f.max)
	}
	d, err := f.p.Pick(req.Request)
	if err != nil {
		return Prefetch{}, err
	}
	out.Decision = d
	if d.Reason != ReasonPull {
		return out, nil
	}
	e := &prefetchEntry{key: key, last: last, blocks: len(req.Keys), expires: now.Add(f.ttl), open: true, d: d}
	f.live[key] = e
	f.queue = append(f.queue, e)
	out.State, out.Expires, out.e, out.f = PrefetchStarted, e.expires, e, f
	return out, nil
}

// Pending reports whether a prefetch of session to dest has started and is
// neither completed, cancelled nor expired. A router whose request arrives
// while its history is still on the way may name the same source again, or
// wait for Complete, rather than have the destination compute it.
func (f *Prefetcher) Pending(session string, dest index.Holder) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sweep(f.now())
	e := f.live[prefetchKey{session, dest}]
	return e != nil && e.open
}

// Remembered returns the number of prefetches remembered and not expired.
func (f *Prefetcher) Remembered() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sweep(f.now())
	return len(f.live)
}

// sweep forgets the entries expired at now, releasing their sources.
func (f *Prefetcher) sweep(now time.Time) {
	for f.head < len(f.queue) {
		e := f.queue[f.head]
		if now.Before(e.expires) {
			break
		}
		e.release()
		if f.live[e.key] == e {
			delete(f.live, e.key)
		}
		f.queue[f.head] = nil
		f.head++
	}
	// Reuse the queue's front once it is mostly swept.
	if f.head > 0 && f.head >= len(f.queue)/2 {
		n := copy(f.queue, f.queue[f.head:])
		clear(f.queue[n:])
		f.queue = f.queue[:n]
		f.head = 0
	}
}
