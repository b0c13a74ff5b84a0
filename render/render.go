package render

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/internal/ratelog"
)

// Defaults of Config, as llm-d's token producer has them where it has them.
const (
	// DefaultURL is llm-d's default: a render sidecar on the router's host.
	DefaultURL = "http://localhost:8000"
	// DefaultTimeout bounds a text render.
	DefaultTimeout = 5 * time.Second
	// DefaultMMTimeout bounds a chat render with part-array content, which
	// may download and process images, audio or video.
	DefaultMMTimeout = 30 * time.Second
	// DefaultMaxResponseBytes bounds the bytes of an answer read: vLLM's
	// answers carry each image's processed tensors (about 33 MiB for one
	// of 1024x1024), which are skipped as they stream past, at the cost of
	// reading them and no memory. It bounds the time an answer takes to
	// read, not the memory it holds: Config.MaxTokens and Charge do.
	DefaultMaxResponseBytes = 256 << 20
	// DefaultMaxBodyBytes bounds a body the client forwards; base64 images
	// make chat bodies large.
	DefaultMaxBodyBytes = 64 << 20
	// DefaultMaxIdleConns is the keep-alive pool's size.
	DefaultMaxIdleConns = 16
	// DefaultWarmInterval is the pause between Warm's attempts.
	DefaultWarmInterval = 500 * time.Millisecond
)

// The render endpoints' paths, below Config.URL.
const (
	CompletionsPath = "/v1/completions/render"
	ChatPath        = "/v1/chat/completions/render"
	// MessagesPath renders Anthropic Messages bodies (vLLM PR #45803):
	// its top-level "system" prompt, which the chat endpoint would drop.
	MessagesPath = "/v1/messages/render"
)

// Config configures a Client. The zero value renders through a sidecar at
// DefaultURL with the defaults above and no cache.
type Config struct {
	// URL is the backend's base URL, http or https, without the endpoint
	// path: any vLLM OpenAI server, or `vllm launch render MODEL`. ""
	// means DefaultURL.
	URL string
	// Model, when set, is stamped into every body's "model" (added when
	// the body has none): a render-only server needs it, and a router may
	// be handed bodies that name an alias or a LoRA adapter. "" forwards
	// the body's own model.
	Model string
	// Timeout bounds a text render (completions, chat without part
	// arrays); 0 means DefaultTimeout. MMTimeout bounds a chat render
	// whose messages have part-array content; 0 means DefaultMMTimeout.
	// A context deadline that comes sooner wins.
	Timeout, MMTimeout time.Duration
	// MaxResponseBytes bounds the bytes read of an answer, the tensors it
	// skips included; a larger one is ErrBadResponse. 0 means
	// DefaultMaxResponseBytes.
	MaxResponseBytes int64
	// MaxTokens, when positive, bounds the token ids of a rendered prompt:
	// the client stops reading an answer at the first one past it, and the
	// render is ErrBadRequest wrapping ErrTooManyTokens. It bounds the
	// memory of an answer to 4 bytes a token (twice that while the ids
	// arrive), plus the answer's read window. 0 means no bound but
	// MaxResponseBytes'.
	MaxTokens int
	// MaxBodyBytes bounds a body passed to the client; a larger one is
	// ErrBadRequest. 0 means DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// MaxIdleConns is how many keep-alive connections to the backend the
	// client keeps open; 0 means DefaultMaxIdleConns.
	MaxIdleConns int
	// KeepMMKwargs stops the client from splicing "return_mm_kwargs":
	// false into bodies, as llm-d does to ask vLLM to leave the processed
	// multimodal tensors out of its answers. vLLM's render requests have
	// no such field and send the tensors whatever the body says: the
	// client skips them as they stream past, never holding them.
	KeepMMKwargs bool
	// Header is sent with every request, e.g. Authorization for a backend
	// started with --api-key.
	Header http.Header
	// CacheBytes, when positive, bounds a cache of recent renders keyed by
	// a hash of the endpoint and the body sent (the stamped model
	// included): a repeated body is not rendered again. 0 means no cache.
	CacheBytes int64
	// WarmInterval is the pause between Warm's attempts; 0 means
	// DefaultWarmInterval. WarmConns is how many connections Warm opens
	// once the backend answers; 0 means 1.
	WarmInterval time.Duration
	WarmConns    int
	// Transport, when set, replaces the client's own keep-alive HTTP/1.1
	// transport (for custom TLS or tests); MaxIdleConns does not apply.
	Transport http.RoundTripper
	// Observe, when set, is called after every render with what a
	// service's metrics need (a latency histogram by endpoint and result,
	// errors by Kind). It runs on the caller's goroutine: keep it short.
	Observe func(Observation)
	// Logger receives failed renders, at most once a second per error
	// kind. Nil means slog.Default().
	Logger *slog.Logger
}

// Observation is one render, as Config.Observe sees it.
type Observation struct {
	// Endpoint is "chat", "messages" or "completions".
	Endpoint string
	// Duration is the render's time; for a cache hit, the lookup's.
	Duration time.Duration
	// Err is the render's error, nil on success; Kind(Err) labels it.
	Err error
	// Cached reports an answer from the cache; Multimodal a chat body
	// with part-array content (the MMTimeout applied).
	Cached, Multimodal bool
	// Prompts and Tokens count what was rendered.
	Prompts, Tokens int
}

// Rendered is one prompt as the backend rendered it.
type Rendered struct {
	// Model is the model vLLM rendered for: the "model" of its answer, or
	// else the stamped Config.Model, or else the body's own.
	Model string
	// BodyModel is the body's own "model" before stamping, "" when it had
	// none. When it names a LoRA adapter, set Request.LoRAName to it: the
	// answer does not say whether a model name is an adapter.
	BodyModel string
	// Request is what the prompt's block keys are hashed from: the
	// engine's exact token ids, the multimodal items (vLLM's mm hashes at
	// their placeholder ranges, sorted by offset) and the cache salt (the
	// answer's echo, else the body's). LoRAName is left empty (see
	// BodyModel and WithLoRA). With a cache, a repeated body's Rendered
	// share their slices: do not modify them.
	Request hashing.Request

	saltEchoed bool
}

// WithLoRA returns r's Request as the LoRA adapter name serves it: name is
// then an extra key of every block. towerConnector is the engine's
// enable_tower_connector_lora, under which vLLM also keys each multimodal
// item by "name:" and its hash (vllm/v1/engine/input_processor.py,
// _get_mm_identifier), since the adapter changes the items' embeddings.
// r is not modified.
func (r *Rendered) WithLoRA(name string, towerConnector bool) hashing.Request {
	req := r.Request
	req.LoRAName = name
	if towerConnector && name != "" && len(req.MM) > 0 {
		req.MM = slices.Clone(req.MM)
		for i := range req.MM {
			req.MM[i].ID = name + ":" + req.MM[i].ID
		}
	}
	return req
}

// Stats are a Client's counters since it was made.
type Stats struct {
	// Renders counts renders answered by the backend; CacheHits those
	// answered from the cache.
	Renders, CacheHits uint64
	// Unavailable, BadRequest and BadResponse count errors by their
	// sentinel; Canceled counts renders whose caller's context ended.
	Unavailable, BadRequest, BadResponse, Canceled uint64
	// Latency is the total time of the renders the backend answered, for a
	// mean with Renders.
	Latency time.Duration
	// CacheEntries and CacheBytes are the cache's contents, CacheEvictions
	// the entries it dropped to stay within Config.CacheBytes,
	// CacheTooLarge the renders too large for it to keep.
	CacheEntries, CacheBytes      int64
	CacheEvictions, CacheTooLarge uint64
}

// Client renders OpenAI completions and chat bodies into the token ids and
// multimodal items vLLM's engine hashes, through vLLM's render endpoints.
// It is safe for concurrent use.
type Client struct {
	cfg         Config
	completions string // endpoint URLs
	chat        string
	messages    string
	http        *http.Client
	own         *http.Transport // nil with Config.Transport
	cache       *cache
	log         *slog.Logger
	windows     sync.Pool // *[answerWindow]byte

	renders, hits, tooLarge atomic.Uint64
	unavailable, badReq     atomic.Uint64
	badResp, canceled       atomic.Uint64
	latency                 atomic.Int64
	gates                   [4]ratelog.Gate
}

// New returns a Client for cfg. It only checks cfg: nothing is sent before
// the first render or Warm.
func New(cfg Config) (*Client, error) {
	if cfg.URL == "" {
		cfg.URL = DefaultURL
	}
	u, err := url.Parse(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("render: URL %q: %w", cfg.URL, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("render: URL %q: want http://host:port or https://host:port, with an optional path prefix", cfg.URL)
	}
	if u.User != nil {
		// The URL goes into every error and log line.
		return nil, fmt.Errorf("render: URL %q has credentials: pass them in Config.Header", u.Redacted())
	}
	if cfg.Timeout < 0 || cfg.MMTimeout < 0 || cfg.MaxResponseBytes < 0 || cfg.MaxTokens < 0 || cfg.MaxBodyBytes < 0 ||
		cfg.MaxIdleConns < 0 || cfg.CacheBytes < 0 || cfg.WarmInterval < 0 || cfg.WarmConns < 0 {
		return nil, errors.New("render: negative Config value")
	}
	cfg.Timeout = orDefault(cfg.Timeout, DefaultTimeout)
	cfg.MMTimeout = orDefault(cfg.MMTimeout, DefaultMMTimeout)
	cfg.MaxResponseBytes = orDefault(cfg.MaxResponseBytes, DefaultMaxResponseBytes)
	cfg.MaxBodyBytes = orDefault(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	cfg.MaxIdleConns = orDefault(cfg.MaxIdleConns, DefaultMaxIdleConns)
	cfg.WarmInterval = orDefault(cfg.WarmInterval, DefaultWarmInterval)
	cfg.WarmConns = orDefault(cfg.WarmConns, 1)
	cfg.Header = cfg.Header.Clone()
	base := strings.TrimRight(cfg.URL, "/")
	c := &Client{
		cfg:         cfg,
		completions: base + CompletionsPath,
		chat:        base + ChatPath,
		messages:    base + MessagesPath,
		log:         cfg.Logger,
	}
	if c.log == nil {
		c.log = slog.Default()
	}
	rt := cfg.Transport
	if rt == nil {
		c.own = newTransport(cfg.MaxIdleConns)
		rt = c.own
	}
	c.http = &http.Client{Transport: rt, CheckRedirect: func(*http.Request, []*http.Request) error {
		// A render is a POST with a body: a redirect would drop or replay
		// it, and a render backend has no reason to send one.
		return http.ErrUseLastResponse
	}}
	if cfg.CacheBytes > 0 {
		c.cache = newCache(cfg.CacheBytes, rand.Uint64())
	}
	return c, nil
}

func orDefault[T int | int64 | time.Duration](v, def T) T {
	if v == 0 {
		return def
	}
	return v
}

// newTransport is a keep-alive HTTP/1.1 pool: vLLM's server (uvicorn)
// speaks no HTTP/2, so ALPN is kept from negotiating it too.
func newTransport(idle int) *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.ForceAttemptHTTP2 = false
	t.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	t.MaxIdleConns = 0
	t.MaxIdleConnsPerHost = idle
	t.IdleConnTimeout = 90 * time.Second
	return t
}

// Close closes the client's idle connections. The client stays usable.
func (c *Client) Close() {
	if c.own != nil {
		c.own.CloseIdleConnections()
	}
}

// URL returns the backend's base URL.
func (c *Client) URL() string { return c.cfg.URL }

// Render renders a completions, chat or Anthropic Messages body, told
// apart by its members: "messages" with a top-level "system" (Anthropic's
// system prompt, which no OpenAI chat body has) goes to the messages
// endpoint, other "messages" to the chat endpoint, anything else to the
// completions endpoint. It returns one Rendered per prompt (always one for
// chat and messages).
func (c *Client) Render(ctx context.Context, body []byte) ([]Rendered, error) {
	return c.RenderCharged(ctx, body, nil)
}

// Charge is told, before the client allocates it, of the memory in bytes
// a render's answer takes: its read window, and the token ids and items it
// keeps (Config.MaxTokens bounds them). An error from it stops the read:
// the render is ErrUnavailable wrapping it. Memory is never given back
// through it: the caller holds what it was charged until it is done with
// the render's Rendered (a failed render's is garbage at once). A render
// answered from the cache charges nothing.
type Charge func(n int64) error

// RenderCharged is Render, telling charge (when not nil) of the memory of
// the answer as it is read, so that a service can bound the answers being
// read with the request bodies it holds.
func (c *Client) RenderCharged(ctx context.Context, body []byte, charge Charge) ([]Rendered, error) {
	info, err := c.scan(body)
	if err != nil {
		return nil, c.refuse(ctx, c.completions, "completions", err)
	}
	switch {
	case info.messages && info.prompt:
		return nil, c.refuse(ctx, c.chat, "chat", errors.New(`body has both "messages" and "prompt"`))
	case info.messages && info.system:
		return c.send(ctx, c.messages, "messages", body, &info, c.cache != nil, charge)
	case info.messages:
		return c.send(ctx, c.chat, "chat", body, &info, c.cache != nil, charge)
	}
	return c.send(ctx, c.completions, "completions", body, &info, c.cache != nil, charge)
}

// errAnthropicBody refuses an Anthropic Messages body on the chat endpoint,
// which would render it without its system prompt, silently.
var errAnthropicBody = errors.New(`body has a top-level "system": an Anthropic Messages body, which the chat endpoint renders without its system prompt; use Messages or Render`)

// Chat renders an OpenAI chat completions body through
// /v1/chat/completions/render. An Anthropic Messages body (a top-level
// "system") is refused: see Messages.
func (c *Client) Chat(ctx context.Context, body []byte) (Rendered, error) {
	info, err := c.scan(body)
	if err == nil && info.system {
		err = errAnthropicBody
	}
	if err != nil {
		return Rendered{}, c.refuse(ctx, c.chat, "chat", err)
	}
	rs, err := c.send(ctx, c.chat, "chat", body, &info, c.cache != nil, nil)
	if err != nil {
		return Rendered{}, err
	}
	return rs[0], nil
}

// Messages renders an Anthropic Messages body (top-level "system",
// "messages" of content blocks) through /v1/messages/render, which vLLM
// serves beside the OpenAI endpoints since PR #45803. A vLLM without it
// answers 404: ErrBadRequest, saying so.
func (c *Client) Messages(ctx context.Context, body []byte) (Rendered, error) {
	info, err := c.scan(body)
	if err != nil {
		return Rendered{}, c.refuse(ctx, c.messages, "messages", err)
	}
	rs, err := c.send(ctx, c.messages, "messages", body, &info, c.cache != nil, nil)
	if err != nil {
		return Rendered{}, err
	}
	return rs[0], nil
}

// Completions renders an OpenAI completions body through
// /v1/completions/render: one Rendered per prompt of a prompt list.
func (c *Client) Completions(ctx context.Context, body []byte) ([]Rendered, error) {
	info, err := c.scan(body)
	if err != nil {
		return nil, c.refuse(ctx, c.completions, "completions", err)
	}
	return c.send(ctx, c.completions, "completions", body, &info, c.cache != nil, nil)
}

// warmBody is Warm's render: a short text chat, which every chat model's
// template takes.
var warmBody = []byte(`{"messages":[{"role":"user","content":"Hello"}]}`)

// Warm renders a short text chat until the backend answers, every
// Config.WarmInterval, then opens Config.WarmConns connections in all,
// and returns nil. An ErrBadRequest answer (an unknown model, refused
// credentials) ends it at once with that error, since retrying cannot
// help; the end of ctx ends it with ctx's error and the last failure.
func (c *Client) Warm(ctx context.Context) error {
	info, err := scanBody(warmBody)
	if err != nil {
		return err // warmBody is a constant object
	}
	var last error
	for {
		_, err := c.send(ctx, c.chat, "chat", warmBody, &info, false, nil)
		if err == nil {
			break
		}
		if errors.Is(err, ErrBadRequest) {
			return err
		}
		if ctx.Err() == nil || last == nil {
			last = err // not the render the end of ctx cut short
		}
		t := time.NewTimer(c.cfg.WarmInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("render: warm-up of %s: %w (last: %w)", c.cfg.URL, ctx.Err(), last)
		case <-t.C:
		}
	}
	if c.cfg.WarmConns < 2 {
		return nil
	}
	// Concurrent renders make the transport open a connection each (one
	// takes the idle connection of the check), and keep them idle in the
	// pool afterwards.
	errs := make([]error, c.cfg.WarmConns)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Go(func() { _, errs[i] = c.send(ctx, c.chat, "chat", warmBody, &info, false, nil) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Stats returns the client's counters.
func (c *Client) Stats() Stats {
	s := Stats{
		Renders:     c.renders.Load(),
		CacheHits:   c.hits.Load(),
		Unavailable: c.unavailable.Load(),
		BadRequest:  c.badReq.Load(),
		BadResponse: c.badResp.Load(),
		Canceled:    c.canceled.Load(),
		Latency:     time.Duration(c.latency.Load()),
	}
	if c.cache != nil {
		s.CacheEntries = c.cache.count.Load()
		s.CacheBytes = c.cache.bytes.Load()
		s.CacheEvictions = c.cache.evict.Load()
		s.CacheTooLarge = c.tooLarge.Load()
	}
	return s
}

func (c *Client) scan(body []byte) (bodyInfo, error) {
	if int64(len(body)) > c.cfg.MaxBodyBytes {
		return bodyInfo{}, fmt.Errorf("body of %d bytes exceeds the %d-byte limit", len(body), c.cfg.MaxBodyBytes)
	}
	return scanBody(body)
}

// refuse reports a body the client does not send.
func (c *Client) refuse(ctx context.Context, endpoint, name string, cause error) error {
	err := &Error{Endpoint: endpoint, kind: ErrBadRequest, err: cause}
	c.done(ctx, name, time.Now(), err, nil, false, false)
	return err
}

func (c *Client) send(ctx context.Context, endpoint, name string, body []byte, info *bodyInfo, cached bool, charge Charge) ([]Rendered, error) {
	start := time.Now()
	out := rewrite(body, info, c.cfg.Model, !c.cfg.KeepMMKwargs)
	mm := endpoint != c.completions && info.parts
	if cached {
		k := c.cache.key(endpoint, out)
		if rs, ok := c.cache.get(k); ok {
			c.hits.Add(1)
			rs = append([]Rendered(nil), rs...)
			for i := range rs {
				// Bodies naming different models send the same stamped body.
				rs[i].BodyModel = info.model
			}
			c.done(ctx, name, start, nil, rs, true, mm)
			return rs, nil
		}
		rs, err := c.post(ctx, endpoint, out, info, mm, charge)
		if err == nil && !c.cache.put(k, rs) {
			c.tooLarge.Add(1)
		}
		c.done(ctx, name, start, err, rs, false, mm)
		if err != nil {
			return nil, err
		}
		return append([]Rendered(nil), rs...), nil
	}
	rs, err := c.post(ctx, endpoint, out, info, mm, charge)
	c.done(ctx, name, start, err, rs, false, mm)
	return rs, err
}

// post sends one render and reads its answer.
func (c *Client) post(ctx context.Context, endpoint string, body []byte, info *bodyInfo, mm bool, charge Charge) ([]Rendered, error) {
	timeout := c.cfg.Timeout
	if mm {
		timeout = c.cfg.MMTimeout
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, endpoint, bytes.NewReader(body))
	if err != nil {
		return nil, &Error{Endpoint: endpoint, Multimodal: mm, kind: ErrBadRequest, err: err}
	}
	for k, v := range c.cfg.Header {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	// A render has no side effect: this (unsent, being empty) marks the
	// POST idempotent, so that the transport sends it again on a new
	// connection when the backend closed the pooled one just as it was
	// reused (vLLM's server closes connections idle for 5 s).
	req.Header["Idempotency-Key"] = nil
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, c.transportErr(ctx, rctx, endpoint, 0, timeout, mm, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		snippet, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		typ, msg := vllmError(snippet)
		e := &Error{Endpoint: endpoint, Status: resp.StatusCode, Type: typ, Message: msg, Multimodal: mm, kind: statusKind(resp.StatusCode)}
		if endpoint == c.messages && typ == "" && (resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed) {
			// A route the server lacks (FastAPI's {"detail":"Not Found"}),
			// not vLLM's ErrorResponse for an unknown model.
			e.err = errNoMessagesEndpoint
		}
		return nil, e
	}
	limit := c.cfg.MaxResponseBytes
	if resp.ContentLength > limit {
		return nil, &Error{Endpoint: endpoint, Status: resp.StatusCode, Multimodal: mm, kind: ErrBadResponse,
			err: fmt.Errorf("answer of %d bytes exceeds Config.MaxResponseBytes (%d)", resp.ContentLength, limit)}
	}
	win := c.window()
	defer c.windows.Put(win)
	if charge != nil {
		if err := charge(int64(len(win))); err != nil {
			return nil, c.answerErr(ctx, rctx, endpoint, resp.StatusCode, timeout, mm, chargeError{err})
		}
	}
	rs, err := readAnswer(resp.Body, endpoint == c.completions, win[:], limit, c.cfg.MaxTokens, charge)
	if err != nil {
		return nil, c.answerErr(ctx, rctx, endpoint, resp.StatusCode, timeout, mm, err)
	}
	for i := range rs {
		r := &rs[i]
		r.BodyModel = info.model
		if r.Model == "" {
			r.Model = c.cfg.Model
		}
		if r.Model == "" {
			r.Model = info.model
		}
		if !r.saltEchoed {
			r.Request.CacheSalt = info.salt
		}
	}
	return rs, nil
}

// errNoMessagesEndpoint explains a 404 of the messages endpoint.
var errNoMessagesEndpoint = errors.New(`the backend has no /v1/messages/render (vLLM added it in PR #45803): upgrade it to render Anthropic Messages bodies, which the chat endpoint would render without their system prompt`)

// window returns a pooled read window for an answer.
func (c *Client) window() *[answerWindow]byte {
	if w, ok := c.windows.Get().(*[answerWindow]byte); ok {
		return w
	}
	return new([answerWindow]byte)
}

// answerErr classifies an error reading a 2xx answer.
func (c *Client) answerErr(ctx, rctx context.Context, endpoint string, status int, timeout time.Duration, mm bool, err error) error {
	e := &Error{Endpoint: endpoint, Status: status, Multimodal: mm, err: err}
	var ce chargeError
	switch {
	case errors.As(err, &ce):
		e.kind, e.err = ErrUnavailable, fmt.Errorf("no memory for the answer: %w", ce.err)
	case errors.Is(err, ErrTooManyTokens):
		e.kind = ErrBadRequest
	case errors.Is(err, errTooManyItems):
		e.kind = ErrBadRequest
	case errors.Is(err, errAnswerTooLarge):
		e.kind, e.err = ErrBadResponse, fmt.Errorf("answer exceeds Config.MaxResponseBytes (%d)", c.cfg.MaxResponseBytes)
	case errors.Is(err, errAnswer):
		e.kind = ErrBadResponse
	default:
		return c.transportErr(ctx, rctx, endpoint, status, timeout, mm, fmt.Errorf("reading the answer: %w", err))
	}
	return e
}

// transportErr classifies a failure without an answer: the caller's
// context, the client's own timeout, or the backend.
func (c *Client) transportErr(ctx, rctx context.Context, endpoint string, status int, timeout time.Duration, mm bool, err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err // its text repeats the method and URL the Error has
	}
	switch {
	case ctx.Err() != nil:
		return &Error{Endpoint: endpoint, Status: status, Multimodal: mm, err: fmt.Errorf("caller gave up: %w", context.Cause(ctx))}
	case rctx.Err() != nil:
		field := "Config.Timeout"
		if mm {
			field = "Config.MMTimeout"
		}
		return &Error{Endpoint: endpoint, Status: status, Multimodal: mm, Timeout: timeout, kind: ErrUnavailable,
			err: fmt.Errorf("no answer within %v (%s): %w", timeout, field, context.DeadlineExceeded)}
	}
	return &Error{Endpoint: endpoint, Status: status, Multimodal: mm, kind: ErrUnavailable, err: err}
}

// statusKind classifies an error status: vLLM answers a body it refuses
// with 400, an unknown model with 404 and an unsupported feature with 501;
// a backend that cannot render now answers 5xx, 408 or 429.
func statusKind(status int) error {
	switch {
	case status == http.StatusNotImplemented:
		return ErrBadRequest
	case status >= 500, status == http.StatusRequestTimeout, status == http.StatusTooManyRequests:
		return ErrUnavailable
	case status >= 400:
		return ErrBadRequest
	}
	return ErrBadResponse // 1xx or 3xx: not an answer a render gives
}

// done counts, logs and observes a finished render.
func (c *Client) done(ctx context.Context, name string, start time.Time, err error, rs []Rendered, cached, mm bool) {
	d := time.Since(start)
	if err == nil && !cached {
		c.renders.Add(1)
		c.latency.Add(int64(d))
	}
	if err != nil {
		kind := Kind(err)
		var gate int
		switch kind {
		case "unavailable":
			c.unavailable.Add(1)
		case "bad_request":
			c.badReq.Add(1)
			gate = 1
		case "bad_response":
			c.badResp.Add(1)
			gate = 2
		default:
			c.canceled.Add(1)
			gate = 3
		}
		if gate != 3 {
			if skipped, ok := c.gates[gate].Allow(time.Second); ok {
				c.log.LogAttrs(ctx, slog.LevelWarn, "render failed", slog.String("backend", c.cfg.URL),
					slog.String("kind", kind), slog.String("err", err.Error()), slog.Int64("skipped", skipped))
			}
		}
	}
	if c.cfg.Observe != nil {
		o := Observation{Endpoint: name, Duration: d, Err: err, Cached: cached, Multimodal: mm, Prompts: len(rs)}
		for i := range rs {
			o.Tokens += len(rs[i].Request.Tokens)
		}
		c.cfg.Observe(o)
	}
}
