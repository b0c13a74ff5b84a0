package service

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/internal/testenv"
)

// The load run of issue 14: the built kvsource serve on loopback, clients
// posting 20,000-token /v1/pick requests as next turns of their own
// conversations (each request changes its prompt from token 19,456 on, so
// 64 of its 1,250 blocks are new), while four engines publish KV events
// into --events-bind at loadBlocksPerSec. Bounded: each case stops
// after loadWindow or loadMaxRequests, whichever comes first.
const (
	loadTokens       = 20000
	loadStable       = 19456 // tokens shared by every turn of a client
	loadBlocksPerSec = 250_000
	loadWarmup       = time.Second
	loadWindow       = 8 * time.Second
	loadMaxRequests  = 40_000
	loadPods         = 4
)

// TestServeLoad runs only with KVSOURCE_LOAD=1, which make bench sets; it
// prints picks/s, p50 and p99 per case and fails on any request that does
// not get a 200 pull answer, or when the service applies less than 200K
// blocks/s of the events.
func TestServeLoad(t *testing.T) {
	if os.Getenv("KVSOURCE_LOAD") == "" {
		t.Skip("the load run is part of make bench (KVSOURCE_LOAD=1)")
	}
	bin := buildServeBinary(t)
	var rows []string
	for _, lc := range []struct {
		name    string
		clients int
		b64     bool
		args    []string
	}{
		{"JSON tokens, hash cache on, 8 clients", 8, false, nil},
		{"JSON tokens, hash cache off, 8 clients", 8, false, []string{"--hash-cache-bytes", "0"}},
		{"tokens_b64, hash cache on, 8 clients", 8, true, nil},
		{"JSON tokens, hash cache on, 32 clients", 32, false, nil},
	} {
		t.Run(lc.name, func(t *testing.T) {
			rows = append(rows, fmt.Sprintf("| %s | %s |", lc.name, loadRun(t, bin, lc.clients, lc.b64, lc.args)))
		})
	}
	fmt.Printf("\n| case | picks/s | p50 ms | p99 ms | ingest blocks/s | hash-cache hit ratio |\n|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Println(r)
	}
}

// loadRun runs one case and returns its table cells.
func loadRun(t *testing.T, bin string, clients int, b64 bool, args []string) string {
	bindPort := testenv.FreePort(t)
	bind := fmt.Sprintf("tcp://127.0.0.1:%d", bindPort)
	// Up to 32 clients at once: the in-flight limit (4 here by default,
	// twice the cores) would answer the rest 503, which is admission
	// control, not what this run measures.
	srv := startServeBinary(t, bin, append([]string{"--events-bind", bind, "--max-inflight-requests", "64"}, args...)...)
	defer srv.stop(t)

	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	pubs := make([]*zmq.Publisher, loadPods)
	for i := range pubs {
		pubs[i], err = zmq.NewPublisher(zmq.PublisherConfig{Connect: bind, Topic: fmt.Sprintf("kv@127.0.0.1:%d@m", 9000+i)})
		require.NoError(t, err)
		defer pubs[i].Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(t, pubs[i].WaitSubscribed(ctx))
		cancel()
	}

	// Each client's conversation: pod 0, the destination, holds a quarter
	// of its stable part on GPU, pod 1 all of it on CPU.
	r := rand.New(rand.NewPCG(14, 2))
	bodies := make([][]byte, clients)
	offsets := make([]int, clients)
	turnTokens := make([][]uint32, clients)
	for c := range clients {
		tokens := make([]uint32, loadTokens)
		for i := range tokens {
			tokens[i] = uint32(r.IntN(150000))
		}
		for i := loadStable; i < len(tokens); i++ {
			tokens[i] = 100000 + tokens[i]%50000 // 6 digits, so a turn rewrites its first in place
		}
		keys, err := h.BlockKeys(nil, hashing.Request{Tokens: tokens[:loadStable]})
		require.NoError(t, err)
		for _, st := range []struct {
			pod    int
			medium string
			keys   []uint64
		}{{0, "GPU", keys[:len(keys)/4]}, {1, "CPU", keys}} {
			_, err := pubs[st.pod].Publish(&events.Batch{Events: []events.Event{
				{Type: events.EventBlockStored, BlockHashes: st.keys, BlockSize: 16, Medium: st.medium}}})
			require.NoError(t, err)
		}
		var b bytes.Buffer
		fmt.Fprintf(&b, `{"model":"m","request_id":"client-%d","destination":"127.0.0.1:9000","candidates":[`, c)
		for p := 1; p < loadPods; p++ {
			if p > 1 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, `{"pod":"127.0.0.1:%d","waiting":%d}`, 9000+p, p)
		}
		if b64 {
			// A turn rewrites tokens 19,455 to 19,457, whose 12 bytes are
			// 16 base64 characters of their own (19,455 * 4 is a multiple
			// of 3).
			turnTokens[c] = tokens[loadStable-1 : loadStable+2]
			b.WriteString(`],"tokens_b64":"`)
			offsets[c] = b.Len() + (loadStable-1)*4/3*4
			b.WriteString(tokensB64(tokens))
			b.WriteString(`"}`)
			bodies[c] = b.Bytes()
			continue
		}
		b.WriteString(`],"tokens":[`)
		for i, tok := range tokens {
			if i > 0 {
				b.WriteByte(',')
			}
			if i == loadStable {
				offsets[c] = b.Len()
			}
			b.WriteString(strconv.Itoa(int(tok)))
		}
		b.WriteString("]}")
		bodies[c] = b.Bytes()
	}
	require.Eventually(t, func() bool {
		_, m := call(t, "GET", srv.base+"/metrics", nil)
		n, _ := strconv.ParseFloat(metricValue(m, "kvsource_events_events_total"), 64)
		return int(n) == 2*clients
	}, 15*time.Second, 20*time.Millisecond, "the conversations' blocks were not applied")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for i, p := range pubs {
		wg.Go(func() { loadIngest(ctx, t, p, i) })
	}

	var (
		measureAt = time.Now().Add(loadWarmup)
		stopAt    = measureAt.Add(loadWindow)
		issued    atomic.Int64
		failures  atomic.Int64
		firstErr  atomic.Pointer[error] // an atomic.Value panics on the second error type
		lat       = make([][]time.Duration, clients)
	)
	var cw sync.WaitGroup
	for c := range clients {
		cw.Go(func() {
			body, off := bodies[c], offsets[c]
			conn, err := newServeLoadConn(srv.base, len(body))
			if err != nil {
				failures.Add(1)
				firstErr.CompareAndSwap(nil, &err)
				return
			}
			defer conn.close()
			for turn := 0; ; turn++ {
				now := time.Now()
				if now.After(stopAt) || issued.Add(1) > loadMaxRequests {
					return
				}
				if b64 {
					var raw [12]byte
					tt := turnTokens[c]
					tt[0] = uint32(c*7919+turn) % 150000
					for k, tok := range tt {
						binary.LittleEndian.PutUint32(raw[4*k:], tok)
					}
					base64.StdEncoding.Encode(body[off:off+16], raw[:])
				} else {
					copy(body[off:], strconv.Itoa(100000+(c*7919+turn)%900000))
				}
				t0 := time.Now()
				code, out, err := conn.post(body)
				if err == nil && (code != http.StatusOK || !bytes.Contains(out, []byte(`"reason":"pull"`))) {
					err = fmt.Errorf("status %d: %.200s", code, out)
				}
				d := time.Since(t0)
				if err != nil {
					failures.Add(1)
					firstErr.CompareAndSwap(nil, &err)
					continue
				}
				if t0.After(measureAt) {
					lat[c] = append(lat[c], d)
				}
			}
		})
	}
	time.Sleep(time.Until(measureAt)) // the warm-up's end, when the window's counters start
	_, before := call(t, "GET", srv.base+"/metrics", nil)
	cw.Wait()
	_, after := call(t, "GET", srv.base+"/metrics", nil)
	window := time.Since(measureAt)
	cancel()
	wg.Wait()
	if p := firstErr.Load(); p != nil {
		require.Zero(t, failures.Load(), "failed requests, the first: %v", *p)
	}

	all := slices.Concat(lat...)
	slices.Sort(all)
	require.NotEmpty(t, all)
	q := func(p float64) float64 { return float64(all[int(p*float64(len(all)-1))].Microseconds()) / 1000 }
	delta := func(name string) float64 {
		a, _ := strconv.ParseFloat(metricValue(after, name), 64)
		b, _ := strconv.ParseFloat(metricValue(before, name), 64)
		return a - b
	}
	ingest := delta("kvsource_events_blocks_total") / window.Seconds()
	hits, misses := delta("kvsource_hash_cache_hit_blocks_total"), delta("kvsource_hash_cache_miss_blocks_total")
	ratio := "off"
	if hits+misses > 0 {
		ratio = fmt.Sprintf("%.3f", hits/(hits+misses))
	}
	picks := float64(len(all)) / window.Seconds()
	t.Logf("%d clients: %.0f picks/s, p50 %.2f ms, p99 %.2f ms, ingest %.0f blocks/s, hash cache hit ratio %s, queue-full drops %.0f",
		clients, picks, q(0.5), q(0.99), ingest, ratio, delta("kvsource_events_queue_full_total"))
	require.GreaterOrEqual(t, ingest, 200_000.0, "the service applied too few blocks/s alongside the picks")
	return fmt.Sprintf("%.0f | %.2f | %.2f | %.0f | %s", picks, q(0.5), q(0.99), ingest, ratio)
}

// loadIngest publishes pod i's share of loadBlocksPerSec until
// ctx ends: batches of 40 events of 16 blocks, each storing a fresh chain
// and the next removing it, so the index stays bounded.
func loadIngest(ctx context.Context, t *testing.T, p *zmq.Publisher, i int) {
	const perBatch, blocks = 40, 16
	r := rand.New(rand.NewPCG(uint64(i), 99))
	var payloads [][]byte
	for range 32 {
		store := &events.Batch{}
		remove := &events.Batch{}
		for range perBatch {
			keys := make([]uint64, blocks)
			for k := range keys {
				keys[k] = r.Uint64()
			}
			store.Events = append(store.Events, events.Event{Type: events.EventBlockStored, BlockHashes: keys, BlockSize: 16, Medium: "GPU"})
			remove.Events = append(remove.Events, events.Event{Type: events.EventBlockRemoved, BlockHashes: keys, Medium: "GPU"})
		}
		payloads = append(payloads, events.AppendBatch(nil, store, events.LayoutMap, 0), events.AppendBatch(nil, remove, events.LayoutMap, 0))
	}
	perPod := float64(loadBlocksPerSec) / loadPods
	start := time.Now()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	sent := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		due := int(time.Since(start).Seconds()*perPod) / (perBatch * blocks)
		for ; sent < due; sent++ {
			if _, err := p.PublishPayload(payloads[sent%len(payloads)]); err != nil {
				t.Errorf("publishing: %v", err)
				return
			}
		}
	}
}

// loadConn is one load client's keep-alive HTTP/1.1 connection: it
// writes a prepared request head and the body, and reads the answer by
// its Content-Length into a reused buffer, as wrk does, so that the
// generator takes as little as it can of the two cores it shares with
// the service (net/http's client cost about as much per request as the
// service's JSON decoding of the tokens).
type loadConn struct {
	c    net.Conn
	r    *bufio.Reader
	head []byte
	out  []byte
}

func newServeLoadConn(base string, bodyLen int) (*loadConn, error) {
	host := strings.TrimPrefix(base, "http://")
	c, err := net.Dial("tcp", host)
	if err != nil {
		return nil, err
	}
	head := fmt.Appendf(nil, "POST /v1/pick HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", host, bodyLen)
	return &loadConn{c: c, r: bufio.NewReaderSize(c, 64<<10), head: head}, nil
}

func (l *loadConn) close() { _ = l.c.Close() }

// post sends body (of the length the head names) and returns the answer's
// status and body, valid until the next post.
func (l *loadConn) post(body []byte) (int, []byte, error) {
	// A service that stops answering fails the request, not the run.
	if err := l.c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		return 0, nil, err
	}
	bufs := net.Buffers{l.head, body}
	if _, err := bufs.WriteTo(l.c); err != nil {
		return 0, nil, err
	}
	line, err := l.r.ReadSlice('\n')
	if err != nil {
		return 0, nil, err
	}
	_, rest, _ := bytes.Cut(line, []byte(" "))
	code, err := strconv.Atoi(string(bytes.TrimSpace(rest[:min(3, len(rest))])))
	if err != nil {
		return 0, nil, fmt.Errorf("status line %q", line)
	}
	n := -1
	for {
		h, err := l.r.ReadSlice('\n')
		if err != nil {
			return 0, nil, err
		}
		h = bytes.TrimRight(h, "\r\n")
		if len(h) == 0 {
			break
		}
		if name, v, ok := bytes.Cut(h, []byte(":")); ok && bytes.EqualFold(name, []byte("Content-Length")) {
			if n, err = strconv.Atoi(string(bytes.TrimSpace(v))); err != nil {
				return 0, nil, fmt.Errorf("content length %q", v)
			}
		}
	}
	if n < 0 {
		return 0, nil, errors.New("answer without Content-Length")
	}
	if cap(l.out) < n {
		l.out = make([]byte, n)
	}
	l.out = l.out[:n]
	if _, err := io.ReadFull(l.r, l.out); err != nil {
		return 0, nil, err
	}
	return code, l.out, nil
}
