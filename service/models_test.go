package service

import (
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/internal/testenv"
)

// A pod killed and replaced on its IP by an engine serving another model
// (Kubernetes reuses pod IPs) is no pull source for the dead engine's
// model, and /v1/pods lists it once, under its new model: the subscriber
// binding and connecting, vLLM's map layout and SGLang's array layout.
func TestServeARestartedEngineServingAnotherModelIsNoSourceForTheOld(t *testing.T) {
	for _, mode := range []string{"bind", "connect"} {
		for _, layout := range []events.Layout{events.LayoutMap, events.LayoutArray} {
			t.Run(fmt.Sprintf("%s %s", mode, layout), func(t *testing.T) {
				port := testenv.FreePort(t)
				ep := fmt.Sprintf("tcp://127.0.0.1:%d", port)
				const pod = "127.0.0.1:8001"
				h := index.Holder{Pod: pod}
				var args []string
				if mode == "bind" {
					args = []string{"--events-bind", ep}
				} else {
					args = []string{"--events-connect", pod + "=" + ep}
				}
				s, base := startServe(t, args...)
				engine := func(model string) *zmq.Publisher {
					cfg := zmq.PublisherConfig{Topic: "kv@" + pod + "@" + model, Layout: layout}
					if mode == "bind" {
						cfg.Connect = ep
					} else {
						cfg.Bind = ep
					}
					p, err := zmq.NewPublisher(cfg)
					require.NoError(t, err)
					t.Cleanup(func() { _ = p.Close() })
					require.NoError(t, p.WaitSubscribed(t.Context()))
					return p
				}
				hasher, err := hashing.New(hashing.Config{})
				require.NoError(t, err)
				tokens := make([]uint32, 4*16)
				keys, err := hasher.BlockKeys(nil, hashing.Request{Tokens: tokens})
				require.NoError(t, err)
				pick := map[string]any{"model": "m", "tokens": tokens, "destination": "127.0.0.1:8008", "request_id": "r"}

				old := engine("m")
				seq, err := old.Publish(&events.Batch{TS: 1, Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: keys, BlockSize: 16, Medium: "CPU"}}})
				require.NoError(t, err)
				require.NoError(t, s.sub.WaitApplied(t.Context(), h, seq))
				require.Eventually(t, func() bool { _, ok := s.sub.Source(h); return ok }, 15*time.Second, 5*time.Millisecond)
				d, body := pickOf(t, base, pick)
				require.NotNil(t, d.Source, "%s", body)
				require.Equal(t, pod, *d.Source)

				require.NoError(t, old.Close())
				require.Eventually(t, func() bool { st, _ := s.sub.Source(h); return st == events.StateDisconnected }, 15*time.Second, 5*time.Millisecond)
				fresh := engine("m2")
				_, err = fresh.Publish(&events.Batch{TS: 1, Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: []uint64{7}, BlockSize: 16, Medium: "GPU"}}})
				require.NoError(t, err)
				require.Eventually(t, func() bool {
					for _, st := range s.sub.Status() {
						if st.Holder() == h {
							return st.Model == "m2" && st.State == events.StateLive
						}
					}
					return false
				}, 15*time.Second, 5*time.Millisecond)

				d, body = pickOf(t, base, pick)
				require.Nil(t, d.Source, "the new engine was named the source of the old one's blocks: %s", body)
				require.Zero(t, d.SkippedSources, "nor are they listed under it: %s", body)
				code, body := call(t, "GET", base+"/v1/pods", nil)
				require.Equal(t, 200, code)
				var pods struct{ Pods []Pod }
				require.NoError(t, json.Unmarshal(body, &pods))
				require.Len(t, pods.Pods, 1, "one row, no stale one for the old model: %s", body)
				require.Equal(t, map[string]int{"GPU": 1, "CPU": 0}, podsByHolder(t, base)[h].Blocks)
			})
		}
	}
}

// One sender naming a new model of 498 bytes on every message (20,000
// such names held 209 MiB and listed 19,999 stale rows) leaves one
// model: a holder's entries follow its current model, and the index frees
// a model nobody holds.
func TestServeModelNamesOfOneSenderDoNotAccumulate(t *testing.T) {
	port := testenv.FreePort(t)
	s, base := startServe(t, "--events-bind", fmt.Sprintf("tcp://127.0.0.1:%d", port))
	a := newServeAttacker(t, "127.0.0.1", port)
	prefix := strings.Repeat("m", 490)
	const names = 20_000
	heap := func() int64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return int64(m.HeapAlloc)
	}
	before := heap()
	for i := range names {
		a.send(fmt.Sprintf("kv@127.0.0.1:9000@%s-%07d", prefix, i), uint64(i),
			&events.Batch{Events: []events.Event{{Type: events.EventBlockStored, BlockHashes: []uint64{uint64(i + 1)}, BlockSize: 16, Medium: "GPU"}}})
	}
	h := index.Holder{Pod: "127.0.0.1:9000"}
	require.NoError(t, s.sub.WaitApplied(t.Context(), h, names-1))
	grew := heap() - before
	st := s.idx.Stats()
	t.Logf("%d model names of %d bytes from one sender: heap %+d KiB, %d models, %d holders", names, len(prefix)+8, grew>>10, st.Models, st.Holders)
	require.Equal(t, 1, st.Models)
	pods := podsByHolder(t, base)
	require.Len(t, pods, 1, "no stale rows of the models the sender dropped")
	require.Equal(t, fmt.Sprintf("%s-%07d", prefix, names-1), pods[h].Model)
	require.Less(t, grew, int64(32<<20))
}
