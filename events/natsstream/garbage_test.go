package natsstream

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// A replica fed garbage on the stream (messages without kvsource's
// headers, payloads that do not decode, sequence numbers that jump, under
// a thousand pod names) logs each kind of line about once, not once a
// name, and counts every message it dropped.
func TestReplicaFedGarbageLogsEachKindOfLineOnce(t *testing.T) {
	env := startNATS(t)
	_, js := env.connect(t)
	logs := &countingHandler{}
	r := openReplica(t, js, ReplicaConfig{Name: "replica", Logger: slog.New(logs)})
	require.NoError(t, r.WaitReady(context.Background()))
	ctx := context.Background()
	var cfg Config
	const pods = 1000
	empty := []byte{0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0}
	start := time.Now()
	var last uint64
	for i := range pods {
		pod := fmt.Sprintf("10.9.%d.%d:8000", i/250, i%250)
		for _, m := range []*nats.Msg{
			{Subject: cfg.Subject("m", pod), Data: []byte{0x93}}, // no headers
			garbageMsg(cfg, pod, "0", empty),
			garbageMsg(cfg, pod, "1", []byte("not msgpack")),
			garbageMsg(cfg, pod, "5", empty), // a gap: 2 to 4 never came
		} {
			ack, err := js.PublishMsg(ctx, m)
			require.NoError(t, err)
			last = ack.Sequence
		}
	}
	waitApplied(t, last, r)
	elapsed := time.Since(start).Seconds()
	st := r.Status()
	t.Logf("%d warn lines (%d bytes) in %.1fs for %d messages; bad %d, gaps %d", logs.n.Load(), logs.bytes.Load(), elapsed, 4*pods, st.BadMessages, st.Gaps)
	require.Equal(t, uint64(2*pods), st.BadMessages, "no headers, and no msgpack")
	require.Equal(t, uint64(pods), st.Gaps)
	// Each kind may log once a logBudgetInterval: a loaded machine took
	// 21 s, three intervals begun, for what takes 2-3 s alone.
	windows := 1 + int64(time.Since(start)/logBudgetInterval)
	require.LessOrEqual(t, logs.n.Load(), 10*windows, "a line per kind and interval, not per name")
}

func garbageMsg(cfg Config, pod, seq string, payload []byte) *nats.Msg {
	m := nats.NewMsg(cfg.Subject("m", pod))
	m.Header.Set(HeaderModel, "m")
	m.Header.Set(HeaderPod, pod)
	m.Header.Set(HeaderRank, strconv.Itoa(0))
	m.Header.Set(HeaderSeq, seq)
	m.Data = payload
	return m
}
