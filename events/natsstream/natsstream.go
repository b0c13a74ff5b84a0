package natsstream

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/zeebo/xxh3"
)

// Errors callers branch on.
var (
	// ErrConfig: a Config cannot work.
	ErrConfig = errors.New("natsstream: bad config")
	// ErrBadMessage: a stream message lacks kvsource's headers or has a
	// malformed one; it is dropped and counted.
	ErrBadMessage = errors.New("natsstream: bad stream message")
)

// Header names of a stream message. The payload is the engine's msgpack
// batch as it was received.
const (
	HeaderModel = "Kvs-Model"
	HeaderPod   = "Kvs-Pod"
	HeaderRank  = "Kvs-Rank"
	HeaderSeq   = "Kvs-Seq"
	// HeaderPart, "i/n", marks part i (from 0) of n of a batch too big
	// for one message: its payload is the batch's bytes from i times the
	// part size on, and a consumer joins the n parts, which follow one
	// another among the holder's messages, into the batch.
	HeaderPart = "Kvs-Part"
)

// Defaults of Config.
const (
	DefaultStream          = "KVSOURCE_EVENTS"
	DefaultSubjectPrefix   = "kvsource.events"
	DefaultDuplicateWindow = 2 * time.Minute
)

// Config names the JetStream resources a fleet of relays and replicas
// shares and how they are created. The zero value uses the defaults; every
// member of a fleet must use the same Config.
type Config struct {
	// Stream is the event stream's name; default DefaultStream. The
	// buckets are named after it: <Stream>_RELAY and <Stream>_SNAPLEASE
	// (leases), <Stream>_SNAPSHOTS (the object store), <Stream>_PULLS
	// (fleet-wide in-flight pulls).
	Stream string
	// SubjectPrefix is the subjects' first tokens; default
	// DefaultSubjectPrefix. A batch of model m and pod p goes to
	// <prefix>.<EscapeToken(m)>.<EscapeToken(p)>.
	SubjectPrefix string
	// Replicas is the JetStream replication factor of the stream and the
	// buckets; default 1. Use 3 on a NATS cluster.
	Replicas int
	// Memory keeps the stream and buckets in memory rather than on disk
	// (tests, benchmarks): a NATS server restart then loses them.
	Memory bool
	// DuplicateWindow is the stream's deduplication window; default
	// DefaultDuplicateWindow. Two relays publishing the same batch within
	// it store it once (see the package doc).
	DuplicateWindow time.Duration
	// Bind makes a replica (Open, and natsfleet.NewSources on it) use the event
	// stream and the relays' buckets (<Stream>_RELAY, <Stream>_SOURCES)
	// as the relays created them, never creating or updating them: for
	// replicas whose NATS user has only the permissions
	// Permissions(RoleReplica) lists, which cannot change what relays
	// publish. The relays must have created them first. Relays ignore it.
	Bind bool
}

// WithDefaults returns c with its defaults filled in.
func (c Config) WithDefaults() Config {
	if c.Stream == "" {
		c.Stream = DefaultStream
	}
	if c.SubjectPrefix == "" {
		c.SubjectPrefix = DefaultSubjectPrefix
	}
	if c.Replicas <= 0 {
		c.Replicas = 1
	}
	if c.DuplicateWindow <= 0 {
		c.DuplicateWindow = DefaultDuplicateWindow
	}
	return c
}

func (c Config) storage() jetstream.StorageType {
	if c.Memory {
		return jetstream.MemoryStorage
	}
	return jetstream.FileStorage
}

// Subject returns the subject a batch of model from pod is stored under.
func (c Config) Subject(model, pod string) string {
	c = c.WithDefaults()
	return c.SubjectPrefix + "." + EscapeToken(model) + "." + EscapeToken(pod)
}

// ModelFilter returns the subject filter of every pod's batches of model,
// what a replica sharded by model consumes.
func (c Config) ModelFilter(model string) string {
	c = c.WithDefaults()
	return c.SubjectPrefix + "." + EscapeToken(model) + ".*"
}

// ensureStream creates the event stream or updates it to this Config.
// Retention is by limits with none set: only purges after a shared
// snapshot (Replica) remove messages, so that snapshot plus stream always
// cover the state.
func (c Config) ensureStream(ctx context.Context, js jetstream.JetStream) (jetstream.Stream, error) {
	if c.Bind {
		s, err := js.Stream(ctx, c.Stream)
		if err != nil {
			return nil, fmt.Errorf("natsstream: stream %s (Bind: a relay creates it): %w", c.Stream, err)
		}
		return s, nil
	}
	s, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        c.Stream,
		Description: "kvsource: vLLM KV-cache event batches, one subject per model and pod",
		Subjects:    []string{c.SubjectPrefix + ".>"},
		Retention:   jetstream.LimitsPolicy,
		Storage:     c.storage(),
		Replicas:    c.Replicas,
		Duplicates:  c.DuplicateWindow,
		AllowDirect: true,
	})
	if err != nil {
		return nil, fmt.Errorf("natsstream: stream %s: %w", c.Stream, err)
	}
	return s, nil
}

// KeyValue creates the fleet's key-value bucket <Stream><suffix> (suffix
// "_PULLS", say) or updates it to this Config and ttl, its keys' expiries
// seen by watchers as deletions; with Bind, the relays' buckets (_RELAY,
// _SOURCES) are used as the relays created them.
func (c Config) KeyValue(ctx context.Context, js jetstream.JetStream, suffix string, ttl time.Duration) (jetstream.KeyValue, error) {
	c = c.WithDefaults()
	if c.Bind && (suffix == "_RELAY" || suffix == "_SOURCES") {
		kv, err := js.KeyValue(ctx, c.Stream+suffix)
		if err != nil {
			return nil, fmt.Errorf("natsstream: bucket %s%s (Bind: a relay creates it): %w", c.Stream, suffix, err)
		}
		return kv, nil
	}
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:   c.Stream + suffix,
		TTL:      ttl,
		Storage:  c.storage(),
		Replicas: c.Replicas,
		// Delete markers when TTL removes a key, so that watchers see
		// expiries (fleet pulls) as they see deletions.
		LimitMarkerTTL: ttl,
	})
	if err != nil {
		return nil, fmt.Errorf("natsstream: bucket %s%s: %w", c.Stream, suffix, err)
	}
	return kv, nil
}

// msgID is the Nats-Msg-Id of a batch: a hash of where it comes from, its
// sequence number and its bytes. Two relays receiving the same batch from
// an engine compute the same id; a restarted engine reusing a sequence
// number sends other bytes (at least its timestamp differs), so its batch
// is not taken for the old one.
func msgID(model, pod string, rank int, seq uint64, payload []byte) string {
	h := xxh3.New()
	var n [8]byte
	for _, s := range []string{model, pod} {
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.WriteString(s)
	}
	binary.LittleEndian.PutUint64(n[:], uint64(rank))
	h.Write(n[:])
	binary.LittleEndian.PutUint64(n[:], seq)
	h.Write(n[:])
	h.Write(payload)
	sum := h.Sum128().Bytes()
	return hex.EncodeToString(sum[:])
}

// Batch is one engine batch as it travels on the stream.
type Batch struct {
	Model, Pod string
	Rank       int
	Seq        uint64
	Payload    []byte
}

// message is b as the relay appends it, with id (msgID of b) as its
// Nats-Msg-Id.
func (c Config) message(b Batch, id string) *nats.Msg {
	m := nats.NewMsg(c.Subject(b.Model, b.Pod))
	m.Header.Set(HeaderModel, b.Model)
	m.Header.Set(HeaderPod, b.Pod)
	m.Header.Set(HeaderRank, strconv.Itoa(b.Rank))
	m.Header.Set(HeaderSeq, strconv.FormatUint(b.Seq, 10))
	m.Header.Set(jetstream.MsgIDHeader, id)
	m.Data = b.Payload
	return m
}

// parseBatch reads a stream message back into a Batch; the payload aliases
// data.
func parseBatch(h nats.Header, data []byte) (Batch, error) {
	b := Batch{Model: h.Get(HeaderModel), Pod: h.Get(HeaderPod), Payload: data}
	if b.Pod == "" {
		return b, fmt.Errorf("%w: no %s header", ErrBadMessage, HeaderPod)
	}
	rank, err := strconv.Atoi(h.Get(HeaderRank))
	if err != nil || rank < 0 {
		return b, fmt.Errorf("%w: %s %q", ErrBadMessage, HeaderRank, h.Get(HeaderRank))
	}
	seq, err := strconv.ParseUint(h.Get(HeaderSeq), 10, 64)
	if err != nil {
		return b, fmt.Errorf("%w: %s %q", ErrBadMessage, HeaderSeq, h.Get(HeaderSeq))
	}
	b.Rank, b.Seq = rank, seq
	return b, nil
}

// formatPart is HeaderPart's value of part i of n.
func formatPart(i, n int) string { return strconv.Itoa(i) + "/" + strconv.Itoa(n) }

// parsePart reads HeaderPart's value: part i (from 0) of n.
func parsePart(v string) (i, n int, err error) {
	a, b, ok := strings.Cut(v, "/")
	i, err1 := strconv.Atoi(a)
	n, err2 := strconv.Atoi(b)
	if !ok || err1 != nil || err2 != nil || i < 0 || n < 2 || i >= n || a != strconv.Itoa(i) || b != strconv.Itoa(n) {
		return 0, 0, fmt.Errorf("%w: %s %q", ErrBadMessage, HeaderPart, v)
	}
	return i, n, nil
}
