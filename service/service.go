package service

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/events/zmq"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/picker/calibrate"
)

// Service is kvsource serve: a subscriber feeding an index, a picker reading
// it, and the HTTP API. New builds it, Start starts its background work
// (event intake, snapshots, the NATS role), Handler is its API for any
// server, Serve and ListenAndServe serve it with the configured timeouts,
// and Shutdown stops it all.
type Service struct {
	cfg    Config
	log    *slog.Logger
	hasher *hashing.Hasher
	// hashCache is the process-wide hash cache, nil when off.
	hashCache *hashing.Cache
	idx       *index.Index
	sub       *zmq.Subscriber
	pk        *picker.Picker

	reg       *prometheus.Registry
	requests  *prometheus.CounterVec
	decisions *prometheus.CounterVec
	pulled    prometheus.Counter
	lim       limitState
	snap      snapshotState

	handler  http.Handler
	http     *http.Server
	conns    *connLimit
	render   *renderer          // nil without RenderURL
	spec     *index.Speculative // nil without SpeculativeTTL
	started  bool
	stopSub  context.CancelFunc
	subDone  chan error
	shutdown sync.Once

	pulls *keptPulls
	// snapSeqs are the sequence numbers the snapshot was loaded with; read
	// only after start-up.
	snapSeqs map[index.Holder]uint64
	nats     *natsRole  // nil: standalone
	hints    *hintState // nil: no KVCR endpoints
}

// New builds the service of cfg: it loads the snapshot, connects to NATS
// when a role is configured (bounded by ctx) and checks the configuration,
// but receives no events and serves nothing until Start.
func New(ctx context.Context, cfg Config) (*Service, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	// With --keys content the index holds content keys and requests are
	// hashed the same way; the engines' own keys need not be reproducible
	// (--algo does not matter), so their agreement is not checked.
	content := cfg.Keys == KeysContent
	hcfg := cfg.hashingConfig()
	if content {
		hcfg = cfg.contentConfig()
	}
	h, err := hashing.New(hcfg)
	if err != nil {
		return nil, err
	}
	s := &Service{cfg: cfg, log: log, hasher: h, pulls: newKeptPulls(cfg.KeptPullsMemory, cfg.InflightTTL, log)}
	var contentKeys *hashing.Hasher
	if content {
		contentKeys = h
	}
	if s.nats, err = newServeNATS(ctx, cfg, contentKeys, log); err != nil {
		return nil, err
	}
	if s.nats != nil && s.nats.replica != nil {
		s.idx = s.nats.replica.Index()
	} else if s.idx, s.snapSeqs, err = s.loadSnapshot(indexConfig(cfg, log)); err != nil {
		return nil, err
	}
	var sink events.Sink = s.idx
	if cfg.SpeculativeTTL > 0 {
		s.spec = index.NewSpeculative(s.idx, index.SpeculativeConfig{TTL: cfg.SpeculativeTTL, MaxBytes: cfg.SpeculativeMemory,
			MaxHolders: cfg.SpeculativeHolders, Logger: log})
		sink = s.spec // the engines' evictions take the guesses out
	}
	ecfg := events.Config{Sink: sink, InitialSeqs: s.snapSeqs, Hasher: h, Logger: log, ContentKeysHint: "--keys content",
		SenderCheckHint: "--events-allow NETWORK for pods named by DNS names (a pod named by an IP publishes from that IP only), or --events-no-sender-check where every peer that reaches the port is trusted",
		ReplayDeadline:  cfg.ReplayDeadline, QueueBytes: cfg.EventsQueueMemory, Tap: s.nats.tap(), SnapshotExpiry: cfg.SnapshotExpiry, MaxHolders: cfg.EventsMaxHolders,
		MaxHoldersPerSender: cfg.EventsPodsPerSender, LogBudget: cfg.EventsLogBudget}
	if content {
		ecfg.ContentKeys, ecfg.Hasher = h, nil
	}
	s.sub, err = zmq.NewSubscriber(zmq.SubscriberConfig{Events: ecfg, Engine: cfg.EventsEngine, Bind: cfg.EventsBind, MaxMessageSize: cfg.EventsMaxMessage,
		Allow: cfg.EventsAllow, NoSenderCheck: cfg.EventsNoSenderCheck, MaxPodsPerSender: cfg.EventsPodsPerSender})
	if err != nil {
		return nil, err
	}
	for _, pe := range cfg.EventsConnect {
		if err := s.sub.AddPodConfig(zmq.PodConfig{Pod: pe.Pod, Endpoint: pe.Endpoint, Replay: pe.Replay, Model: pe.Model, Engine: pe.Engine}); err != nil {
			return nil, fmt.Errorf("--events-connect %s: %w", pe.Pod, err)
		}
	}
	for _, pe := range cfg.EventsReplay {
		if err := s.sub.AddPod(pe.Pod, "", pe.Replay); err != nil {
			return nil, fmt.Errorf("--events-replay %s: %w", pe.Pod, err)
		}
	}
	switch {
	case len(cfg.EventsBind) > 0 || len(cfg.EventsConnect) > 0 || cfg.NATS.Role == RoleReplica:
	case cfg.NATS.Role == RoleRelay:
		log.Warn("kvsource serve: a relay without --events-bind or --events-connect hears no engine and puts nothing on the stream")
	default:
		log.Warn("kvsource serve: no --events-bind or --events-connect: the index changes only by snapshot")
	}
	if cfg.HashCacheBytes != HashCacheOff {
		s.hashCache = hashing.NewCache(hashing.CacheConfig{MaxBytes: cfg.HashCacheBytes})
	}
	pcfg := picker.Config{
		Index: s.idx, Hasher: h, HashCache: s.hashCache, MinCachedTokenDelta: cfg.MinCachedTokenDelta,
		P2PPort: cfg.P2PPort, InflightTTL: cfg.InflightTTL, Fleet: s.nats.pickerFleet(),
	}
	// Only live holders serve pulls: those this service's subscriber
	// hears, or on a replica those the relay's does.
	pcfg.Sources = s.sub.Source
	if src := s.nats.pickerSources(); src != nil {
		pcfg.Sources = src
	}
	if cfg.Calibration != "" {
		cal, err := calibrate.Load(cfg.Calibration)
		if err != nil {
			return nil, err
		}
		pcfg.Cost = &cal.Model
		log.Info("kvsource serve: pulls decided by predicted saving", "calibration", cfg.Calibration,
			"crossover_tokens", cal.Crossover, "recommended_min_cached_token_delta", cal.Threshold,
			"recompute_ms", fmt.Sprintf("%.3g + %.3g·t + %.3g·t²", cal.Recompute.A, cal.Recompute.B, cal.Recompute.C),
			"pull_ms", fmt.Sprintf("%.3g + %.3g·t", cal.Pull.Floor, cal.Pull.PerToken))
	}
	s.pk, err = picker.New(pcfg)
	if err != nil {
		return nil, err
	}
	s.initMetrics()
	s.hints = s.newHints(cfg)
	if s.render, err = s.newRenderer(cfg.RenderConfig); err != nil {
		return nil, err
	}
	s.nats.registerMetrics(s.reg)
	s.initLimits()
	s.initSnapshotMetrics()
	s.initMemoryMetrics()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/score", s.instrument("/v1/score", s.handleScore))
	mux.HandleFunc("POST /v1/pick", s.instrument("/v1/pick", s.handlePick))
	mux.HandleFunc("POST /v1/done", s.instrument("/v1/done", s.handleDone))
	mux.HandleFunc("GET /v1/pods", s.instrument("/v1/pods", noBody(s.handlePods)))
	mux.HandleFunc("GET /healthz", s.instrument("/healthz", noBody(s.handleHealth)))
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{}))
	s.handler = s.muxErrors(mux)
	// Without these a client that stalls mid-body, never reads its answer or
	// keeps idle connections open holds a connection and its goroutine
	// forever.
	s.http = &http.Server{Handler: s.handler, ReadHeaderTimeout: min(10*time.Second, cfg.ReadTimeout),
		ReadTimeout: cfg.ReadTimeout, WriteTimeout: cfg.WriteTimeout, IdleTimeout: cfg.IdleTimeout,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	s.conns = newConnLimit(cfg.MaxConnections, s.http)
	s.reg.MustRegister(s.conns.refused, s.conns.gauge)
	return s, nil
}

// Handler is the HTTP API: POST /v1/score, /v1/pick and /v1/done, GET
// /v1/pods, /metrics and /healthz, at those paths, answering 404 and 405 as
// JSON. Mount it in another mux under a prefix with http.StripPrefix. Its
// request limits (Limits) hold wherever it is mounted; the connection
// timeouts are the serving http.Server's (Serve sets them).
func (s *Service) Handler() http.Handler { return s.handler }

// Start starts receiving events, the periodic snapshots and the NATS role,
// in the background until Shutdown; ctx's values reach them, its
// cancellation does not. Start does not serve HTTP: Serve, ListenAndServe
// or another server mounting Handler does.
func (s *Service) Start(ctx context.Context) error {
	if s.started {
		return errors.New("service: started twice")
	}
	s.started = true
	subCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.stopSub = cancel
	done := make(chan error, 1)
	s.subDone = done
	go func() { done <- s.sub.Run(subCtx) }()
	go s.pulls.forgetExpired(subCtx)
	s.nats.start(subCtx, s.sub.Status)
	s.startSnapshots(subCtx)
	s.render.warm(subCtx, s)
	if s.spec != nil {
		go func() { _ = s.spec.Run(subCtx) }()
	}
	s.log.Info("kvsource serve: started", "bind", s.cfg.EventsBind,
		"connect", len(s.cfg.EventsConnect), "keys", s.cfg.Keys, "algo", s.hasher.Config().Algo, "block_size", s.hasher.Config().BlockSize)
	return nil
}

// Serve serves Handler on ln with the configured connection timeouts until
// Shutdown, and returns http.ErrServerClosed then, as http.Server.Serve does.
func (s *Service) Serve(ln net.Listener) error {
	s.log.Info("kvsource serve: serving HTTP", "http", ln.Addr().String(), "max_connections", s.cfg.MaxConnections)
	return s.http.Serve(limitListener{Listener: ln, c: s.conns})
}

// ListenAndServe listens on Config.HTTP and serves as Serve does.
func (s *Service) ListenAndServe() error {
	ln, err := net.Listen("tcp", s.cfg.HTTP)
	if err != nil {
		return err
	}
	return s.Serve(ln)
}

// Shutdown stops accepting requests on Serve's listeners, waits for those
// in flight, stops the
// subscriber (which returns within a second, replays included) and saves
// the snapshot when one is configured. A subscriber that has not stopped
// when ctx is done is logged and left behind: the snapshot is saved all the
// same (saveSnapshot is correct while events flow) and Shutdown returns an
// error saying so.
func (s *Service) Shutdown(ctx context.Context) error {
	var err error
	s.shutdown.Do(func() {
		err = s.http.Shutdown(ctx)
		if !s.started {
			err = errors.Join(err, s.nats.stop(ctx))
			return
		}
		s.stopSub()
		select {
		case serr := <-s.subDone:
			if serr != nil && !errors.Is(serr, context.Canceled) {
				err = errors.Join(err, fmt.Errorf("events: %w", serr))
			}
		case <-ctx.Done():
			s.log.Error("kvsource serve: the event subscriber did not stop in time, shutting down without it")
			err = errors.Join(err, fmt.Errorf("events: subscriber did not stop: %w", ctx.Err()))
		}
		err = errors.Join(err, s.nats.stop(ctx))
		s.render.close()
		if s.cfg.Snapshot != "" {
			err = errors.Join(err, s.finalSnapshot())
		}
	})
	return err
}

// saveSnapshot saves the index with each holder's last applied sequence
// number, so that a restart replays only what it missed: every
// --snapshot-interval while events flow, and a final time at shutdown. A
// stale holder's entries may include blocks its engine no longer has; they
// are left out of the file rather than saved as if they were exact, and
// kept in the index the service answers from.
//
// A holder the loaded snapshot brought in and whose pod has not published
// since (listed "stale" in /v1/pods) is saved again with the sequence number
// it was loaded with, so that when its pod does publish again the subscriber
// checks the next batch against that number and replays what was missed. A
// holder whose pod never comes back therefore stays, with its old number and
// listed stale, across restarts. One without a loaded number (its pod is
// never heard from under any model and the snapshot has no number for it)
// could never be checked or replayed, so it is left out. A holder is left
// out in every model.
//
// The sequence numbers are read before SaveHolders reads the index, and
// must stay so: a worker publishes a batch's sequence number only after
// applying the batch, so every batch up to a number read here is in the
// index SaveHolders then writes. Read after, a batch applied in between
// would be claimed but missing and never replayed; read before, the
// snapshot may hold batches past the saved number, and replaying them after
// a restart is idempotent.
//
// Per-holder lines are logged at the final save; periodic saves log them at
// debug level, so that a pod gone for good is not logged every interval.
func (s *Service) saveSnapshot(final bool) error {
	s.snap.mu.Lock()
	defer s.snap.mu.Unlock()
	level := slog.LevelDebug
	if final {
		level = slog.LevelWarn
	}
	ctx := context.Background()
	list := s.idx.HolderList()
	status := s.sub.Status()
	seqs := map[index.Holder]uint64{}
	stale := map[index.Holder]bool{}
	// One line per holder up to a budget a save, so that many holders
	// (made up by clients or not) cannot flood the log; the last line
	// counts the rest.
	lines, unlogged := 0, 0
	logHolder := func(level slog.Level, msg string, args ...any) {
		if lines++; lines > maxSnapshotHolderLines {
			unlogged++
			return
		}
		s.log.Log(ctx, level, msg, args...)
	}
	for _, st := range status {
		if st.State == "live" {
			seqs[st.Holder()] = st.LastSeq
			continue
		}
		stale[st.Holder()] = true
		logHolder(level, "kvsource serve: holder not live left out of the snapshot", "pod", st.Pod, "rank", st.Rank, "model", st.Model,
			"state", st.State, "last_seq", st.LastSeq)
	}
	for _, hm := range unseen(list, status) {
		h := hm.Holder
		if _, live := seqs[h]; live || stale[h] {
			continue
		}
		if s.spec != nil && s.spec.OnlyGuesses(hm.Model, h) {
			// A pick's destination no engine has reported from: the
			// snapshot has nothing of it to leave out, and the pod may
			// be live under another model.
			continue
		}
		if seq, ok := s.snapSeqs[h]; ok {
			seqs[h] = seq
			logHolder(min(level, slog.LevelInfo), "kvsource serve: holder not heard from since the snapshot saved with its loaded sequence number", "pod", h.Pod, "rank", h.Rank, "model", hm.Model, "last_seq", seq)
			continue
		}
		stale[h] = true
		logHolder(level, "kvsource serve: holder without a sequence number left out of the snapshot", "pod", h.Pod, "rank", h.Rank, "model", hm.Model)
	}
	// A holder stale under one model is left out under all.
	for h := range stale {
		delete(seqs, h)
	}
	if err := s.idx.SaveHolders(s.cfg.Snapshot, seqs); err != nil {
		s.snap.saveErrors.Inc()
		return err
	}
	s.snap.saves.Inc()
	s.snap.lastSave.SetToCurrentTime()
	s.log.Info("kvsource serve: snapshot saved", "snapshot", s.cfg.Snapshot, "holders", len(seqs), "left_out", len(stale), "final", final,
		"holder_lines_not_logged", unlogged)
	return nil
}

// maxSnapshotHolderLines bounds the lines a snapshot save logs about
// single holders.
const maxSnapshotHolderLines = 20

// unseen returns the pairs of list the subscriber has no status for
// under that model: holders a snapshot brought in whose pod has not
// published since. Read list before status: the subscriber knows a holder
// before it applies the holder's first batch, so a holder that appears
// between the two reads is not taken for one of the snapshot's.
func unseen(list []index.HolderModel, status []events.HolderStatus) []index.HolderModel {
	seen := make(map[index.HolderModel]bool, len(status))
	for _, st := range status {
		seen[index.HolderModel{Model: st.Model, Holder: st.Holder()}] = true
	}
	var out []index.HolderModel
	for _, hm := range list {
		if !seen[hm] {
			out = append(out, hm)
		}
	}
	return out
}

// instrument admits requests within the service's limits (see admit),
// counts them by path and the status the client got, and turns handler
// errors into JSON error responses: 400 for the client's mistakes, 413 for
// a request over a size limit, 503 past the deadline, 500 otherwise.
func (s *Service) instrument(path string, h func(http.ResponseWriter, *http.Request, *bodyBuf) error) http.HandlerFunc {
	// Series that exist before their first count can be alerted on.
	s.lim.aborted.WithLabelValues(path, "200")
	for _, reason := range rejectReasons {
		s.lim.rejected.WithLabelValues(path, reason)
	}
	return func(w http.ResponseWriter, r *http.Request) {
		r, end, ok := s.admit(w, r, path)
		if !ok {
			return
		}
		defer end()
		rec := &statusRecorder{ResponseWriter: w, code: http.StatusOK}
		b := getBuf()
		defer func() {
			s.lim.bodyBytes.Add(-b.held)
			b.held = 0
			putBuf(b)
		}()
		// The body first, without a slot (see Limits).
		if r.Method == http.MethodPost {
			if err := s.readBody(r, b); err != nil {
				s.answerError(rec, r, path, err)
				s.countAnswer(w, path, rec.code)
				return
			}
		}
		release, ok := s.takeSlot(w, path)
		if !ok {
			return
		}
		defer release()
		if err := h(rec, r, b); err != nil {
			s.answerError(rec, r, path, err)
		}
		s.countAnswer(w, path, rec.code)
	}
}

// speculate records prompt's blocks on the pick's destination, which is
// about to compute them (see Config.SpeculativeTTL). The picker hashed the
// prompt already: with the hash cache this is a lookup.
func (s *Service) speculate(model string, dest index.Holder, prompt hashing.Request) {
	var keys []uint64
	var err error
	if s.hashCache != nil {
		keys, err = s.hashCache.BlockKeys(s.hasher, nil, prompt)
	} else {
		keys, err = s.hasher.BlockKeys(nil, prompt)
	}
	if err == nil {
		s.spec.Record(model, dest, keys)
	}
}

// noBody is a handler of a GET for instrument.
func noBody(h func(http.ResponseWriter, *http.Request) error) func(http.ResponseWriter, *http.Request, *bodyBuf) error {
	return func(w http.ResponseWriter, r *http.Request, _ *bodyBuf) error { return h(w, r) }
}

// muxErrors answers what mux answers itself (a known path under another
// method: 405 with an Allow header; an unknown path: 404) as JSON errors like
// every other, and counts the 405s by path.
func (s *Service) muxErrors(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, pattern := mux.Handler(r); pattern != "" {
			mux.ServeHTTP(w, r)
			return
		}
		ew := &muxErrorWriter{ResponseWriter: w, r: r}
		mux.ServeHTTP(ew, r)
		if ew.code == http.StatusMethodNotAllowed {
			s.countAnswer(w, r.URL.Path, ew.code)
		}
	})
}

// muxErrorWriter replaces the plain-text body of the mux's own error
// answers with a ErrorResponse.
type muxErrorWriter struct {
	http.ResponseWriter
	r    *http.Request
	code int
}

func (w *muxErrorWriter) WriteHeader(code int) {
	w.code = code
	msg := http.StatusText(code)
	switch code {
	case http.StatusMethodNotAllowed:
		msg = fmt.Sprintf("method %s not allowed, use %s", w.r.Method, w.Header().Get("Allow"))
	case http.StatusNotFound:
		msg = fmt.Sprintf("no endpoint %s", w.r.URL.Path)
	}
	w.Header().Del("X-Content-Type-Options")
	writeJSON(w.ResponseWriter, code, ErrorResponse{Error: msg})
}

// Write drops the mux's plain-text body: WriteHeader wrote the JSON one.
func (w *muxErrorWriter) Write(p []byte) (int, error) {
	if w.code == 0 {
		w.WriteHeader(http.StatusOK)
	}
	return len(p), nil
}

type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (r *statusRecorder) WriteHeader(code int) {
	r.code = code
	r.ResponseWriter.WriteHeader(code)
}

func (s *Service) handleScore(w http.ResponseWriter, r *http.Request, b *bodyBuf) error {
	var req ScoreRequest
	var whole []byte
	if err := decodePrompt(b, &req, &req.Prompt); err != nil {
		if s.render == nil || !openAIBody(b.body) {
			return err
		}
		req, whole = ScoreRequest{}, b.body // an OpenAI body itself
	}
	prompt, err := s.promptOf(r.Context(), b, &req.Prompt, whole)
	if err != nil {
		return err
	}
	for _, p := range req.Pods {
		if err := checkField("pods", p); err != nil {
			return err
		}
	}
	b.scores, err = s.pk.ScoreContext(r.Context(), picker.Request{Model: req.Model, Prompt: prompt}, b.scores)
	if err != nil {
		return pickerError(err)
	}
	a := scoreAnswer{model: req.Model, blocks: len(req.Tokens) / s.pk.BlockSize(), pods: b.pods[:0]}
	var want, seen map[string]bool
	if len(req.Pods) > 0 {
		want, seen = map[string]bool{}, map[string]bool{}
		for _, p := range req.Pods {
			want[p] = true
		}
	}
	for i := range b.scores {
		sc := &b.scores[i]
		if want != nil {
			if !want[sc.Holder.Pod] {
				continue
			}
			seen[sc.Holder.Pod] = true
		}
		a.pods = append(a.pods, podScoreAnswer{holder: sc.Holder, matched: sc.Blocks, tiers: sc.Tiers, score: sc.Score})
	}
	// Every pod asked about gets an answer, zero when it holds nothing.
	for _, p := range req.Pods {
		if !seen[p] {
			seen[p] = true
			a.pods = append(a.pods, podScoreAnswer{holder: index.Holder{Pod: p}})
		}
	}
	b.pods = a.pods
	if b.out, err = a.appendJSON(b.out[:0]); err != nil {
		return err
	}
	writeBody(w, http.StatusOK, b.out)
	return nil
}

func (s *Service) handlePick(w http.ResponseWriter, r *http.Request, b *bodyBuf) error {
	var req PickRequest
	if err := decodePrompt(b, &req, &req.Prompt); err != nil {
		if s.render != nil && openAIBody(b.body) {
			return badRequest{errors.New(`a pick takes its OpenAI body in "request", beside "destination"`)}
		}
		return err
	}
	prompt, err := s.promptOf(r.Context(), b, &req.Prompt, nil)
	if err != nil {
		return err
	}
	for _, f := range []struct{ name, v string }{{"request_id", req.RequestID}, {"destination", req.Destination}} {
		if err := checkField(f.name, f.v); err != nil {
			return err
		}
	}
	if req.Destination == "" {
		return badRequest{errors.New(`"destination" is required`)}
	}
	if req.DestinationDPRank < 0 {
		return badRequest{fmt.Errorf(`"destination_dp_rank" must not be negative, got %d`, req.DestinationDPRank)}
	}
	preq := picker.Request{ID: req.RequestID, Model: req.Model, Prompt: prompt,
		Destination: index.Holder{Pod: req.Destination, Rank: req.DestinationDPRank}}
	if req.MinCachedTokenDelta != nil {
		if *req.MinCachedTokenDelta < 1 {
			return badRequest{fmt.Errorf(`"min_cached_token_delta" must be at least 1, got %d`, *req.MinCachedTokenDelta)}
		}
		preq.MinCachedTokenDelta = *req.MinCachedTokenDelta
	}
	if preq.Candidates, err = s.candidates(req.Model, req.Candidates); err != nil {
		return err
	}
	if s.hints != nil {
		// A hint names the prompt's blocks from block 0, which the
		// decision does not keep.
		if preq.Keys, err = s.promptKeys(r.Context(), prompt, b); err != nil {
			return pickerError(err)
		}
	}
	d, err := s.pk.PickContext(r.Context(), preq)
	if err != nil {
		return pickerError(err)
	}
	s.decisions.WithLabelValues(string(d.Reason)).Inc()
	s.pulled.Add(float64(d.Gain))
	if s.spec != nil {
		s.speculate(req.Model, preq.Destination, prompt)
	}
	a := pickAnswer{d: &d, saving: s.cfg.Calibration != ""}
	kvID := req.RequestID
	if d.Reason == picker.ReasonPull {
		// The consumer engine keys its pull session with the producer by
		// kv_request_id: two pulls under one id (say, the empty one) would
		// collide there.
		if kvID == "" {
			kvID = newKVRequestID()
		}
		a.kv = d.KVTransferParams(kvID)
		// Kept for Done under the id the answer names, so that a pick
		// without a request_id can be released by its kv_request_id. The
		// copy and d release the same pull, once.
		s.pulls.keep(kvID, d, time.Now())
	}
	if s.hints != nil {
		// The hint's message_id is the id its pull is known by.
		if a.hint, err = s.hints.answer(&d, preq.Keys, kvID); err != nil {
			return err
		}
	}
	if b.out, err = a.appendJSON(b.out[:0]); err != nil {
		return err
	}
	writeBody(w, http.StatusOK, b.out)
	return nil
}

// candidates converts the request's candidates; one without a dp_rank
// stands for every rank of its pod the service knows for the model, from
// the subscriber or from the snapshot.
func (s *Service) candidates(model string, in []Candidate) ([]picker.Candidate, error) {
	var ranks map[string][]int
	var out []picker.Candidate
	for _, c := range in {
		if c.Pod == "" {
			return nil, badRequest{errors.New(`candidate without "pod"`)}
		}
		if err := checkField("candidates pod", c.Pod); err != nil {
			return nil, err
		}
		if c.Waiting < 0 || c.Load < 0 {
			return nil, badRequest{fmt.Errorf("candidate %s: negative load", c.Pod)}
		}
		if c.DPRank != nil && *c.DPRank < 0 {
			return nil, badRequest{fmt.Errorf("candidate %s: negative dp_rank %d", c.Pod, *c.DPRank)}
		}
		if c.DPRank != nil {
			out = append(out, picker.Candidate{Holder: index.Holder{Pod: c.Pod, Rank: *c.DPRank}, Waiting: c.Waiting, Load: c.Load})
			continue
		}
		if ranks == nil {
			ranks = s.ranks(model)
		}
		rs := ranks[c.Pod]
		if len(rs) == 0 {
			rs = []int{0}
		}
		for _, rank := range rs {
			out = append(out, picker.Candidate{Holder: index.Holder{Pod: c.Pod, Rank: rank}, Waiting: c.Waiting, Load: c.Load})
		}
	}
	return out, nil
}

// ranks returns, per pod, the data-parallel ranks known for model: those
// the subscriber has heard from and those the index holds (a snapshot's).
func (s *Service) ranks(model string) map[string][]int {
	known := map[index.Holder]bool{}
	for _, hm := range s.idx.HolderList() {
		if hm.Model == model {
			known[hm.Holder] = true
		}
	}
	for _, st := range s.sub.Status() {
		if st.Model == model {
			known[st.Holder()] = true
		}
	}
	ranks := map[string][]int{}
	for h := range known {
		ranks[h.Pod] = append(ranks[h.Pod], h.Rank)
	}
	for _, rs := range ranks {
		slices.Sort(rs)
	}
	return ranks
}

type DoneRequest struct {
	RequestID string `json:"request_id"`
}

// handleDone releases the pull decided for a request id, so its source no
// longer counts it in flight. Unreleased pulls expire after --inflight-ttl.
func (s *Service) handleDone(w http.ResponseWriter, _ *http.Request, b *bodyBuf) error {
	var req DoneRequest
	if err := decodeJSON(b.body, &req); err != nil {
		return err
	}
	if req.RequestID == "" {
		return badRequest{errors.New(`"request_id" is required`)}
	}
	if err := checkField("request_id", req.RequestID); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]bool{"released": s.pulls.release(req.RequestID)})
	return nil
}

// newKVRequestID returns a random kv_request_id for a pull whose
// request came without a request_id.
func newKVRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "kvsource-" + hex.EncodeToString(b[:])
}

func pickerError(err error) error {
	switch {
	case errors.Is(err, picker.ErrHash) || errors.Is(err, picker.ErrNoDestination):
		return badRequest{err}
	case errors.Is(err, picker.ErrUnknownModel):
		return notFound{err}
	}
	return err
}

type Pod struct {
	Pod           string         `json:"pod"`
	Model         string         `json:"model"`
	DPRank        int            `json:"dp_rank"`
	Blocks        map[string]int `json:"blocks"`
	LastSeq       uint64         `json:"last_seq"`
	State         string         `json:"state"`
	InflightPulls int            `json:"inflight_pulls"`
	// Counters are the holder's counters of events.Counters, by name; they
	// are rendered as fields of the pod beside the ones above.
	Counters map[string]uint64 `json:"-"`
}

// holderCounters returns st's per-holder counters by their
// events.Counters names.
func holderCounters(st *events.HolderStatus) map[string]uint64 {
	m := map[string]uint64{}
	for _, c := range events.Counters {
		if c.Holder != nil {
			m[c.Name] = *c.Holder(st)
		}
	}
	return m
}

// MarshalJSON renders the pod's fields and its counters as one object.
func (p Pod) MarshalJSON() ([]byte, error) {
	type fields Pod // without this method
	b, err := json.Marshal(fields(p))
	if err != nil || len(p.Counters) == 0 {
		return b, err
	}
	c, err := json.Marshal(p.Counters)
	if err != nil {
		return nil, err
	}
	// {"pod":...} and {"gaps":...} become {"pod":...,"gaps":...}.
	return append(append(b[:len(b)-1], ','), c[1:]...), nil
}

// handlePods lists every holder the subscriber knows, and every holder the
// snapshot brought in whose pod has not published since, as stale with the
// sequence number it was loaded with.
func (s *Service) handlePods(w http.ResponseWriter, r *http.Request) error {
	if s.nats != nil && s.nats.replica != nil {
		s.handleReplicaPods(w, r)
		return nil
	}
	list := s.idx.HolderList()
	status := s.sub.Status()
	pods := []Pod{}
	for _, st := range status {
		pods = append(pods, Pod{Pod: st.Pod, Model: st.Model, DPRank: st.Rank, Blocks: s.holderBlocks(st.Model, st.Holder()),
			LastSeq: st.LastSeq, State: st.State, InflightPulls: s.pk.Inflight(st.Holder()), Counters: holderCounters(&st)})
	}
	for _, hm := range unseen(list, status) {
		pods = append(pods, Pod{Pod: hm.Holder.Pod, Model: hm.Model, DPRank: hm.Holder.Rank,
			Blocks: s.holderBlocks(hm.Model, hm.Holder), LastSeq: s.snapSeqs[hm.Holder], State: "stale",
			InflightPulls: s.pk.Inflight(hm.Holder), Counters: holderCounters(&events.HolderStatus{})})
	}
	slices.SortStableFunc(pods, func(a, b Pod) int {
		return index.Holder{Pod: a.Pod, Rank: a.DPRank}.Compare(index.Holder{Pod: b.Pod, Rank: b.DPRank})
	})
	// The --events-connect endpoints, so that an engine that cannot be
	// reached shows, though it has no holder yet.
	endpoints := []Endpoint{}
	for _, e := range s.sub.Endpoints() {
		endpoints = append(endpoints, Endpoint{Pod: e.Pod, Endpoint: e.Endpoint, Connected: e.Connected})
	}
	writeJSON(w, http.StatusOK, map[string]any{"pods": pods, "endpoints": endpoints})
	return nil
}

// Endpoint is a connect-mode endpoint in /v1/pods.
type Endpoint struct {
	Pod       string `json:"pod"`
	Endpoint  string `json:"endpoint"`
	Connected bool   `json:"connected"`
}

func (s *Service) holderBlocks(model string, h index.Holder) map[string]int {
	blocks := map[string]int{index.TierGPU: 0, index.TierCPU: 0}
	for t, n := range s.idx.HolderBlocks(model, h) {
		blocks[t] = n
	}
	return blocks
}
