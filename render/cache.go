package render

import (
	"container/list"
	"sync"
	"sync/atomic"

	"github.com/zeebo/xxh3"
)

// cacheShards spreads the cache's locks; a power of two.
const cacheShards = 16

// entryOverhead is what an entry costs beyond its tokens and strings: the
// map slot, the list element, the slice headers.
const entryOverhead = 256

// cache remembers recent renders by a 128-bit hash of the endpoint and the
// body sent (which carries the stamped model), evicting the least recently
// used past its byte bound. Each shard's lock is held only for a map
// lookup and a list move, never across a render.
type cache struct {
	seed   uint64
	budget int64 // per shard
	shards [cacheShards]cacheShard
	bytes  atomic.Int64
	count  atomic.Int64
	evict  atomic.Uint64
}

type cacheShard struct {
	mu    sync.Mutex
	used  int64
	m     map[xxh3.Uint128]*list.Element
	order list.List // front: most recently used
}

type cacheEntry struct {
	key  xxh3.Uint128
	cost int64
	r    []Rendered
}

func newCache(maxBytes int64, seed uint64) *cache {
	c := &cache{seed: seed, budget: max(maxBytes/cacheShards, 1)}
	for i := range c.shards {
		c.shards[i].m = make(map[xxh3.Uint128]*list.Element)
	}
	return c
}

func (c *cache) key(path string, body []byte) xxh3.Uint128 {
	h := xxh3.NewSeed(c.seed)
	_, _ = h.WriteString(path)
	_, _ = h.Write([]byte{0})
	_, _ = h.Write(body)
	return h.Sum128()
}

func (c *cache) shard(k xxh3.Uint128) *cacheShard { return &c.shards[k.Lo&(cacheShards-1)] }

func (c *cache) get(k xxh3.Uint128) ([]Rendered, bool) {
	s := c.shard(k)
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.m[k]
	if !ok {
		return nil, false
	}
	s.order.MoveToFront(e)
	return e.Value.(*cacheEntry).r, true
}

// put remembers r under k unless it alone exceeds a shard's budget, and
// reports whether it did.
func (c *cache) put(k xxh3.Uint128, r []Rendered) bool {
	cost := int64(entryOverhead)
	for i := range r {
		cost += r[i].size()
	}
	if cost > c.budget {
		return false
	}
	s := c.shard(k)
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[k]; ok {
		return true // a concurrent render of the same body got here first
	}
	for s.used+cost > c.budget {
		old := s.order.Back()
		oe := old.Value.(*cacheEntry)
		s.order.Remove(old)
		delete(s.m, oe.key)
		s.used -= oe.cost
		c.bytes.Add(-oe.cost)
		c.count.Add(-1)
		c.evict.Add(1)
	}
	s.m[k] = s.order.PushFront(&cacheEntry{key: k, cost: cost, r: r})
	s.used += cost
	c.bytes.Add(cost)
	c.count.Add(1)
	return true
}

// size estimates the memory a Rendered holds.
func (r *Rendered) size() int64 {
	n := int64(cap(r.Request.Tokens))*4 + int64(len(r.Model)+len(r.BodyModel)+len(r.Request.CacheSalt))
	for _, it := range r.Request.MM {
		n += int64(len(it.ID)) + 32
	}
	return n
}
