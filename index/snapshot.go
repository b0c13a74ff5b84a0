package index

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"github.com/puzpuzpuz/xsync/v4"
)

// Snapshot errors. Every error LoadFile returns for a file's content wraps
// ErrBadSnapshot; one from a newer or older format also wraps
// ErrSnapshotVersion.
var (
	ErrBadSnapshot     = errors.New("index: bad snapshot")
	ErrSnapshotVersion = errors.New("index: unsupported snapshot version")
)

// The file is a header, a body and a trailer:
//
//	header   magic "KVSIDX\r\n", version uint32
//	body     capacity overrides, last sequence numbers, then per model, per
//	         holder: its tiers, and its holdings in eviction order, each a
//	         tier, a key and its KV cache groups (format 3; see
//	         snapshot_v2.go for formats 1 and 2, which load)
//	trailer  body length uint64, CRC-32C of header and body uint32, "KEND"
//
// Integers are little-endian or varints.
const (
	snapMagic       = "KVSIDX\r\n"
	snapEnd         = "KEND"
	snapVersion     = 3
	snapHeaderSize  = len(snapMagic) + 4
	snapTrailerSize = 8 + 4 + len(snapEnd)
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// SaveFile writes the index and seqs, the last event sequence number applied
// per holder, to path atomically: a temporary file in the same directory,
// synced, then renamed over path. Each holder is saved consistently; read
// seqs before calling SaveFile, so that a replay from them re-applies
// anything the snapshot may already hold (stores and removals are
// idempotent). Readers and other holders' writers proceed meanwhile.
func (ix *Index) SaveFile(path string, seqs map[Holder]uint64) error {
	return ix.save(path, seqs, false)
}

// SaveHolders is SaveFile for the holders that have a sequence number in
// seqs: the others are left out of the file, and kept in the index. A
// service that saves periodically leaves out holders whose entries it no
// longer trusts without dropping them from the index it answers from.
func (ix *Index) SaveHolders(path string, seqs map[Holder]uint64) error {
	return ix.save(path, seqs, true)
}

func (ix *Index) save(path string, seqs map[Holder]uint64, only bool) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("index: save snapshot: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	crc := crc32.New(crcTable)
	bw := bufio.NewWriterSize(f, 1<<20)
	e := &encoder{w: io.MultiWriter(bw, crc)}
	e.raw([]byte(snapMagic))
	e.u32(snapVersion)
	body := e.n
	ix.encode(e, seqs, only)
	if e.err != nil {
		return fmt.Errorf("index: save snapshot: %w", e.err)
	}
	bodyLen := e.n - body
	sum := crc.Sum32()
	e.w = bw
	e.u64(uint64(bodyLen))
	e.u32(sum)
	e.raw([]byte(snapEnd))
	if e.err == nil {
		e.err = bw.Flush()
	}
	if e.err == nil {
		e.err = f.Sync()
	}
	if e.err != nil {
		return fmt.Errorf("index: save snapshot: %w", e.err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("index: save snapshot: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("index: save snapshot: %w", err)
	}
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// encode writes the index; with only, just the holders in seqs.
func (ix *Index) encode(e *encoder, seqs map[Holder]uint64, only bool) {
	caps := xsync.ToPlainMap(ix.caps)
	e.uvarint(uint64(len(caps)))
	for _, h := range sortedHolders(caps) {
		e.holder(h)
		e.varint(caps[h])
	}
	e.uvarint(uint64(len(seqs)))
	for _, h := range sortedHolders(seqs) {
		e.holder(h)
		e.uvarint(seqs[h])
	}
	models := make(map[string]*modelState)
	ix.models.Range(func(name string, ms *modelState) bool {
		models[name] = ms
		return true
	})
	names := slices.Sorted(maps.Keys(models))
	e.uvarint(uint64(len(names)))
	for _, name := range names {
		e.str(name)
		list := *models[name].list.Load()
		if only {
			list = slices.DeleteFunc(slices.Clone(list), func(hs *holderState) bool {
				_, ok := seqs[hs.h]
				return !ok
			})
		}
		e.uvarint(uint64(len(list)))
		for _, hs := range list {
			hs.mu.Lock()
			hs.encode(e)
			hs.mu.Unlock()
		}
	}
}

// encode writes the holder; a holder removed meanwhile is written empty.
// Its holdings are read from its eviction queue, which names each once,
// in the order evictions take them. Speculative entries, guesses about
// the next seconds, are not saved.
func (hs *holderState) encode(e *encoder) {
	e.holder(hs.h)
	lanes := hs.laneNames()
	if hs.dead {
		lanes = nil
	}
	// saved maps a lane to its tier's number in the file.
	var saved [maxTiers]int
	n := 0
	for l := range lanes {
		saved[l] = -1
		if l != hs.guess {
			saved[l] = n
			n++
		}
	}
	e.uvarint(uint64(n))
	for l, name := range lanes {
		if saved[l] >= 0 {
			e.str(name)
		}
	}
	if hs.dead {
		e.uvarint(0)
		return
	}
	ms := hs.ms
	held := func(id uint32, lane int) (uint64, bool) {
		key := ms.entry(id).key.Load()
		b, _ := ms.ownBits(hs, id, key)
		return key, b&laneBit(lane) != 0
	}
	n = 0
	hs.queue.each(func(id uint32, lane int) bool {
		if _, ok := held(id, lane); ok {
			n++
		}
		return true
	})
	e.uvarint(uint64(n))
	hs.queue.each(func(id uint32, lane int) bool {
		if key, ok := held(id, lane); ok {
			e.raw([]byte{byte(saved[lane])})
			e.u64(key)
			gs := hs.groupsOf(id, lane)
			e.uvarint(uint64(len(gs)))
			for _, g := range gs {
				e.varint(int64(g))
			}
		}
		return true
	})
}

func sortedHolders[V any](m map[Holder]V) []Holder {
	return slices.SortedFunc(maps.Keys(m), Holder.Compare)
}

type encoder struct {
	w   io.Writer
	n   int
	err error
	buf [binary.MaxVarintLen64]byte
}

func (e *encoder) raw(b []byte) {
	if e.err != nil {
		return
	}
	n, err := e.w.Write(b)
	e.n += n
	e.err = err
}

func (e *encoder) u32(v uint32) { e.raw(binary.LittleEndian.AppendUint32(e.buf[:0], v)) }
func (e *encoder) u64(v uint64) { e.raw(binary.LittleEndian.AppendUint64(e.buf[:0], v)) }
func (e *encoder) uvarint(v uint64) {
	e.raw(binary.AppendUvarint(e.buf[:0], v))
}
func (e *encoder) varint(v int64) { e.raw(binary.AppendVarint(e.buf[:0], v)) }
func (e *encoder) str(s string) {
	e.uvarint(uint64(len(s)))
	e.raw([]byte(s))
}
func (e *encoder) holder(h Holder) {
	e.str(h.Pod)
	e.varint(int64(h.Rank))
}

// LoadFile reads a snapshot written by SaveFile into a new index configured
// by cfg, and returns it with the saved sequence numbers. A file that is
// truncated, corrupt, foreign or of another version yields an error
// wrapping ErrBadSnapshot and no index.
func LoadFile(path string, cfg Config) (*Index, map[Holder]uint64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("index: load snapshot: %w", err)
	}
	ix, seqs, err := load(data, cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("index: load snapshot %s: %w", path, err)
	}
	return ix, seqs, nil
}

func load(data []byte, cfg Config) (*Index, map[Holder]uint64, error) {
	if len(data) < len(snapMagic) || string(data[:len(snapMagic)]) != snapMagic {
		return nil, nil, fmt.Errorf("%w: not an index snapshot", ErrBadSnapshot)
	}
	if len(data) < snapHeaderSize {
		return nil, nil, fmt.Errorf("%w: truncated header", ErrBadSnapshot)
	}
	v := binary.LittleEndian.Uint32(data[len(snapMagic):])
	if v < 1 || v > snapVersion {
		return nil, nil, fmt.Errorf("%w: %w %d (this build reads 1 to %d)", ErrBadSnapshot, ErrSnapshotVersion, v, snapVersion)
	}
	if len(data) < snapHeaderSize+snapTrailerSize {
		return nil, nil, fmt.Errorf("%w: truncated", ErrBadSnapshot)
	}
	trailer := data[len(data)-snapTrailerSize:]
	if string(trailer[12:]) != snapEnd {
		return nil, nil, fmt.Errorf("%w: truncated (no end marker)", ErrBadSnapshot)
	}
	body := data[snapHeaderSize : len(data)-snapTrailerSize]
	if n := binary.LittleEndian.Uint64(trailer); n != uint64(len(body)) {
		return nil, nil, fmt.Errorf("%w: body is %d bytes, trailer says %d", ErrBadSnapshot, len(body), n)
	}
	if sum := crc32.Checksum(data[:len(data)-snapTrailerSize], crcTable); sum != binary.LittleEndian.Uint32(trailer[8:]) {
		return nil, nil, fmt.Errorf("%w: checksum mismatch", ErrBadSnapshot)
	}
	d := &decoder{b: body, version: v}
	ix, seqs := decodeIndex(d, cfg)
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d trailing bytes", len(d.b))
	}
	if d.err != nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrBadSnapshot, d.err)
	}
	return ix, seqs, nil
}

func decodeIndex(d *decoder, cfg Config) (*Index, map[Holder]uint64) {
	ix := New(cfg)
	for range d.count(2) {
		h := d.holder()
		ix.caps.Store(h, d.varint())
	}
	seqs := make(map[Holder]uint64)
	for range d.count(2) {
		h := d.holder()
		seqs[h] = d.uvarint()
	}
	seen := make(map[string]bool)
	for range d.count(2) {
		name := d.str()
		if d.err != nil {
			break
		}
		if seen[name] {
			d.fail("model %q twice", name)
			break
		}
		seen[name] = true
		// A model is made with its first holder: one with none (a file
		// SaveHolders left its holders out of) would cost its state for
		// good, and a small file could name many.
		var ms *modelState
		for range d.count(3) {
			if ms == nil {
				ms = ix.model(name, true)
			}
			sh := d.savedHolder()
			if d.err != nil {
				break
			}
			if _, ok := ms.holders.Load(sh.h); ok {
				d.fail("holder %v of model %q twice", sh.h, name)
				break
			}
			ms.mu.Lock()
			hs := ms.newHolder(sh.h, ix.capacityOf(sh.h))
			ms.mu.Unlock()
			if hs == nil {
				d.fail("model %q has too many holders", name)
				break
			}
			hs.mu.Lock()
			ix.restore(hs, sh, d)
			hs.mu.Unlock()
		}
	}
	if d.err != nil {
		return nil, nil
	}
	// Limits may be lower than when the snapshot was taken.
	ix.models.Range(func(name string, ms *modelState) bool {
		for _, hs := range *ms.list.Load() {
			hs.mu.Lock()
			ix.enforce(name, hs)
			hs.mu.Unlock()
		}
		return true
	})
	return ix, seqs
}

// savedHolder is a holder as a file has it: its tiers, and its holdings
// in eviction order.
type savedHolder struct {
	h        Holder
	tiers    []string
	holdings []savedHolding
}

type savedHolding struct {
	tier   int
	key    uint64
	groups []int // nil: group 0 alone
}

// savedHolder reads a holder of the file's format.
func (d *decoder) savedHolder() savedHolder {
	if d.version < 3 {
		return d.savedHolderV2()
	}
	sh := savedHolder{h: d.holder()}
	sh.tiers = d.tiers(sh.h)
	for range d.count(10) {
		hd := savedHolding{tier: int(d.byte()), key: d.u64()}
		hd.groups = d.groups(sh.h, true)
		if d.err != nil {
			break
		}
		if hd.tier >= len(sh.tiers) {
			d.fail("holder %v: a holding in tier %d of %d", sh.h, hd.tier, len(sh.tiers))
			break
		}
		sh.holdings = append(sh.holdings, hd)
	}
	return sh
}

// tiers reads a holder's tier names.
func (d *decoder) tiers(h Holder) []string {
	n := d.count(2)
	if n > maxTiers {
		d.fail("holder %v has %d tiers", h, n)
		return nil
	}
	var tiers []string
	for range n {
		name := d.str()
		switch {
		case d.err != nil:
			return nil
		case name == "" || name == TierSpeculative:
			d.fail("holder %v has tier %q", h, name)
			return nil
		case slices.Contains(tiers, name):
			d.fail("holder %v has tier %q twice", h, name)
			return nil
		}
		tiers = append(tiers, name)
	}
	return tiers
}

// groups reads a list of KV cache groups, where an empty list is group 0
// alone; with canon, it must list them as the index keeps them: sorted,
// and not group 0 alone.
func (d *decoder) groups(h Holder, canon bool) []int {
	var gs []int
	for range d.count(1) {
		g := int(d.varint())
		if slices.Contains(gs, g) || canon && len(gs) > 0 && g < gs[len(gs)-1] {
			d.fail("holder %v: bad group list", h)
		}
		gs = append(gs, g)
	}
	if len(gs) == 1 && gs[0] == 0 {
		if canon {
			d.fail("holder %v: bad group list", h)
		}
		return nil
	}
	slices.Sort(gs)
	return gs
}

// restore stores sh's holdings in hs, in order, as its stores did.
func (ix *Index) restore(hs *holderState, sh savedHolder, d *decoder) {
	lanes := make([]int, len(sh.tiers))
	for i, name := range sh.tiers {
		lanes[i] = hs.lane(name, true)
	}
	ms := hs.ms
	var added int64
	for _, hd := range sh.holdings {
		lane := lanes[hd.tier]
		id, old := ms.hold(hs, ms.resolve([]uint64{hd.key}, hs.scratch[:0], hs.heldWord(lane))[0], hd.key, lane)
		if old&laneBit(lane) != 0 {
			d.fail("holder %v: key %#x twice in tier %q", sh.h, hd.key, sh.tiers[hd.tier])
			return
		}
		if len(hd.groups) > 0 {
			hs.setGroups(groupKey(id, lane), hd.groups)
		}
		hs.queue.push(id, lane)
		hs.held[lane].Add(1)
		added++
	}
	hs.live.Add(added)
	ix.total.Add(added)
}

// decoder reads the body; after the first error every read returns zero.
type decoder struct {
	b       []byte
	version uint32
	err     error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf(format, args...)
	}
}

func (d *decoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n > len(d.b) {
		d.fail("truncated body")
		return nil
	}
	b := d.b[:n]
	d.b = d.b[n:]
	return b
}

func (d *decoder) byte() byte {
	if b := d.take(1); b != nil {
		return b[0]
	}
	return 0
}

func (d *decoder) u64() uint64 {
	if b := d.take(8); b != nil {
		return binary.LittleEndian.Uint64(b)
	}
	return 0
}

func (d *decoder) uvarint() uint64 { return readVarint(d, binary.Uvarint) }

func (d *decoder) varint() int64 { return readVarint(d, binary.Varint) }

func readVarint[T uint64 | int64](d *decoder, read func([]byte) (T, int)) T {
	if d.err != nil {
		return 0
	}
	v, n := read(d.b)
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

// count reads a element count, each element at least minSize bytes, so
// that a corrupt count cannot make the loader allocate beyond the file.
func (d *decoder) count(minSize int) int {
	n := d.uvarint()
	if n > uint64(len(d.b)/minSize) {
		d.fail("count %d exceeds the file", n)
		return 0
	}
	return int(n)
}

func (d *decoder) str() string {
	return string(d.take(d.count(1)))
}

func (d *decoder) holder() Holder {
	return Holder{Pod: d.str(), Rank: int(d.varint())}
}
