package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/internal/ratelog"
)

// Bounded work per request. A request's body is read before it takes one
// of --max-inflight-requests slots, so that a client sending its body
// slowly holds no slot that a fast one needs; the bodies being read are
// bounded together by --max-body-memory (counted as their bytes arrive, so a
// slow body holds only what it sent) and each by bodyLimit bytes (derived
// from --max-tokens) and --request-timeout, which reading, hashing and the
// lookup all stop at. A request then holds its slot until its answer is
// written: the CPU and memory of the work in flight are bounded by the slot
// count times what one request may cost, identifiers of at most
// MaxFieldBytes included. Beyond the slots, or past --max-body-memory, a
// request is answered 503 with Retry-After at once.

// Limits is the part of Config that bounds requests.
type Limits struct {
	// MaxInflight is how many requests to /v1/score, /v1/pick and /v1/pods
	// may be served at once; beyond it they are answered 503.
	MaxInflight int
	// RequestTimeout bounds one request, from admission to its answer:
	// reading its body, hashing its prompt and looking it up.
	RequestTimeout time.Duration
	// MaxTokens is the most tokens one prompt may have; the body limit of
	// /v1/score and /v1/pick follows from it.
	MaxTokens int
	// MaxBodyMemory bounds the bytes of the request bodies being read and
	// served at once, with the render answers they wait for (see
	// RenderConfig); zero: MaxInflight bodies of MaxTokens (at least
	// two), the bound the slots alone kept when bodies were read in them.
	MaxBodyMemory int64
}

const (
	// MaxFieldBytes bounds lora_name, cache_salt, request_id, model,
	// pod names and multimodal identifiers: each LoRA name and identifier
	// is hashed into every block it covers, so their length multiplies the
	// cost of a prompt.
	MaxFieldBytes = 4 << 10
	// DefaultMaxTokens is --max-tokens' default.
	DefaultMaxTokens = 1 << 20
	// DefaultRequestTimeout is --request-timeout's default: hashing
	// and looking up a prompt of --max-tokens takes well under a second.
	DefaultRequestTimeout = 5 * time.Second
	// tokenJSONBytes is the most one token takes in a request body:
	// "4294967295, ".
	tokenJSONBytes = 12
	// bodySlack is what a /v1/score or /v1/pick body may hold beside
	// its tokens: identifiers, candidates and multimodal items.
	bodySlack = 1 << 20
	// smallBodyLimit bounds the bodies of the other endpoints.
	smallBodyLimit = 64 << 10
	// retryAfter is the Retry-After, in seconds, of a 503.
	retryAfter = "1"
)

// defaultMaxBodyMemory is MaxBodyMemory's default for the other limits.
func defaultMaxBodyMemory(maxInflight, maxTokens int) int64 {
	return int64(max(2, maxInflight)) * bodyLimit(maxTokens)
}

// DefaultMaxInflight is --max-inflight-requests' default: two
// requests per core keep every core busy while one request of each pair
// waits for its body.
func DefaultMaxInflight() int { return 2 * runtime.GOMAXPROCS(0) }

// bodyLimit bounds the body of a request carrying a prompt of at most
// maxTokens tokens.
func bodyLimit(maxTokens int) int64 {
	return int64(maxTokens)*tokenJSONBytes + bodySlack
}

// flags registers the limits' flags on fs.
func (l *Limits) flags(fs *flag.FlagSet) {
	fs.IntVar(&l.MaxInflight, "max-inflight-requests", DefaultMaxInflight(), "requests to /v1/score, /v1/pick and /v1/pods served at once; beyond, 503 with Retry-After; twice GOMAXPROCS unless set")
	fs.DurationVar(&l.RequestTimeout, "request-timeout", DefaultRequestTimeout, "deadline of one request, body, hashing and lookup included; past it, 503; less than --http-write-timeout")
	fs.IntVar(&l.MaxTokens, "max-tokens", DefaultMaxTokens, "most tokens per prompt; more is answered 413, and bodies are bounded to 12 bytes a token plus 1 MiB")
	fs.Var((*sizeFlag)(&l.MaxBodyMemory), "max-body-memory", "bytes of request bodies read and served at once, and of the render answers they wait for, counted as they arrive; past it, 503 with Retry-After (at least two bodies of --max-tokens; 0: --max-inflight-requests bodies of --max-tokens)")
}

// check validates the limits against the server's write timeout: a request
// timeout past it would let the connection's deadline cut the answer off.
func (l *Limits) check(writeTimeout time.Duration) error {
	switch {
	case l.MaxInflight < 1:
		return fmt.Errorf("--max-inflight-requests must be at least 1, got %d", l.MaxInflight)
	case l.MaxTokens < 1:
		return fmt.Errorf("--max-tokens must be at least 1, got %d", l.MaxTokens)
	case l.RequestTimeout <= 0:
		return fmt.Errorf("--request-timeout must be positive, got %v", l.RequestTimeout)
	case l.MaxBodyMemory < 0:
		return fmt.Errorf("--max-body-memory must not be negative, got %d", l.MaxBodyMemory)
	case l.MaxBodyMemory > 0 && l.MaxBodyMemory < 2*bodyLimit(l.MaxTokens):
		return fmt.Errorf("--max-body-memory (%s) must hold two bodies of --max-tokens (%s each)", formatSize(l.MaxBodyMemory), formatSize(bodyLimit(l.MaxTokens)))
	case l.RequestTimeout >= writeTimeout:
		return fmt.Errorf("--request-timeout (%v) must be less than --http-write-timeout (%v), or a late answer is cut off", l.RequestTimeout, writeTimeout)
	}
	return nil
}

// limitState is the service's state for its limits.
type limitState struct {
	slots chan struct{}
	// bodyBytes are the bytes of the bodies read and held now.
	bodyBytes atomic.Int64
	bodyHeld  prometheus.GaugeFunc
	rejected  *prometheus.CounterVec
	aborted   *prometheus.CounterVec
	logs      [logKinds]ratelog.Gate // one line a second per kind
}

// The kinds of answerError's log lines, each limited on its own.
const (
	logTimeout = iota
	logCanceled
	logBadRequest
	logNotFound
	logFailed
	logKinds
)

// Rejection reasons, the reason label of kvsource_http_rejected_total.
const (
	rejectOverload  = "overload"
	rejectTimeout   = "timeout"
	rejectBodySize  = "body_too_large"
	rejectTokens    = "too_many_tokens"
	rejectFieldSize = "field_too_long"
	rejectCanceled  = "canceled"
	// rejectBadRequest is any other 400: malformed JSON, wrong types,
	// a missing or invalid member.
	rejectBadRequest = "bad_request"
	// rejectRenderUnavailable is a 503 for a render backend that is down
	// or overloaded, rejectRenderBadResponse a 502 for an answer that is
	// not vLLM's (see RenderConfig).
	rejectRenderUnavailable = "render_unavailable"
	rejectRenderBadResponse = "render_bad_response"
)

var rejectReasons = []string{rejectOverload, rejectTimeout, rejectBodySize, rejectTokens,
	rejectFieldSize, rejectCanceled, rejectBadRequest, rejectRenderUnavailable, rejectRenderBadResponse}

// statusClientClosed is the status, nginx's 499, a request gets in the
// metrics when its client hung up before the answer: no client reads it.
const statusClientClosed = 499

func (s *Service) initLimits() {
	s.lim.slots = make(chan struct{}, s.cfg.MaxInflight)
	s.lim.rejected = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvsource_http_rejected_total",
		Help: "Requests refused, by path and reason: overload (503), timeout (503), body_too_large (413), too_many_tokens (413), field_too_long (400), bad_request (400: malformed or invalid), canceled (the client hung up first), render_unavailable (503: the --render-url backend down, overloaded or out of time), render_bad_response (502).",
	}, []string{"path", "reason"})
	s.lim.aborted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvsource_http_aborted_total",
		Help: "Answers that could not be written (the client gone or the write timeout passed), by path and the status they carried; kvsource_http_requests_total counts only answers written.",
	}, []string{"path", "code"})
	s.lim.bodyHeld = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsource_http_body_bytes",
		Help: "Bytes of the request bodies being read and served, and of the render answers they wait for, bounded by --max-body-memory."},
		func() float64 { return float64(s.lim.bodyBytes.Load()) })
	s.reg.MustRegister(s.lim.rejected, s.lim.aborted, s.lim.bodyHeld)
}

// limitedPaths are the endpoints whose work grows with the request or
// the index, and which take a slot.
var limitedPaths = map[string]bool{"/v1/score": true, "/v1/pick": true, "/v1/pods": true}

// admit bounds the body of a request to path and sets its deadline. It
// returns the request to serve and the function that ends it, or false when
// it answered 413 for a body declared too large.
func (s *Service) admit(w http.ResponseWriter, r *http.Request, path string) (*http.Request, func(), bool) {
	limit := int64(smallBodyLimit)
	if path == "/v1/score" || path == "/v1/pick" {
		limit = bodyLimit(s.cfg.MaxTokens)
	}
	if r.ContentLength > limit {
		s.reject(w, path, rejectBodySize, http.StatusRequestEntityTooLarge,
			fmt.Sprintf("request body too large: %d bytes, at most %d", r.ContentLength, limit))
		return r, nil, false
	}
	// The server's own ResponseWriter, not a recorder: through it the
	// limit marks the connection to be closed after the answer, rather
	// than left to read the rest of an oversize body.
	r.Body = http.MaxBytesReader(w, r.Body, limit)
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.RequestTimeout)
	deadline, _ := ctx.Deadline()
	// A body that arrives slowly stops at the deadline too, or at the
	// server's read timeout when that comes first: this deadline replaces
	// the server's. A writer that cannot (a test's recorder) leaves it to
	// the server's read timeout.
	if rd := time.Now().Add(s.cfg.ReadTimeout); rd.Before(deadline) {
		deadline = rd
	}
	_ = http.NewResponseController(w).SetReadDeadline(deadline)
	return r.WithContext(ctx), cancel, true
}

// takeSlot takes a slot for a request to path whose work grows with the
// request or the index, after its body is read. It returns the function that
// releases it, or false when it answered 503 because every slot is taken.
func (s *Service) takeSlot(w http.ResponseWriter, path string) (func(), bool) {
	if !limitedPaths[path] {
		return func() {}, true
	}
	select {
	case s.lim.slots <- struct{}{}:
		return func() { <-s.lim.slots }, true
	default:
		s.reject(w, path, rejectOverload, http.StatusServiceUnavailable,
			fmt.Sprintf("overloaded: %d requests in flight (--max-inflight-requests), retry later", cap(s.lim.slots)))
		return nil, false
	}
}

// errBodyMemory is a body or render answer refused because the bodies and
// answers being read already hold --max-body-memory: answered 503, as an
// overload.
var errBodyMemory = errors.New("overloaded: the request bodies and render answers being read hold --max-body-memory, retry later")

// reserveBody counts n more bytes of bodies held, or refuses them past
// --max-body-memory.
func (s *Service) reserveBody(n int64) bool {
	if s.lim.bodyBytes.Add(n) > s.cfg.MaxBodyMemory {
		s.lim.bodyBytes.Add(-n)
		return false
	}
	return true
}

// reject answers a request refused by a limit and counts it.
func (s *Service) reject(w http.ResponseWriter, path, reason string, code int, msg string) {
	if code == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", retryAfter)
	}
	writeJSON(w, code, ErrorResponse{Error: msg})
	s.lim.rejected.WithLabelValues(path, reason).Inc()
	s.countAnswer(w, path, code)
}

// tooLarge is a request over a size limit: answered 413.
type tooLarge struct{ err error }

func (e tooLarge) Error() string { return e.err.Error() }
func (e tooLarge) Unwrap() error { return e.err }

// fieldTooLong is an identifier over MaxFieldBytes: answered 400.
type fieldTooLong struct{ err error }

func (e fieldTooLong) Error() string { return e.err.Error() }
func (e fieldTooLong) Unwrap() error { return e.err }

// classify returns the status code and rejection reason ("" for none) of
// a handler's error for r.
func (s *Service) classify(r *http.Request, err error) (int, string) {
	var mb *http.MaxBytesError
	var tl tooLarge
	var fl fieldTooLong
	var br badRequest
	var nf notFound
	switch {
	// First: a render backend that did not answer in time is named as
	// such, whichever deadline passed (see Service.rendered).
	case isRenderError(err):
		code, reason, _ := renderStatus(err)
		return code, reason
	// Then: a body cut off by the deadline fails to decode, and looks
	// like a bad request.
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.Is(r.Context().Err(), context.DeadlineExceeded):
		return http.StatusServiceUnavailable, rejectTimeout
	// A client that hung up cancels the request's context: its work stops,
	// which is not the server's failure.
	case errors.Is(err, context.Canceled) || errors.Is(r.Context().Err(), context.Canceled):
		return statusClientClosed, rejectCanceled
	case errors.Is(err, errBodyMemory):
		return http.StatusServiceUnavailable, rejectOverload
	case errors.As(err, &mb):
		return http.StatusRequestEntityTooLarge, rejectBodySize
	case errors.As(err, &tl):
		return http.StatusRequestEntityTooLarge, rejectTokens
	case errors.As(err, &fl):
		return http.StatusBadRequest, rejectFieldSize
	case errors.As(err, &br):
		return http.StatusBadRequest, rejectBadRequest
	case errors.As(err, &nf):
		return http.StatusNotFound, ""
	}
	return http.StatusInternalServerError, ""
}

// answerError answers a handler's error as JSON with its status code.
func (s *Service) answerError(w http.ResponseWriter, r *http.Request, path string, err error) int {
	code, reason := s.classify(r, err)
	msg := err.Error()
	kind, level, line := logFailed, slog.LevelError, "kvsource serve: request failed"
	switch {
	case reason == rejectTimeout:
		w.Header().Set("Retry-After", retryAfter)
		msg = fmt.Sprintf("request timeout: not answered within %v (--request-timeout): %v", s.cfg.RequestTimeout, err)
		kind, level, line = logTimeout, slog.LevelInfo, "kvsource serve: request timed out"
	case reason == rejectRenderUnavailable:
		w.Header().Set("Retry-After", retryAfter)
		msg = "render backend unavailable (--render-url): " + msg
		kind, level, line = logFailed, slog.LevelWarn, "kvsource serve: render backend unavailable"
	case reason == rejectRenderBadResponse:
		msg = "render backend gave a bad answer (--render-url): " + msg
		kind, level, line = logFailed, slog.LevelError, "kvsource serve: render backend gave a bad answer"
	case reason == rejectOverload:
		w.Header().Set("Retry-After", retryAfter)
		kind, level, line = logTimeout, slog.LevelInfo, "kvsource serve: request refused, overloaded"
	case reason == rejectCanceled:
		kind, level, line = logCanceled, slog.LevelInfo, "kvsource serve: client gone before the answer"
	case code == http.StatusBadRequest || code == http.StatusRequestEntityTooLarge:
		kind, level, line = logBadRequest, slog.LevelInfo, "kvsource serve: bad request"
	case code == http.StatusNotFound:
		kind, level, line = logNotFound, slog.LevelInfo, "kvsource serve: not found"
	}
	if skipped, ok := s.lim.logs[kind].Allow(time.Second); ok {
		args := []any{"path", path, "remote", r.RemoteAddr, "err", err}
		if skipped > 0 {
			args = append(args, "not_logged_before", skipped)
		}
		s.log.Log(r.Context(), level, line, args...)
	}
	if reason != "" {
		s.lim.rejected.WithLabelValues(path, reason).Inc()
	}
	writeJSON(w, code, ErrorResponse{Error: msg})
	return code
}

// countAnswer writes out the answer to a request to path and counts it by
// what the client got: its status when it was written, as aborted when the
// client was gone or the write deadline passed.
func (s *Service) countAnswer(w http.ResponseWriter, path string, code int) {
	if err := http.NewResponseController(w).Flush(); err != nil {
		s.lim.aborted.WithLabelValues(path, strconv.Itoa(code)).Inc()
		return
	}
	s.requests.WithLabelValues(path, strconv.Itoa(code)).Inc()
}

// checkPrompt bounds a prompt's size: its tokens to --max-tokens, its
// identifiers to MaxFieldBytes.
func (s *Service) checkPrompt(p *Prompt) error {
	if len(p.Tokens) > s.cfg.MaxTokens {
		return tooLarge{fmt.Errorf(`"tokens": %d tokens, at most %d (--max-tokens)`, len(p.Tokens), s.cfg.MaxTokens)}
	}
	for _, f := range []struct{ name, v string }{{"model", p.Model}, {"lora_name", p.LoRAName}, {"cache_salt", p.CacheSalt}} {
		if err := checkField(f.name, f.v); err != nil {
			return err
		}
	}
	for _, m := range p.MMItems {
		if err := checkField("mm_items id", m.ID); err != nil {
			return err
		}
	}
	return nil
}

// checkField bounds one identifier to MaxFieldBytes.
func checkField(name, v string) error {
	if len(v) > MaxFieldBytes {
		return fieldTooLong{fmt.Errorf("%q is %d bytes, at most %d", name, len(v), MaxFieldBytes)}
	}
	return nil
}
