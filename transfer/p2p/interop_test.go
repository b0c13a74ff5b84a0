//go:build cgo

package p2p

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/internal/testenv"
	"github.com/kvsource/kvsource/transfer"
)

// TestProducerServesAPythonConsumer runs the Go producer against a consumer
// written from the spec in Python (testdata/py_consumer.py). The consumer's
// memory is a region of this process registered with the in-process data
// plane, whose agent metadata the script sends in its connect.
func TestProducerServesAPythonConsumer(t *testing.T) {
	py := testenv.Python(t)
	p, store := newTestProducer(t, 3)
	plane := NewInProcess()
	mem := make([]byte, 4*testBlockLen)
	md, err := plane.Register(mem, testBlockLen)
	require.NoError(t, err)
	t.Cleanup(func() { _ = plane.Close() })

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	args := []string{filepath.Join("testdata", "py_consumer.py"), p.ID(), hex.EncodeToString(md),
		"4096", "4", "128", DefaultHashSeed, hex.EncodeToString(testKey(2)), hex.EncodeToString(testKey(0)),
		hex.EncodeToString(testKey(9))}
	cmd := exec.CommandContext(ctx, py, args...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	require.NoError(t, err)

	var got struct {
		ID               string         `json:"id"`
		ProducerID       string         `json:"producer_id"`
		ProducerConnect  map[string]any `json:"producer_connect"`
		ConnectAckPeerID string         `json:"connect_ack_peer_id"`
		LookupResp       struct {
			Type        string   `json:"type"`
			KVRequestID string   `json:"kv_request_id"`
			Keys        []string `json:"keys"`
			Hits        []bool   `json:"hits"`
		} `json:"lookup_resp"`
		TransferDone  map[string]any `json:"transfer_done"`
		SecondLoad    map[string]any `json:"second_load"`
		UnpinnedFetch map[string]any `json:"unpinned_fetch"`
		AbortAck      map[string]any `json:"abort_ack"`
	}
	require.NoError(t, json.Unmarshal(out, &got), "%s", out)

	require.Equal(t, p.ID(), got.ProducerID)
	require.Equal(t, p.ID(), got.ConnectAckPeerID)
	base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(store.Memory()))))
	require.Equal(t, map[string]any{"type": "connect", "peer_id": p.ID(), "agent_metadata": got.ProducerConnect["agent_metadata"],
		"base_addr": float64(base), "num_blocks": float64(16), "block_len": float64(testBlockLen),
		"config_fingerprint": "", "hash_seed": DefaultHashSeed}, got.ProducerConnect)

	require.Equal(t, "lookup_resp", got.LookupResp.Type)
	require.Equal(t, "py-1", got.LookupResp.KVRequestID)
	require.Equal(t, []string{hex.EncodeToString(testKey(2)), hex.EncodeToString(testKey(0)), hex.EncodeToString(testKey(9))}, got.LookupResp.Keys)
	require.Equal(t, []bool{true, true, false}, got.LookupResp.Hits)
	require.Equal(t, map[string]any{"type": "transfer_done", "kv_request_id": "py-1", "success": true, "round_seq": float64(0)}, got.TransferDone)
	require.Equal(t, map[string]any{"type": "transfer_done", "kv_request_id": "py-1", "success": true, "round_seq": float64(0)}, got.SecondLoad,
		"the request's next load starts at round 0 again, as vLLM's consumer's does")
	require.Equal(t, map[string]any{"type": "transfer_done", "kv_request_id": "py-1", "success": false, "round_seq": float64(0)}, got.UnpinnedFetch)
	require.Equal(t, map[string]any{"type": "abort_ack", "kv_request_id": "py-unknown", "round_seq": float64(7)}, got.AbortAck)

	plane.Sync()
	require.Equal(t, string(repeat('c')), string(mem[:testBlockLen]), "key 2 into block 0")
	require.Equal(t, string(repeat('a')), string(mem[testBlockLen:2*testBlockLen]), "key 0 into block 1")
	require.Equal(t, string(repeat('c')), string(mem[2*testBlockLen:3*testBlockLen]), "key 2 again into block 2")
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.sessions) == 0 && store.Pinned() == 0
	}, waitLong, 10*time.Millisecond, "disconnect ends the session and releases every pin")
}

func repeat(c byte) []byte {
	b := make([]byte, testBlockLen)
	for i := range b {
		b[i] = c
	}
	return b
}

// TestClientPullsFromAPythonProducer runs the Go client against a producer
// written from the spec in Python (testdata/py_producer.py), which names
// itself localhost:port while the client dials 127.0.0.1:port.
func TestClientPullsFromAPythonProducer(t *testing.T) {
	py := testenv.Python(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, filepath.Join("testdata", "py_producer.py"), "128", DefaultHashSeed,
		hex.EncodeToString(testKey(1)), hex.EncodeToString(testKey(2)))
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	lines := bufio.NewScanner(stdout)
	lines.Buffer(make([]byte, 1<<20), 1<<20)
	require.True(t, lines.Scan())
	addr := lines.Text()

	c := newTestClient(t, 4, nil)
	s, err := c.Connect(ctx, addr)
	require.NoError(t, err)
	hits, err := s.Lookup(ctx, []transfer.Key{testKey(1), testKey(3), testKey(2)})
	require.NoError(t, err)
	require.Equal(t, []bool{true, false, true}, hits)
	st, err := s.Fetch(ctx, []transfer.Key{testKey(1), testKey(2)}, []int{3, 0})
	require.NoError(t, err)
	require.Equal(t, 2, st.Blocks)
	_, err = s.Lookup(ctx, []transfer.Key{testKey(3)})
	require.NoError(t, err)
	_, err = s.Fetch(ctx, []transfer.Key{testKey(3)}, []int{0})
	require.ErrorIs(t, err, transfer.ErrMissingKeys)
	require.NoError(t, s.Abort(ctx))
	_, err = s.Fetch(ctx, nil, nil)
	require.NoError(t, err)
	require.NoError(t, s.Close())

	require.True(t, lines.Scan(), "the producer's log")
	var log []map[string]any
	require.NoError(t, json.Unmarshal(lines.Bytes(), &log))
	require.NoError(t, cmd.Wait())

	var types []string
	for _, m := range log {
		require.Equal(t, c.ID(), m["from"], "every message comes from the client's identity")
		types = append(types, m["type"].(string))
	}
	require.Equal(t, []string{"connect", "connect_ack", "lookup", "fetch", "lookup", "fetch", "abort_fetch", "fetch", "disconnect"}, types)
	require.Equal(t, c.ID(), log[0]["peer_id"])
	require.Equal(t, float64(testBlockLen), log[0]["block_len"])
	require.Equal(t, float64(4), log[0]["num_blocks"])
	require.Equal(t, c.ID(), log[1]["peer_id"], "connect_ack names the client")
	require.Equal(t, []any{float64(3), float64(0)}, log[3]["block_indexes"])
	rounds := []any{log[2]["round_seq"], log[3]["round_seq"], log[4]["round_seq"], log[5]["round_seq"], log[6]["round_seq"], log[7]["round_seq"]}
	require.Equal(t, []any{float64(0), float64(0), float64(1), float64(1), float64(2), float64(3)}, rounds,
		"each fetch and abort closes its round; the empty fetch ends the request in the next")
	require.Equal(t, []any{}, log[7]["keys"])
}
