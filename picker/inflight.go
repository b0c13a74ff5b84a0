package picker

import (
	"sync/atomic"

	"github.com/puzpuzpuz/xsync/v4"

	"github.com/kvsource/kvsource/index"
)

// In-flight pulls are counted per source in a small ring of time buckets, so
// that counting, adding and releasing are a few atomic operations and pulls
// the caller never releases fall out of the count once their bucket ages out.
// A bucket packs its epoch (the start time divided by TTL/inflightBuckets,
// modulo 2^epochBits) above a 24-bit count.
const (
	inflightBuckets = 8
	countBits       = 24
	countMask       = 1<<countBits - 1
	epochBits       = 64 - countBits
	epochMask       = 1<<epochBits - 1
)

type holderLoad struct {
	b [inflightBuckets]atomic.Uint64
}

// live reports whether a bucket stamped with epoch e still counts at epoch now.
func live(e, now uint64) bool { return (now-e)&epochMask < inflightBuckets }

func (l *holderLoad) add(epoch uint64) {
	b := &l.b[epoch%inflightBuckets]
	for {
		v := b.Load()
		nv := epoch<<countBits | 1
		if v>>countBits == epoch {
			if v&countMask == countMask {
				return
			}
			nv = v + 1
		}
		if b.CompareAndSwap(v, nv) {
			return
		}
	}
}

// release undoes one add of epoch, unless its bucket has since been reused.
func (l *holderLoad) release(epoch uint64) {
	b := &l.b[epoch%inflightBuckets]
	for {
		v := b.Load()
		if v>>countBits != epoch || v&countMask == 0 {
			return
		}
		if b.CompareAndSwap(v, v-1) {
			return
		}
	}
}

func (l *holderLoad) count(now uint64) int {
	n := 0
	for i := range l.b {
		v := l.b[i].Load()
		if live(v>>countBits, now) {
			n += int(v & countMask)
		}
	}
	return n
}

type inflight struct {
	m *xsync.Map[index.Holder, *holderLoad]
}

func (f *inflight) init() { f.m = xsync.NewMap[index.Holder, *holderLoad]() }

func (f *inflight) get(h index.Holder) *holderLoad {
	l, _ := f.m.Load(h)
	return l
}

func (f *inflight) getOrCreate(h index.Holder) *holderLoad {
	if l, ok := f.m.Load(h); ok {
		return l
	}
	l, _ := f.m.LoadOrStore(h, new(holderLoad))
	return l
}

func (p *Picker) epoch() uint64 {
	return uint64(p.now().UnixNano()/p.gran) & epochMask
}

// Inflight returns the number of pulls this picker directed to h that are
// neither done nor expired.
func (p *Picker) Inflight(h index.Holder) int {
	l := p.inflight.get(h)
	if l == nil {
		return 0
	}
	return l.count(p.epoch())
}
