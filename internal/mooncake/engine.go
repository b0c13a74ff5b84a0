package mooncake

import (
	"container/list"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"

	"github.com/zeebo/xxh3"
)

// Config is what Generate takes from mooncake_bench's command line and its
// mock engine's arguments.
type Config struct {
	Workers   int    // --num-unique-inference-workers
	Seed      uint64 // --seed: the spread of requests over the workers
	BlockSize int    // --block-size: tokens per engine block and per hash_id
	GPUBlocks int    // --num-gpu-blocks: each engine's KV cache, in blocks
	// SimulationMS is --trace-simulation-duration-ms: each engine's arrivals
	// are mapped onto [0, SimulationMS] before it runs them.
	SimulationMS uint64
	// SpeedupRatio divides the engine's modelled prefill and decode times.
	SpeedupRatio float64
}

// DynamoConfig is the configuration of Dynamo's published mooncake_bench
// figures (BENCH_SETUP.md).
func DynamoConfig() Config {
	return Config{Workers: 1000, Seed: 42, BlockSize: 128, GPUBlocks: 16384, SimulationMS: 10000, SpeedupRatio: 10}
}

// hashSeed is the seed of the mock engine's and the router's block hashes
// (Dynamo's XXH3_SEED, the tokens crate's salt 1337).
const hashSeed = 1337

// Request is one prompt a worker was sent.
type Request struct {
	// TimestampUS is when the engine admitted it, in simulated microseconds.
	TimestampUS uint64
	// Keys are the block hashes of the prompt's full blocks, chained as the
	// engine's: what the router matches.
	Keys []uint64
}

// EventKind is the kind of a KV event.
type EventKind uint8

// The KV events a mock engine publishes (it has no Cleared).
const (
	EventStored EventKind = iota + 1
	EventRemoved
)

// Event is one KV event a worker published.
type Event struct {
	// TimestampUS is the start of the engine pass that published it.
	TimestampUS uint64
	Kind        EventKind
	// Parent is the block before Keys[0] of a Stored event, if HasParent.
	Parent    uint64
	HasParent bool
	// Keys are the blocks stored or removed.
	Keys []uint64
	// Decode marks a Stored event of a block the engine filled while
	// generating (one block), as opposed to a prompt's.
	Decode bool
}

// Worker is what one mock engine produced: the prompts it admitted and the
// events it published, each in time order.
type Worker struct {
	Requests []Request
	Events   []Event
}

// Errors of Generate.
var (
	ErrConfig = errors.New("mooncake: bad configuration")
	ErrTrace  = errors.New("mooncake: trace not runnable")
	// ErrPreempt is a worker whose KV cache is full of blocks in use: where
	// Dynamo's engine preempts a request, which this port does not model.
	ErrPreempt = errors.New("mooncake: mock engine out of KV blocks (preemption is not modelled)")
)

// Generate spreads recs over cfg.Workers mock engines as Dynamo's
// partition_by_session does (StdRng::seed_from_u64(cfg.Seed), then
// random_range(0..Workers) per record in order; each record is a session
// of one turn) and runs each engine's share through the offline
// simulation. Workers with no request come out empty (Dynamo fails on
// them). The workers are simulated in parallel; the result does not depend
// on it.
func Generate(recs []Record, cfg Config) ([]Worker, error) {
	if cfg.Workers <= 0 || cfg.Workers > math.MaxUint32 || cfg.BlockSize <= 0 || cfg.GPUBlocks <= 0 || !(cfg.SpeedupRatio >= 0) {
		return nil, fmt.Errorf("%w: %+v", ErrConfig, cfg)
	}
	parts := make([][]*Record, cfg.Workers)
	rng := SeedStdRng(cfg.Seed)
	for i := range recs {
		p, err := rng.RandomRange(uint32(cfg.Workers))
		if err != nil {
			return nil, err
		}
		parts[p] = append(parts[p], &recs[i])
	}
	out := make([]Worker, cfg.Workers)
	errs := make([]error, cfg.Workers)
	var wg sync.WaitGroup
	next := make(chan int)
	for range runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			for w := range next {
				out[w], errs[w] = simulate(parts[w], cfg, uint64(w))
			}
		})
	}
	for w := range cfg.Workers {
		next <- w
	}
	close(next)
	wg.Wait()
	for w, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("worker %d: %w", w, err)
		}
	}
	return out, nil
}

// blockID is the mock engine's UniqueBlock: a full block by its sequence
// hash, or a partial one by a number of its own.
type blockID struct {
	partial bool
	v       uint64
}

// sequence is the engine's ActiveSequence and the scheduler's state of one
// request.
type sequence struct {
	blocks    []blockID // the sequence's blocks, the last one possibly partial
	hashes    []uint64  // sequence hashes of its complete blocks
	tail      []uint32  // tokens of the incomplete block
	length    int       // tokens, prompt and generated
	input     int       // prompt tokens
	maxOut    int
	generated int
	allocated int // tokens whose blocks are allocated
	computed  int
}

// engine is one mock vLLM engine: its KV block manager (active blocks with
// reference counts, inactive ones in LRU order) and scheduler queues.
type engine struct {
	cfg         Config
	active      map[blockID]int
	inactive    map[blockID]*list.Element
	lru         *list.List // of blockID, oldest first
	nextPartial uint64
	waiting     []*sequence
	running     []*sequence
	events      []Event // of the pass under way
	rand        *rand.PCG
	buf         []byte
}

// simulate is generate_trace_worker_artifacts_offline for one worker: the
// arrivals rescaled to cfg.SimulationMS (rescale_ready_span), then engine
// passes on a simulated clock until every request has finished.
func simulate(recs []*Record, cfg Config, worker uint64) (Worker, error) {
	type arrival struct {
		ready float64
		seq   *sequence
		keys  []uint64
	}
	if len(recs) == 0 {
		return Worker{}, nil
	}
	e := &engine{
		cfg:      cfg,
		active:   make(map[blockID]int),
		inactive: make(map[blockID]*list.Element),
		lru:      list.New(),
		rand:     rand.NewPCG(cfg.Seed, worker),
		buf:      make([]byte, 4*cfg.BlockSize),
	}
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, r := range recs {
		lo, hi = min(lo, float64(r.Timestamp)), max(hi, float64(r.Timestamp))
	}
	ratio := float64(cfg.SimulationMS) / max(hi-lo, 1)
	arrivals := make([]arrival, len(recs))
	for i, r := range recs {
		seq, keys, err := e.newSequence(r)
		if err != nil {
			return Worker{}, fmt.Errorf("request at %d ms: %w", r.Timestamp, err)
		}
		arrivals[i] = arrival{ready: (float64(r.Timestamp) - lo) * ratio, seq: seq, keys: keys}
	}
	// The driver's heap pops by ready time, then by session order.
	slices.SortStableFunc(arrivals, func(a, b arrival) int {
		switch {
		case a.ready < b.ready:
			return -1
		case a.ready > b.ready:
			return 1
		}
		return 0
	})

	var out Worker
	now := 0.0
	next := 0
	for next < len(arrivals) || len(e.waiting)+len(e.running) > 0 {
		for ; next < len(arrivals) && arrivals[next].ready <= now; next++ {
			out.Requests = append(out.Requests, Request{TimestampUS: timestampUS(now), Keys: arrivals[next].keys})
			e.waiting = append(e.waiting, arrivals[next].seq)
		}
		if len(e.waiting)+len(e.running) == 0 {
			now = arrivals[next].ready
			continue
		}
		start := now
		end, err := e.pass(now)
		if err != nil {
			return Worker{}, err
		}
		now = end
		for _, ev := range e.events {
			ev.TimestampUS = timestampUS(start)
			out.Events = append(out.Events, ev)
		}
		e.events = e.events[:0]
	}
	return out, nil
}

// newSequence makes a record's request: its prompt is the record's ids,
// each repeated BlockSize times as a token, cut to input_length, which is
// first clamped to that many tokens (Trace::from_mooncake). It returns the
// router's keys of the prompt's full blocks too.
func (e *engine) newSequence(r *Record) (*sequence, []uint64, error) {
	bs := e.cfg.BlockSize
	input := min(r.InputLength, len(r.HashIDs)*bs)
	switch {
	case input == 0:
		return nil, nil, fmt.Errorf("%w: empty prompt", ErrTrace)
	case r.OutputLength == 0:
		// Dynamo's engine never finishes such a request.
		return nil, nil, fmt.Errorf("%w: no output token", ErrTrace)
	}
	s := &sequence{length: input, input: input, maxOut: r.OutputLength}
	full := input / bs
	tok := make([]uint32, bs)
	for j := range full {
		for i := range tok {
			tok[i] = uint32(r.HashIDs[j])
		}
		s.complete(e, tok)
	}
	keys := slices.Clone(s.hashes)
	for range input % bs {
		s.tail = append(s.tail, uint32(r.HashIDs[full]))
	}
	for _, h := range s.hashes {
		s.blocks = append(s.blocks, blockID{v: h})
	}
	if len(s.tail) > 0 {
		s.blocks = append(s.blocks, e.newPartial())
	}
	return s, keys, nil
}

// complete appends the sequence hash of a complete block of tokens: xxh3
// of the tokens (u32, little-endian), chained to the previous block's as
// xxh3 of the two hashes.
func (s *sequence) complete(e *engine, tokens []uint32) {
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(e.buf[4*i:], t)
	}
	h := xxh3.HashSeed(e.buf[:4*len(tokens)], hashSeed)
	if n := len(s.hashes); n > 0 {
		var pair [16]byte
		binary.LittleEndian.PutUint64(pair[:], s.hashes[n-1])
		binary.LittleEndian.PutUint64(pair[8:], h)
		h = xxh3.HashSeed(pair[:], hashSeed)
	}
	s.hashes = append(s.hashes, h)
}

func (e *engine) newPartial() blockID {
	e.nextPartial++
	return blockID{partial: true, v: e.nextPartial}
}

func (e *engine) contains(b blockID) bool {
	if _, ok := e.active[b]; ok {
		return true
	}
	_, ok := e.inactive[b]
	return ok
}

// pass is VllmCore::execute_pass with no token or sequence limit: the
// running requests are scheduled for their next token, every waiting one
// is admitted with its whole prompt, then each running request generates a
// token. It returns the pass's end on the simulated clock.
func (e *engine) pass(now float64) (float64, error) {
	bs := e.cfg.BlockSize
	for _, s := range e.running {
		s.computed = s.length
	}
	var batch, isl, prefix int
	for _, s := range e.waiting {
		overlap := 0
		for _, b := range s.blocks {
			if !e.contains(b) {
				break
			}
			overlap++
		}
		cached := min(overlap*bs, s.input)
		if err := e.use(s.blocks, blockID{}, false); err != nil {
			return 0, err
		}
		s.allocated, s.computed = s.length, s.length
		if s.input > cached {
			batch++
			isl += s.input
			prefix += cached
		}
		e.running = append(e.running, s)
	}
	e.waiting = e.waiting[:0]
	decodeStart := now + e.prefillTime(batch, isl, prefix).seconds()*1000
	decode, err := e.decode()
	if err != nil {
		return 0, err
	}
	return decodeStart + decode.seconds()*1000, nil
}

// prefillTime is predict_prefill_duration with the polynomial perf model:
// of the batch's new tokens (count × (mean prompt − mean cached prefix)).
func (e *engine) prefillTime(batch, isl, prefix int) rustDuration {
	if batch == 0 {
		return rustDuration{}
	}
	t := float64(batch * max(isl/batch-prefix/batch, 0))
	// The conversions keep Go from fusing multiply-adds Rust does not.
	ms := max(float64(4.209989e-07*float64(t*t))+float64(1.518344e-02*t)+1.650142e+01, 0)
	return e.speedUp(durationFromSecs(ms / 1000))
}

func (e *engine) speedUp(d rustDuration) rustDuration {
	if e.cfg.SpeedupRatio <= 0 || d.isZero() {
		return d
	}
	return durationFromSecs(d.seconds() / e.cfg.SpeedupRatio)
}

// decode is emit_ready_tokens: every running request generates one random
// token, in order; the step takes the polynomial model's time of the
// engine's active blocks (at least 1 ms before the speedup).
func (e *engine) decode() (rustDuration, error) {
	if len(e.running) == 0 {
		return rustDuration{}, nil
	}
	p := float64(len(e.active)*e.cfg.BlockSize) / 16384
	ms := max(float64(-25.74*float64(p*p))+float64(54.01*p)+5.74, 1)
	d := e.speedUp(durationFromSecs(ms / 1000))
	kept := e.running[:0]
	for _, s := range e.running {
		if err := e.generate(s); err != nil {
			return rustDuration{}, err
		}
		if s.generated < s.maxOut {
			s.allocated = s.length
			kept = append(kept, s)
		}
	}
	clear(e.running[len(kept):])
	e.running = kept
	return d, nil
}

// generate is ActiveSequence::generate with its signals applied: a token
// that starts a new block first promotes the previous partial block to a
// full one (a Stored event of one block), then takes a new partial block;
// the last token frees the sequence's blocks, last first.
func (e *engine) generate(s *sequence) error {
	bs := e.cfg.BlockSize
	s.tail = append(s.tail, uint32(e.rand.Uint64()))
	s.length++
	s.generated++
	if len(s.tail) == bs {
		s.complete(e, s.tail)
		s.tail = s.tail[:0]
	}
	if s.length%bs == 1 {
		if last := s.blocks[len(s.blocks)-1]; last.partial {
			full := blockID{v: s.hashes[len(s.hashes)-1]}
			s.blocks[len(s.blocks)-1] = full
			var parent blockID
			hasParent := len(s.blocks) > 1
			if hasParent {
				parent = s.blocks[len(s.blocks)-2]
			}
			e.promote(last, full, parent, hasParent)
		}
		p := e.newPartial()
		s.blocks = append(s.blocks, p)
		if err := e.use([]blockID{p}, blockID{}, false); err != nil {
			return err
		}
	}
	if s.generated == s.maxOut {
		n := min((s.length+bs-1)/bs, len(s.blocks))
		for i := n - 1; i >= 0; i-- {
			e.release(s.blocks[i])
		}
	}
	return nil
}

// use is KvManager::process(MoveBlock::Use): blocks already cached are
// referenced again, the others inserted (evicting the oldest inactive
// block when the cache is full: a Removed event), and one Stored event
// lists the inserted full blocks, its parent the last block found cached
// (or parent).
func (e *engine) use(blocks []blockID, parent blockID, hasParent bool) error {
	var stored []uint64
	for _, b := range blocks {
		if n, ok := e.active[b]; ok {
			e.active[b] = n + 1
			parent, hasParent = b, true
			continue
		}
		if el, ok := e.inactive[b]; ok {
			e.lru.Remove(el)
			delete(e.inactive, b)
			e.active[b] = 1
			parent, hasParent = b, true
			continue
		}
		if len(e.active)+len(e.inactive) >= e.cfg.GPUBlocks {
			el := e.lru.Front()
			if el == nil {
				return ErrPreempt
			}
			victim := e.lru.Remove(el).(blockID)
			delete(e.inactive, victim)
			if !victim.partial {
				e.events = append(e.events, Event{Kind: EventRemoved, Keys: []uint64{victim.v}})
			}
		}
		e.active[b] = 1
		if !b.partial {
			stored = append(stored, b.v)
		}
	}
	if len(stored) > 0 {
		e.events = append(e.events, Event{Kind: EventStored, Parent: parent.v, HasParent: hasParent, Keys: stored})
	}
	return nil
}

// promote is MoveBlock::Promote: the partial block becomes the full block,
// and a Stored event reports it unless the cache had it already.
func (e *engine) promote(partial, full, parent blockID, hasParent bool) {
	delete(e.active, partial)
	n, isActive := e.active[full]
	isNew := !isActive
	if el, ok := e.inactive[full]; ok && !isActive {
		e.lru.Remove(el)
		delete(e.inactive, full)
		isNew = false
	}
	e.active[full] = n + 1
	if isNew {
		e.events = append(e.events, Event{Kind: EventStored, Parent: parent.v, HasParent: hasParent, Keys: []uint64{full.v}, Decode: true})
	}
}

// release is a finished sequence's MoveBlock::Destroy of its partial block
// and MoveBlock::Deref of a full one, which goes to the inactive pool when
// no other sequence uses it. Neither publishes anything.
func (e *engine) release(b blockID) {
	if b.partial {
		delete(e.active, b)
		return
	}
	n, ok := e.active[b]
	switch {
	case !ok:
	case n > 1:
		e.active[b] = n - 1
	default:
		delete(e.active, b)
		e.inactive[b] = e.lru.PushBack(b)
	}
}
