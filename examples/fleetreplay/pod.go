package main

import (
	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/index"
)

type role uint8

const (
	roleBoth    role = iota // aggregated: prefill and decode
	rolePrefill             // computes prefills, hands KV to a decode pod
	roleDecode              // receives KV, decodes; serves pulls like any pod
)

// pod is one simulated vLLM engine: a GPU prefix cache and a CPU offload
// tier (write-through, as vLLM's offloading connector stores every computed
// block), a compute resource shared by its running prefills, and an egress
// link shared by the pulls it serves. Every cache change is published as
// vLLM KV events through the fleet's SDK path.
type pod struct {
	f       *fleet
	idx     int
	name    string // host:port, the holder name in events and the index
	host    string // the host part: what a source header names
	role    role
	gpu     *lru
	cpu     *lru
	compute shared
	link    shared
	// pending maps a block being computed or pulled here to the requests
	// waiting for it. vLLM schedules a running prefill's chunks before a
	// newcomer's, so a newcomer whose prefix another request here is
	// computing (or loading) gets those blocks as hits once they are in,
	// rather than computing them a second time.
	pending map[uint64]*landing
	load    int  // requests admitted and not finished: the router's queue depth
	down    bool // not yet taking requests (a pod about to join)
	out     events.Batch
	removed [2][]uint64 // scratch: evicted GPU and CPU keys
	fresh   []bool      // scratch: which blocks a store newly inserts
}

// landing is a run of blocks on its way into a pod's cache.
type landing struct {
	waiters []func()
}

func (p *pod) holder() index.Holder { return index.Holder{Pod: p.name} }

// computes reports whether the router can place prefills on p.
func (p *pod) computes() bool { return p.role != roleDecode && !p.down }

// localPrefix returns the number of leading keys p holds in either tier.
func (p *pod) localPrefix(keys []uint64) int {
	for i, k := range keys {
		if !p.gpu.has(k) && !p.cpu.has(k) {
			return i
		}
	}
	return len(keys)
}

// admit starts r on p, with the pull the router ordered (nil: none).
func (p *pod) admit(r *request, o *pullOrder) {
	p.load++
	r.destName = p.name
	p.advance(r, o)
}

// advance moves r to its next phase: wait for blocks landing here, pull,
// or compute what is left.
func (p *pod) advance(r *request, o *pullOrder) {
	keys := r.eng.keys
	l := p.localPrefix(keys)
	if l < len(keys) {
		if w := p.pending[keys[l]]; w != nil {
			r.waited = true
			w.waiters = append(w.waiters, func() { p.advance(r, o) })
			return
		}
	}
	if o != nil {
		if end := o.reach(keys, l); end > l {
			p.pull(r, o, l, end, func() { p.advance(r, nil) })
			return
		}
		// Another request landed these blocks here meanwhile.
		o.release()
	}
	p.prefill(r, l)
}

// expect marks keys as landing here and returns their landing.
func (p *pod) expect(keys []uint64) *landing {
	w := &landing{}
	for _, k := range keys {
		p.pending[k] = w
	}
	return w
}

// land clears keys' landing and wakes its waiters.
func (p *pod) land(keys []uint64, w *landing) {
	for _, k := range keys {
		if p.pending[k] == w {
			delete(p.pending, k)
		}
	}
	for _, f := range w.waiters {
		p.f.clk.after(0, f)
	}
	w.waiters = nil
}

// prefill computes r's blocks from l on, the partial tail block included.
func (p *pod) prefill(r *request, l int) {
	f := p.f
	keys := r.eng.keys
	bs := f.blockSize
	// Local CPU-tier hits are loaded into GPU memory first.
	cpuOnly := 0
	for _, k := range keys[:l] {
		if !p.gpu.has(k) {
			cpuOnly++
		}
	}
	if cpuOnly > 0 {
		p.store(r, 0, l, index.TierGPU)
	}
	p.touch(keys[:l])
	p.flush()
	r.localBlocks = l - r.pulledBlocks
	r.cpuRestored = cpuOnly
	r.computedBlocks = len(keys) - l
	w := p.expect(keys[l:])
	work := f.cost().Prefill(l*bs, r.tokens()) + f.cost().CPULoad*float64(cpuOnly*bs)
	p.compute.add(work, func() {
		p.store(r, l, len(keys), index.TierGPU)
		p.store(r, l, len(keys), index.TierCPU)
		p.flush()
		p.land(keys[l:], w)
		p.finish(r)
	})
}

// finish ends r's prefill: the first token follows after the cost model's
// FirstToken; in a prefill/decode split the decode pod receives the KV.
func (p *pod) finish(r *request) {
	f := p.f
	p.load--
	r.ttft = f.clk.now + f.cost().FirstToken - r.arrival
	r.done = true
	holder := p
	if r.decode != nil {
		d := r.decode
		n := len(r.eng.keys)
		d.store(r, 0, n, index.TierGPU)
		d.store(r, 0, n, index.TierCPU)
		d.flush()
		holder = d
	}
	f.finished(r, holder)
}

// touch marks keys most recently used, the first key last so that eviction
// takes a prompt's tail before its head, as vLLM frees a request's blocks
// in reverse order.
func (p *pod) touch(keys []uint64) {
	for i := len(keys) - 1; i >= 0; i-- {
		if !p.gpu.touch(keys[i]) {
			p.cpu.touch(keys[i])
		}
	}
}

// store inserts r's blocks [from, to) into tier and queues the events: a
// BlockRemoved for what the insert evicted, a BlockStored per run of blocks
// the tier did not hold, with its parent and tokens.
func (p *pod) store(r *request, from, to int, tier string) {
	if from >= to {
		return
	}
	f := p.f
	keys := r.eng.keys
	cache, ti := p.gpu, 0
	if tier == index.TierCPU {
		cache, ti = p.cpu, 1
	}
	p.fresh = p.fresh[:0]
	for i := from; i < to; i++ {
		p.fresh = append(p.fresh, !cache.has(keys[i]))
	}
	// The held blocks of the run become most recently used before any
	// insert, so that inserting the run's new blocks cannot evict them:
	// an evicted held block would be published removed and, not being
	// new, never stored again, though the tier holds it.
	for i := to - 1; i >= from; i-- {
		if !p.fresh[i-from] {
			cache.touch(keys[i])
		}
	}
	removed := p.removed[ti][:0]
	for i := to - 1; i >= from; i-- {
		removed = cache.insert(keys[i], removed)
	}
	p.removed[ti] = removed
	if len(removed) > 0 {
		e := p.event(events.EventBlockRemoved, tier)
		e.BlockHashes = append(e.BlockHashes, removed...)
		if tier == index.TierCPU {
			f.sdk.evicted(p, removed)
		}
	}
	bs := f.blockSize
	for i := 0; i < len(p.fresh); {
		if !p.fresh[i] {
			i++
			continue
		}
		j := i
		for j < len(p.fresh) && p.fresh[j] {
			j++
		}
		a, b := from+i, from+j
		e := p.event(events.EventBlockStored, tier)
		e.BlockHashes = append(e.BlockHashes, keys[a:b]...)
		if a > 0 {
			e.Parent = events.Some(keys[a-1])
		}
		e.TokenIDs = r.appendTokens(e.TokenIDs, a*bs, b*bs)
		e.BlockSize = bs
		if salt := r.prefix.rootSalt(); salt != "" && a == 0 {
			// vLLM's cache_salt is block 0's extra key.
			extra := make([][]byte, b-a)
			extra[0] = saltExtraKeys(salt)
			e.ExtraKeys = events.Some(extra)
		}
		if tier == index.TierCPU {
			f.sdk.offloaded(p, r, a, b)
		}
		i = j
	}
}

// event appends an event of type t for tier to the pending batch.
func (p *pod) event(t events.EventType, tier string) *events.Event {
	n := len(p.out.Events)
	if n < cap(p.out.Events) {
		p.out.Events = p.out.Events[:n+1]
	} else {
		p.out.Events = append(p.out.Events, events.Event{})
	}
	e := &p.out.Events[n]
	blocks, tokens := e.BlockHashes[:0], e.TokenIDs[:0]
	*e = events.Event{Type: t, Medium: tier, BlockHashes: blocks, TokenIDs: tokens}
	return e
}

// flush publishes the queued events as one batch, as an engine publishes
// once per scheduler step.
func (p *pod) flush() {
	if len(p.out.Events) == 0 {
		return
	}
	p.out.TS = p.f.clk.wall().Sub(epoch).Seconds()
	p.f.sdk.publish(p, &p.out)
	p.out.Events = p.out.Events[:0]
}

// pull moves r's blocks [from, end) from the order's source through the
// transfer client: the blocks the source still holds, as a lookup reports
// them, are fetched at once and verified; they land here after the pull's
// modelled time (the floor, then the bytes over the source's shared link).
// Whatever was not pulled is computed.
func (p *pod) pull(r *request, o *pullOrder, from, end int, then func()) {
	f := p.f
	keys := r.eng.keys[from:end]
	n, err := f.sdk.fetch(p, r, o, keys)
	if err != nil || n == 0 {
		if err != nil {
			f.res.PullsFailed++
		}
		o.release()
		then()
		return
	}
	got := keys[:n]
	w := p.expect(got)
	src := o.source
	f.clk.after(f.cost().PullFloor, func() {
		src.link.add(f.cost().PullPerToken*float64(n*f.blockSize), func() {
			r.pulledBlocks += n
			r.source = src.name
			p.store(r, from, from+n, index.TierCPU)
			p.store(r, from, from+n, index.TierGPU)
			p.flush()
			p.land(got, w)
			o.release()
			then()
		})
	})
}

// restart is the engine restarting: both tiers come back empty, which the
// pod publishes as the removal of every block it held, and its P2P source
// stops serving them.
func (p *pod) restart() {
	for ti, tier := range []string{index.TierGPU, index.TierCPU} {
		cache := p.gpu
		if ti == 1 {
			cache = p.cpu
		}
		keys := cache.keys()
		if len(keys) == 0 {
			continue
		}
		e := p.event(events.EventBlockRemoved, tier)
		e.BlockHashes = append(e.BlockHashes, keys...)
		if ti == 1 {
			p.f.sdk.evicted(p, keys)
		}
		cache.reset()
	}
	p.flush()
}
