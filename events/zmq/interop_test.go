//go:build cgo

package zmq

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/internal/eventstest"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// runPyPublisher runs the shared model of vLLM's publisher with args,
// feeding it batches as JSON lines, and waits for it to exit.
func runPyPublisher(t *testing.T, args []string, batches ...map[string]any) {
	t.Helper()
	python := testenv.Python(t)
	var in bytes.Buffer
	for _, b := range batches {
		line, err := json.Marshal(b)
		require.NoError(t, err)
		in.Write(append(line, '\n'))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Short waits keep the package's tests fast; args may override them.
	args = append([]string{testenv.Data(t, "interop", "vllm_publisher.py"), "--warmup", "0.3", "--linger", "0.2"}, args...)
	cmd := exec.CommandContext(ctx, python, args...)
	cmd.Stdin = &in
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "publisher output:\n%s", out)
}

// pyPublisher is a running model of vLLM's publisher that the test feeds
// batches as it goes, for tests that must first know the subscription is
// in place.
type pyPublisher struct {
	t      *testing.T
	in     io.WriteCloser
	out    testenv.SyncBuffer
	exited chan error
}

// startPyPublisher starts the publisher with args and no warm-up: the test
// waits with handshake instead.
func startPyPublisher(t *testing.T, args ...string) *pyPublisher {
	t.Helper()
	python := testenv.Python(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	args = append([]string{testenv.Data(t, "interop", "vllm_publisher.py"), "--warmup", "0", "--linger", "0.2"}, args...)
	cmd := exec.CommandContext(ctx, python, args...)
	p := &pyPublisher{t: t, exited: make(chan error, 1)}
	cmd.Stdout, cmd.Stderr = &p.out, &p.out
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	p.in = in
	require.NoError(t, cmd.Start())
	go func() { p.exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.in.Close()
		<-p.exited
	})
	return p
}

// send has the publisher publish batches, in order.
func (p *pyPublisher) send(batches ...map[string]any) {
	p.t.Helper()
	for _, b := range batches {
		line, err := json.Marshal(b)
		require.NoError(p.t, err)
		_, err = p.in.Write(append(line, '\n'))
		require.NoError(p.t, err, "publisher output:\n%s", p.out.String())
	}
}

// handshake publishes empty batches until s has applied one of h's: a PUB
// socket drops what it sends before the subscription reaches it, and sends
// everything after. It returns how many it published, the sequence number
// of the publisher's next batch.
func (p *pyPublisher) handshake(s *Subscriber, h index.Holder) uint64 {
	p.t.Helper()
	var n uint64
	deadline := time.Now().Add(waitLong)
	for time.Now().Before(deadline) {
		p.send(map[string]any{"events": []any{}, "dp_rank": h.Rank})
		n++
		// One empty batch per 50 ms at most; one applied ends the wait.
		for range 10 {
			if _, ok := s.LastSeq(h); ok {
				return n
			}
			select {
			case err := <-p.exited:
				p.t.Fatalf("publisher exited during the handshake: %v\n%s", err, p.out.String())
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
	p.t.Fatalf("no batch of %d published reached the subscriber", n)
	return 0
}

// wait closes the publisher's input and waits for it to exit cleanly.
func (p *pyPublisher) wait() {
	p.t.Helper()
	require.NoError(p.t, p.in.Close())
	select {
	case err := <-p.exited:
		p.exited <- err // for the cleanup
		require.NoError(p.t, err, "publisher output:\n%s", p.out.String())
	case <-time.After(waitLong):
		p.t.Fatalf("publisher did not exit:\n%s", p.out.String())
	}
}

func pyStored(hashes []uint64, parent any, tokens []uint32, extra ...any) map[string]any {
	if tokens == nil {
		tokens = []uint32{}
	}
	ev := map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
		"token_ids": tokens, "block_size": 4}
	if len(extra) == 2 {
		ev[extra[0].(string)] = extra[1]
	}
	return ev
}

func pyBatch(events ...map[string]any) map[string]any {
	return map[string]any{"events": events, "dp_rank": 0, "ts": 1.5}
}

func seqTokens(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

// interopEvents stores a chain 1-2-3 in GPU, evicts 1 from GPU and
// offloads 2 to CPU with a legacy token-less event.
var interopEvents = []map[string]any{
	pyBatch(pyStored([]uint64{1, 2}, nil, seqTokens(0, 8))),
	pyBatch(pyStored([]uint64{3}, 2, seqTokens(8, 4))),
	pyBatch(map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{1}, "medium": "GPU"},
		pyStored([]uint64{2}, nil, nil, "medium", "CPU")),
}

func TestInteropWithVLLMPublisherModel(t *testing.T) {
	const topic = "kv@127.0.0.1:8000@org/llama@v2"
	h := index.Holder{Pod: "127.0.0.1:8000"}
	tests := []struct {
		name    string
		bind    bool // the subscriber binds, the engine connects
		args    []string
		batches []map[string]any
		gpu     []uint64
		cpu     []uint64
	}{
		{"bind mode, map layout", true, []string{"--layout", "map"}, interopEvents, []uint64{2, 3}, []uint64{2}},
		{"connect mode, array layout", false, []string{"--layout", "array"}, interopEvents, []uint64{2, 3}, []uint64{2}},
		{"connect mode, v0.9 arrays", false, []string{"--layout", "array", "--trim", "5"}, interopEvents[:2], []uint64{1, 2, 3}, nil},
		{"bind mode, raw digest hashes", true, []string{"--layout", "map"}, []map[string]any{
			{"events": []any{map[string]any{"type": "BlockStored", "block_hashes": []any{map[string]any{"hex": "00ff000000000000000000000000000000000000000000000000000000000009"}},
				"parent_block_hash": nil, "token_ids": seqTokens(0, 4), "block_size": 4}}},
		}, []uint64{9}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tee := eventstest.NewTeeSink()
			sink := tee.Rec
			cfg := SubscriberConfig{Events: events.Config{Sink: tee}, TopicPrefix: "kv@"}
			args := append([]string{"--topic", topic}, tc.args...)
			var s *Subscriber
			if tc.bind {
				// Port 0: a port picked free beforehand may be taken by
				// then, as the local end of another test's connection.
				cfg.Bind = []string{localEP(0)}
				s = startSubscriber(t, cfg)
				args = append(args, "--endpoint", s.Addrs()[0])
			} else {
				port := testenv.FreePort(t)
				args = append(args, "--endpoint", anyEP(port))
				s = startSubscriber(t, cfg)
				require.NoError(t, s.AddPod(h.Pod, localEP(port), ""))
			}
			pub := startPyPublisher(t, args...)
			first := pub.handshake(s, h)
			pub.send(tc.batches...)
			pub.wait()
			requireKeys(t, sink, "org/llama@v2", h, "GPU", tc.gpu...)
			requireKeys(t, sink, "org/llama@v2", h, "CPU", tc.cpu...)
			requireIndexHolds(t, tee.Index, "org/llama@v2", h, map[string][]uint64{"GPU": tc.gpu, "CPU": tc.cpu})
			settled(t, s)
			st := statusOf(s, h)
			require.Equal(t, first+uint64(len(tc.batches)-1), st.LastSeq)
			require.Zero(t, st.Gaps)
			require.Zero(t, s.Stats().DecodeErrors)
		})
	}
}

func TestInteropDroppedSequenceIsReplayedInBothFormats(t *testing.T) {
	for _, format := range []string{"v26", "v25"} {
		for _, bind := range []bool{false, true} {
			t.Run(format+"/bind="+strconv.FormatBool(bind), func(t *testing.T) {
				t.Parallel()
				port, rport := testenv.FreePort(t), testenv.FreePort(t)
				tee := eventstest.NewTeeSink()
				sink := tee.Rec
				cfg := SubscriberConfig{Events: events.Config{Sink: tee}}
				args := []string{"--topic", "kv@pod@m", "--replay", localEP(rport), "--replay-layout", format,
					"--drop-seq", "1", "--drop-seq", "2", "--linger", "0.5"}
				if bind {
					cfg.Bind = []string{localEP(port)}
					args = append(args, "--endpoint", localEP(port))
				} else {
					args = append(args, "--endpoint", anyEP(port))
				}
				s := startSubscriber(t, cfg)
				if bind {
					require.NoError(t, s.AddPod("pod", "", localEP(rport)))
				} else {
					require.NoError(t, s.AddPod("pod", localEP(port), localEP(rport)))
				}
				runPyPublisher(t, args,
					pyBatch(pyStored([]uint64{1}, nil, seqTokens(0, 4))),
					pyBatch(pyStored([]uint64{2}, 1, seqTokens(4, 4))),
					pyBatch(map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{1}, "medium": "GPU"}),
					pyBatch(pyStored([]uint64{3}, 2, seqTokens(8, 4))),
				)
				h := index.Holder{Pod: "pod"}
				requireKeys(t, sink, "m", h, "GPU", 2, 3)
				requireIndexHolds(t, tee.Index, "m", h, map[string][]uint64{"GPU": {2, 3}})
				// The replayed batch linked 2 to 1: the chain from block 2 is whole.
				require.Equal(t, 2, tee.Index.Run("m", h, []uint64{1, 2, 3}, 1, nil))
				settled(t, s)
				st := statusOf(s, h)
				require.Equal(t, uint64(1), st.Gaps)
				require.Equal(t, uint64(1), st.Replays)
				require.Zero(t, st.Unrecovered)
				require.Zero(t, sink.ClearCount(h))
				require.Equal(t, uint64(3), st.LastSeq)
			})
		}
	}
}

func TestInteropEngineRestartClearsTheHolder(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	tee := eventstest.NewTeeSink()
	sink := tee.Rec
	s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: tee}, Bind: []string{localEP(port)}})
	args := []string{"--topic", "kv@pod@m", "--endpoint", localEP(port)}
	h := index.Holder{Pod: "pod"}
	runPyPublisher(t, args, interopEvents...)
	requireKeys(t, sink, "m", h, "GPU", 2, 3)
	runPyPublisher(t, args, pyBatch(pyStored([]uint64{7}, nil, seqTokens(100, 4))))
	requireKeys(t, sink, "m", h, "GPU", 7)
	requireKeys(t, sink, "m", h, "CPU")
	requireIndexHolds(t, tee.Index, "m", h, map[string][]uint64{"GPU": {7}})
	settled(t, s)
	st := statusOf(s, h)
	require.Equal(t, uint64(1), st.Restarts)
	require.Equal(t, uint64(0), st.LastSeq)
}

func TestInteropHashMismatchIsReportedOnlyForAnotherSeed(t *testing.T) {
	engine, err := hashing.New(hashing.Config{Algo: hashing.SHA256CBOR, Seed: "engine-seed", BlockSize: 4})
	require.NoError(t, err)
	tokens := seqTokens(500, 8)
	plain, err := engine.BlockKeys(nil, hashing.Request{Tokens: tokens})
	require.NoError(t, err)
	lora, err := engine.BlockKeys(nil, hashing.Request{Tokens: tokens, LoRAName: "my-lora"})
	require.NoError(t, err)
	batches := []map[string]any{
		pyBatch(pyStored(plain, nil, tokens)),
		pyBatch(pyStored(lora, nil, tokens, "extra_keys", [][]string{{"my-lora"}, {"my-lora"}})),
		pyBatch(pyStored(lora, nil, tokens, "lora_name", "my-lora")),
	}
	tests := []struct {
		name       string
		cfg        hashing.Config
		mismatches uint64
		// cause is in the log line: the diagnosis of the likely cause.
		cause string
	}{
		{"same settings", hashing.Config{Algo: hashing.SHA256CBOR, Seed: "engine-seed", BlockSize: 4}, 0, ""},
		// An uncommon seed is not found: the diagnosis names random seeds.
		{"another seed", hashing.Config{Algo: hashing.SHA256CBOR, Seed: "router-seed", BlockSize: 4}, 3, hashing.DefaultSeedChange},
		{"another algorithm", hashing.Config{Algo: hashing.SHA256, Seed: "engine-seed", BlockSize: 4}, 3, "set --algo sha256_cbor"},
		{"another block size", hashing.Config{Algo: hashing.SHA256CBOR, Seed: "engine-seed", BlockSize: 16}, 3, "set --block-size 4"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			router, err := hashing.New(tc.cfg)
			require.NoError(t, err)
			sink := eventstest.NewRecSink()
			var logs testenv.SyncBuffer
			s := startSubscriber(t, SubscriberConfig{Events: events.Config{Sink: sink, Hasher: router, Logger: testenv.TextLogger(&logs)}, Bind: []string{localEP(0)}})
			h := index.Holder{Pod: "pod"}
			pub := startPyPublisher(t, "--topic", "kv@pod@m", "--endpoint", s.Addrs()[0])
			first := pub.handshake(s, h)
			pub.send(batches...)
			pub.wait()
			// Wait for the last batch to be applied whole: its check, its
			// mismatch count and its log line come in that order.
			require.Eventually(t, func() bool { seq, ok := s.LastSeq(h); return ok && seq == first+uint64(len(batches)-1) },
				waitLong, 10*time.Millisecond)
			st := statusOf(s, h)
			require.Equal(t, uint64(3), st.HashChecks)
			require.Equal(t, tc.mismatches, st.HashMismatches)
			require.Equal(t, tc.mismatches, s.Stats().HashMismatches)
			if tc.mismatches == 0 {
				require.NotContains(t, logs.String(), "disagree")
				return
			}
			require.Eventually(t, func() bool { return strings.Contains(logs.String(), "disagree") }, waitLong, 5*time.Millisecond)
			require.Equal(t, 1, bytes.Count([]byte(logs.String()), []byte("disagree")), "one log line per holder and interval")
			require.Contains(t, logs.String(), tc.cause)
			require.Contains(t, logs.String(), "pod=pod")
		})
	}
}

// requireIndexHolds checks that ix holds exactly want (tier -> keys) for h.
func requireIndexHolds(t *testing.T, ix *index.Index, model string, h index.Holder, want map[string][]uint64) {
	t.Helper()
	counts := map[string]int{}
	for tier, keys := range want {
		if len(keys) > 0 {
			counts[tier] = len(keys)
		}
		for _, k := range keys {
			require.Equal(t, 1, ix.Run(model, h, []uint64{k}, 0, []string{tier}), "tier %s block %d", tier, k)
		}
	}
	require.Equal(t, counts, ix.HolderBlocks(model, h))
}
