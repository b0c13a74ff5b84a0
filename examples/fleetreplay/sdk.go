package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/transfer"
)

// sdkOptions select how the SDK path is built.
type sdkOptions struct {
	// transport is "p2p" (transfer/p2p: vLLM's protocol over ZMQ on
	// loopback) or "fake" (transfer/fake, in memory).
	transport string
	// blockBytes is the size of a block's stand-in content that pulls move
	// and verify.
	blockBytes int
	// hashCheck makes the subscriber rehash every event that starts at
	// block 0 with the router's settings and compare (hash agreement).
	hashCheck bool
	// logger receives the SDK's logs; nil discards them.
	logger *slog.Logger
	// syncTimeout bounds the wait for the subscriber to apply a pod's
	// events before a routing decision.
	syncTimeout time.Duration
}

// errSync reports a subscriber that did not apply published events in time.
var errSync = errors.New("index not up to date")

// errHashMismatch reports router keys that differ from the engines'.
var errHashMismatch = errors.New("router and engine block keys differ")

// sdkPath is everything between the simulated engines and the router, as a
// user's router would run it: a KV-event publisher per pod over ZMQ on
// loopback, a subscriber feeding a live index, the picker, and the transfer
// client the destination pulls with.
type sdkPath struct {
	f  *fleet
	ev eventPath
	pk *picker.Picker

	mv       mover
	sessions map[[2]string]transfer.Session
	tkeys    []transfer.Key
	want     []byte
	idx      []int

	scores []picker.Score
	cands  []picker.Candidate

	// hints, when set, routes pulls as KV hints (kvhints.go).
	hints *hintPath
}

func newSDKPath(ctx context.Context, f *fleet, opt sdkOptions) (*sdkPath, error) {
	if opt.syncTimeout <= 0 {
		opt.syncTimeout = 10 * time.Second
	}
	if opt.blockBytes <= 0 {
		opt.blockBytes = 512
	}
	s := &sdkPath{f: f, sessions: make(map[[2]string]transfer.Session)}
	if err := s.ev.open(ctx, f, opt); err != nil {
		return nil, err
	}
	var err error
	s.pk, err = picker.New(picker.Config{
		Index:               s.ev.index(),
		BlockSize:           f.blockSize,
		MinCachedTokenDelta: f.spec.minDelta,
		Now:                 f.clk.wall,
	})
	if err != nil {
		s.close()
		return nil, err
	}
	if f.spec.hints != nil {
		if s.hints, err = newHintPath(f, *f.spec.hints); err != nil {
			s.close()
			return nil, err
		}
	}
	longest := 0
	for _, r := range f.spec.reqs {
		longest = max(longest, r.tokens()/f.blockSize)
	}
	switch opt.transport {
	case "", "fake":
		s.mv = newFakeMover(f.pods, opt.blockBytes, longest)
	case "p2p":
		if s.mv, err = newP2PMover(f.pods, opt.blockBytes, longest, max(f.spec.cpuBlocks, f.spec.decodeCPU), f.eng.h.Config().Seed); err != nil {
			s.close()
			return nil, err
		}
	default:
		s.close()
		return nil, fmt.Errorf("unknown transport %q (want fake or p2p)", opt.transport)
	}
	return s, nil
}

// restartRouter restarts the router's side: the subscriber and index
// (cold, or loaded from snapshot when it is not ""), and a picker on the new
// index. Pulls already ordered go on; the old picker's bookkeeping of them
// is gone with it, as it would be.
func (s *sdkPath) restartRouter(ctx context.Context, snapshot string) error {
	if err := s.ev.restartRouter(ctx, snapshot); err != nil {
		return err
	}
	pk, err := picker.New(picker.Config{
		Index:               s.ev.index(),
		BlockSize:           s.f.blockSize,
		MinCachedTokenDelta: s.f.spec.minDelta,
		Now:                 s.f.clk.wall,
	})
	if err != nil {
		return err
	}
	s.pk = pk
	return nil
}

// pushOutReplay leaves the pods' replay buffers (n batches) holding only
// empty batches.
func (s *sdkPath) pushOutReplay(ctx context.Context, n int) error { return s.ev.pushOutReplay(ctx, n) }

// snapshot saves the router's index to path.
func (s *sdkPath) snapshot(ctx context.Context, path string) error { return s.ev.snapshot(ctx, path) }

// p2pAddr is the address of a pod's P2P side channel, as the picker renders
// it into kv_transfer_params.
func p2pAddr(p *pod) string { return fmt.Sprintf("%s:%d", p.host, picker.DefaultP2PPort) }

func (s *sdkPath) close() {
	for _, sess := range s.sessions {
		sess.Close()
	}
	if s.mv != nil {
		s.mv.close()
	}
	s.ev.close()
}

// publish sends a pod's batch as a vLLM KV-event message.
func (s *sdkPath) publish(p *pod, b *events.Batch) {
	if err := s.ev.publish(p, b); err != nil {
		s.f.fail(fmt.Errorf("pod %s: %w", p.name, err))
	}
}

// sync returns once the index has applied every batch published so far.
func (s *sdkPath) sync(ctx context.Context) error { return s.ev.sync(ctx) }

// offloaded tells the pod's P2P tier it holds r's blocks [a, b) in CPU
// memory: a pull may now name them.
func (s *sdkPath) offloaded(p *pod, r *request, a, b int) {
	s.tkeys = s.tkeys[:0]
	for _, k := range r.eng.keys[a:b] {
		s.tkeys = append(s.tkeys, s.f.eng.offload[k])
	}
	if err := s.mv.hold(p, s.tkeys); err != nil {
		s.f.fail(err)
	}
}

// evicted drops CPU-tier blocks from the pod's P2P tier.
func (s *sdkPath) evicted(p *pod, keys []uint64) {
	s.tkeys = s.tkeys[:0]
	for _, k := range keys {
		s.tkeys = append(s.tkeys, s.f.eng.offload[k])
	}
	if err := s.mv.evict(p, s.tkeys); err != nil {
		s.f.fail(err)
	}
}

func (s *sdkPath) candidates(pods []*pod) []picker.Candidate {
	s.cands = s.cands[:0]
	for _, p := range pods {
		s.cands = append(s.cands, picker.Candidate{Holder: p.holder(), Waiting: p.load})
	}
	return s.cands
}

// affinity returns the computing pod holding the longest prefix of r by the
// index's scores (the least loaded among equals), or nil when none holds any.
func (s *sdkPath) affinity(r *request) (*pod, error) {
	f := s.f
	var err error
	s.scores, err = s.pk.Score(picker.Request{Model: f.model, Keys: r.keys, Candidates: s.candidates(f.computePods())}, s.scores)
	if err != nil {
		return nil, err
	}
	if len(s.scores) == 0 || s.scores[0].Blocks == 0 {
		return nil, nil
	}
	var best *pod
	for _, sc := range s.scores {
		if sc.Score < s.scores[0].Score {
			break
		}
		p := f.podByName(sc.Holder.Pod)
		if p == nil {
			return nil, fmt.Errorf("index names unknown pod %q", sc.Holder.Pod)
		}
		if best == nil || p.load < best.load {
			best = p
		}
	}
	return best, nil
}

// decide asks the picker whether dest should pull r's prefix, and applies a
// pull as the router hands it to vLLM: kv_transfer_params naming the source.
func (s *sdkPath) decide(r *request, dest *pod) (*pullOrder, error) {
	f := s.f
	if !slices.Equal(r.keys, r.eng.keys) {
		return nil, fmt.Errorf("%w: %s", errHashMismatch, r.name)
	}
	d, err := s.pk.Pick(picker.Request{
		ID: r.name, Model: f.model, Keys: r.keys, Destination: dest.holder(),
		Candidates: s.candidates(f.pods),
	})
	if err != nil {
		return nil, err
	}
	if f.audit != nil {
		f.audit(r, dest, &d)
	}
	r.reason = string(d.Reason)
	f.res.Decisions[r.reason]++
	if d.Reason != picker.ReasonPull {
		return nil, nil
	}
	f.res.PullDecisions++
	if !slices.Equal(d.Missing, r.eng.keys[d.Cached:d.Cached+d.Gain]) {
		d.Done()
		return nil, fmt.Errorf("%s: decision's missing keys are not the prompt's blocks %d..%d", r.name, d.Cached, d.Cached+d.Gain)
	}
	if s.hints != nil {
		return s.route(r, dest, d)
	}
	params := d.KVTransferParams(r.name)
	src := f.byHost[params.RemoteKVSource.RemoteHost]
	if src == nil {
		return nil, fmt.Errorf("kv_transfer_params name unknown host %q", params.RemoteKVSource.RemoteHost)
	}
	return &pullOrder{source: src, addr: s.mv.addr(src), end: d.Cached + d.Gain, d: d}, nil
}

func (s *sdkPath) session(dest *pod, addr string) (transfer.Session, error) {
	k := [2]string{dest.name, addr}
	if sess, ok := s.sessions[k]; ok {
		return sess, nil
	}
	c, _ := s.mv.client(dest)
	sess, err := c.Connect(context.Background(), addr)
	if err != nil {
		return nil, err
	}
	s.sessions[k] = sess
	return sess, nil
}

// drop closes a session that failed, so the next pull reconnects.
func (s *sdkPath) drop(dest *pod, addr string) {
	k := [2]string{dest.name, addr}
	if sess, ok := s.sessions[k]; ok {
		sess.Close()
		delete(s.sessions, k)
	}
}

// fetch pulls keys from the order's source into dest's staging memory: a
// lookup, then a fetch of the leading hits (a hinted order: fetchHinted).
// It verifies what arrived (as many blocks as named, each with its block's
// content) and returns the number of blocks pulled.
func (s *sdkPath) fetch(dest *pod, r *request, o *pullOrder, keys []uint64) (int, error) {
	if o.hinted != nil {
		return s.fetchHinted(dest, r, o, keys)
	}
	ctx := context.Background()
	sess, hits, err := s.lookup(ctx, dest, r, o, keys, "lookup at")
	if err != nil {
		return 0, err
	}
	n := transfer.Prefix(hits)
	s.idx = s.idx[:0]
	for i := range n {
		s.idx = append(s.idx, i)
	}
	if err := s.fetchAt(ctx, dest, r, o, sess, s.tkeys[:n], "fetch from"); err != nil {
		return 0, err
	}
	return n, nil
}

// lookup turns keys into the transfer keys s.tkeys and looks them up at
// the order's source; what names the step in an error.
func (s *sdkPath) lookup(ctx context.Context, dest *pod, r *request, o *pullOrder, keys []uint64, what string) (transfer.Session, []bool, error) {
	sess, err := s.session(dest, o.addr)
	if err != nil {
		return nil, nil, err
	}
	s.tkeys = s.tkeys[:0]
	for _, k := range keys {
		s.tkeys = append(s.tkeys, s.f.eng.offload[k])
	}
	hits, err := sess.Lookup(ctx, s.tkeys)
	if err != nil {
		s.drop(dest, o.addr)
		return nil, nil, fmt.Errorf("%s %s for %s: %w", what, o.addr, r.name, err)
	}
	return sess, hits, nil
}

// fetchAt fetches keys into dest's blocks s.idx (none: the session's
// release of the lookup's pins), counts the pull and verifies what
// arrived; what names the step in an error.
func (s *sdkPath) fetchAt(ctx context.Context, dest *pod, r *request, o *pullOrder, sess transfer.Session, keys []transfer.Key, what string) error {
	if len(keys) == 0 {
		_, err := sess.Fetch(ctx, nil, nil)
		return err
	}
	f := s.f
	f.res.PullsIssued++
	st, err := sess.Fetch(ctx, keys, s.idx)
	if err != nil {
		s.drop(dest, o.addr)
		return fmt.Errorf("%s %s for %s: %w", what, o.addr, r.name, err)
	}
	f.res.BytesMoved += st.Bytes
	if s.verifyAt(dest, keys, s.idx, st) {
		f.res.PullsVerified++
	}
	return nil
}

// verifyAt checks a fetch moved exactly the blocks it named, keys[i] into
// block at[i], each holding the content its source holds for that key.
func (s *sdkPath) verifyAt(dest *pod, keys []transfer.Key, at []int, st transfer.Stats) bool {
	bl := s.mv.blockLen()
	if st.Blocks != len(keys) || st.Bytes != int64(len(keys)*bl) {
		return false
	}
	_, buf := s.mv.client(dest)
	if len(s.want) != bl {
		s.want = make([]byte, bl)
	}
	for i, k := range keys {
		s.mv.expect(k, s.want)
		if j := at[i]; !bytes.Equal(buf[j*bl:(j+1)*bl], s.want) {
			return false
		}
	}
	return true
}

func (s *sdkPath) transferStats() string { return s.mv.stats() }

// holderOf maps an index holder back to its pod.
func (f *fleet) podByName(name string) *pod {
	for _, p := range f.pods {
		if p.name == name {
			return p
		}
	}
	return nil
}
