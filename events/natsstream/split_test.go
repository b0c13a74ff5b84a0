package natsstream

import (
	"bytes"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

func newJoiner(maxBytes int) *Replica {
	return &Replica{cfg: ReplicaConfig{MaxBatchBytes: maxBytes}, joining: map[partKey]*joining{}}
}

// part is one message a replica reads: a batch's part header and bytes.
type part struct {
	rank int
	seq  uint64
	hdr  string
	data string
}

func TestReplicaJoinsPartsAndDropsBatchesItCannotJoin(t *testing.T) {
	for _, tc := range []struct {
		name     string
		max      int
		parts    []part
		want     []string // the whole batches, in order
		lost     uint64
		badParts int
	}{
		{name: "unsplit", parts: []part{{data: "abc"}}, want: []string{"abc"}},
		{name: "three parts", parts: []part{{hdr: "0/3", data: "ab"}, {hdr: "1/3", data: "cd"}, {hdr: "2/3", data: "e"}}, want: []string{"abcde"}},
		{name: "another rank between the parts", parts: []part{{hdr: "0/2", data: "ab"}, {rank: 1, data: "x"}, {hdr: "1/2", data: "cd"}},
			want: []string{"x", "abcd"}},
		{name: "no beginning: a replica starting within a batch", parts: []part{{hdr: "1/2", data: "cd"}, {seq: 1, data: "z"}},
			want: []string{"z"}, lost: 1},
		{name: "a part missing", parts: []part{{hdr: "0/3", data: "ab"}, {hdr: "2/3", data: "e"}}, lost: 2},
		{name: "restarted within a batch: the previous holder's parts again", parts: []part{{hdr: "0/2", data: "ab"}, {hdr: "0/2", data: "ab"}, {hdr: "1/2", data: "cd"}},
			want: []string{"abcd"}, lost: 1},
		{name: "a whole batch cuts a joining one short", parts: []part{{hdr: "0/2", data: "ab"}, {seq: 1, data: "z"}}, want: []string{"z"}, lost: 1},
		{name: "another sequence number", parts: []part{{hdr: "0/2", data: "ab"}, {seq: 1, hdr: "1/2", data: "cd"}}, lost: 2},
		{name: "over MaxBatchBytes", max: 3, parts: []part{{hdr: "0/2", data: "ab"}, {hdr: "1/2", data: "cd"}}, lost: 2},
		{name: "bad header", parts: []part{{hdr: "2/2", data: "ab"}, {hdr: "x", data: "ab"}, {hdr: "0/1", data: "ab"}, {hdr: "01/2", data: "ab"}}, badParts: 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newJoiner(tc.max)
			if tc.max == 0 {
				r.cfg.MaxBatchBytes = DefaultMaxBatchBytes
			}
			var got []string
			bad := 0
			for i, p := range tc.parts {
				b, whole, err := r.join(Batch{Model: "m", Pod: "p", Rank: p.rank, Seq: p.seq, Payload: []byte(p.data)}, p.hdr, uint64(i+1))
				if err != nil {
					require.ErrorIs(t, err, ErrBadMessage)
					bad++
					continue
				}
				if whole {
					got = append(got, string(b.Payload))
				}
			}
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.lost, r.partsLost.Load())
			require.Equal(t, tc.badParts, bad)
			held := 0
			for _, j := range r.joining {
				held += len(j.buf)
			}
			require.Equal(t, held, r.joinBytes)
		})
	}
}

// FuzzJoinParts splits a payload as the relay does and hands the parts to
// a replica's joiner, one header perhaps replaced: an intact split joins
// back to the payload, and nothing the headers say makes the joiner
// panic, exceed its bound or lose count of its bytes.
func FuzzJoinParts(f *testing.F) {
	f.Add([]byte("0123456789"), uint8(3), -1, "")
	f.Add([]byte("0123456789"), uint8(4), 1, "0/4")
	f.Add([]byte("ab"), uint8(1), 0, "1/2")
	f.Fuzz(func(t *testing.T, payload []byte, size uint8, at int, hdr string) {
		if size == 0 || len(payload) == 0 {
			return
		}
		r := newJoiner(64)
		n := (len(payload) + int(size) - 1) / int(size)
		var joined []byte
		whole := 0
		for i := range n {
			h := formatPart(i, n)
			if n == 1 {
				h = ""
			}
			if i == at {
				h = hdr
			}
			b, ok, err := r.join(Batch{Pod: "p", Payload: payload[i*int(size) : min((i+1)*int(size), len(payload))]}, h, uint64(i+1))
			if err != nil {
				require.ErrorIs(t, err, ErrBadMessage)
				continue
			}
			if ok {
				whole++
				joined = b.Payload
			}
			require.LessOrEqual(t, r.joinBytes, 64)
			held := 0
			for _, j := range r.joining {
				held += len(j.buf)
			}
			require.Equal(t, held, r.joinBytes)
		}
		if (at < 0 || at >= n) && len(payload) <= 64 {
			require.Equal(t, 1, whole)
			require.True(t, bytes.Equal(payload, joined))
		}
	})
}

// A relay taking the lease goes on after the previous holder's last
// message: after the batch when it was whole or its last part, from the
// batch's beginning when it stopped within it (the duplicate window drops
// the parts it stored).
func TestRelayReconcileRepublishesABatchThePreviousHolderStoppedWithin(t *testing.T) {
	r := &Relay{}
	kept3 := func() *relaySubject {
		s := &relaySubject{subject: "s", total: 3}
		for n := range uint64(3) {
			b := Batch{Model: "m", Pod: "p", Seq: n}
			s.kept = append(s.kept, kept{b: b, id: msgID(b.Model, b.Pod, b.Rank, b.Seq, nil), n: n})
		}
		return s
	}
	for _, tc := range []struct {
		name string
		id   func(s *relaySubject) string
		next uint64
	}{
		{"whole", func(s *relaySubject) string { return s.kept[1].id }, 2},
		{"last part", func(s *relaySubject) string { return s.kept[1].id + "-2/3" }, 2},
		{"within", func(s *relaySubject) string { return s.kept[1].id + "-1/3" }, 1},
		{"first part", func(s *relaySubject) string { return s.kept[0].id + "-0/2" }, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := kept3()
			last := &jetstream.RawStreamMsg{Header: nats.Header{}}
			last.Header.Set(jetstream.MsgIDHeader, tc.id(s))
			r.reconcile(s, 7, last, nil)
			require.Equal(t, tc.next, s.next)
			require.Equal(t, uint64(7), s.term)
		})
	}
}
