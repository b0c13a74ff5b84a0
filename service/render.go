package service

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/render"
)

// Prompts as routers hold them. With Config.RenderURL, /v1/score and
// /v1/pick take an OpenAI completions or chat body in "request" (a /v1/score
// also as its whole body) and render it through vLLM's own render endpoints
// (package render) into the engine's exact tokens, multimodal items and cache
// salt; "tokens" or "tokens_b64", when given, win. A render backend that is
// down, overloaded or slower than its timeout is a 503 with Retry-After
// (reason render_unavailable, the message naming the backend and the flag
// whose deadline passed), never a silent zero score; a body vLLM refuses is
// a 400, a prompt that renders to more than --max-tokens a 413, and an
// answer that is not vLLM's a 502. A body with a top-level "system" is an
// Anthropic Messages body, rendered by /v1/messages/render. The render is
// part of the request: --request-timeout bounds it, so a service rendering
// images needs one above --render-mm-timeout (and --http-write-timeout
// above that). Its answer counts against --max-body-memory with the body
// being served, as it arrives: the token ids (4 bytes each, read no further
// than --max-tokens) and a 32 KiB read window, while the processed image
// tensors vLLM sends (features.kwargs_data) stream past and cost nothing;
// --render-max-response-bytes bounds the bytes read of an answer.

// RenderConfig is the part of Config that renders OpenAI bodies.
type RenderConfig struct {
	// RenderURL is the vLLM server (any OpenAI one, or `vllm launch
	// render MODEL`) that renders bodies; empty: bodies are refused.
	RenderURL string
	// RenderModel, when set, is stamped into every body's "model" (a
	// render-only server needs it); empty forwards the body's own.
	RenderModel string
	// RenderTimeout and RenderMMTimeout bound a text and a multimodal
	// render; zero: render.DefaultTimeout and render.DefaultMMTimeout.
	RenderTimeout, RenderMMTimeout time.Duration
	// RenderCacheBytes bounds a cache of recent renders; zero: none.
	RenderCacheBytes int64
	// RenderMaxResponseBytes bounds the bytes read of a render answer, the
	// tensors it skips included; zero: render.DefaultMaxResponseBytes.
	RenderMaxResponseBytes int64
}

func (c *RenderConfig) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.RenderURL, "render-url", "", "vLLM server that renders OpenAI bodies into the engine's tokens (any vLLM OpenAI server, or `vllm launch render MODEL`): /v1/score and /v1/pick then take a completions or chat body in \"request\"")
	fs.StringVar(&c.RenderModel, "render-model", "", "model stamped into every body rendered (a render-only server needs it); default the body's own")
	fs.DurationVar(&c.RenderTimeout, "render-timeout", render.DefaultTimeout, "how long a text render may take")
	fs.DurationVar(&c.RenderMMTimeout, "render-mm-timeout", render.DefaultMMTimeout, "how long a multimodal render (chat content with parts) may take")
	fs.Var((*sizeFlag)(&c.RenderCacheBytes), "render-cache-bytes", "memory bound of a cache of recent renders (0: none)")
	c.RenderMaxResponseBytes = render.DefaultMaxResponseBytes
	fs.Var((*sizeFlag)(&c.RenderMaxResponseBytes), "render-max-response-bytes", "most bytes read of a render answer, the image tensors it skips without keeping included (one 1024x1024 image is about 33 MiB); more is answered 502")
}

// renderer is the service's render client and its metrics.
type renderer struct {
	c       *render.Client
	seconds *prometheus.HistogramVec
}

// newRenderer makes the render client of cfg, nil without RenderURL.
func (s *Service) newRenderer(cfg RenderConfig) (*renderer, error) {
	if cfg.RenderURL == "" {
		return nil, nil
	}
	r := &renderer{seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvsource_render_seconds",
		Help:    "Renders of OpenAI bodies by vLLM (--render-url), by endpoint and result: ok, cached, unavailable, bad_request, bad_response, canceled.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}, []string{"endpoint", "result"})}
	c, err := render.New(render.Config{URL: cfg.RenderURL, Model: cfg.RenderModel, Timeout: cfg.RenderTimeout,
		MMTimeout: cfg.RenderMMTimeout, CacheBytes: cfg.RenderCacheBytes, Logger: s.log,
		MaxResponseBytes: cfg.RenderMaxResponseBytes, MaxTokens: s.cfg.MaxTokens,
		Observe: func(o render.Observation) {
			result := render.Kind(o.Err)
			switch {
			case o.Err == nil && o.Cached:
				result = "cached"
			case o.Err == nil:
				result = "ok"
			case result == "":
				result = "failed"
			}
			r.seconds.WithLabelValues(o.Endpoint, result).Observe(o.Duration.Seconds())
		}})
	if err != nil {
		return nil, fmt.Errorf("--render-url: %w", err)
	}
	r.c = c
	s.reg.MustRegister(r.seconds)
	if mm := cmp.Or(cfg.RenderMMTimeout, render.DefaultMMTimeout); s.cfg.RequestTimeout < mm {
		s.log.Warn("kvsource serve: --request-timeout is shorter than a multimodal render may take; raise it (and --http-write-timeout) for bodies with images",
			"request_timeout", s.cfg.RequestTimeout, "render_mm_timeout", mm)
	}
	return r, nil
}

// warm checks the render backend in the background, saying whether it
// answers: a service can start before its sidecar.
func (r *renderer) warm(ctx context.Context, s *Service) {
	if r == nil {
		return
	}
	go func() {
		start := time.Now()
		if err := r.c.Warm(ctx); err != nil {
			if ctx.Err() == nil {
				s.log.Error("kvsource serve: the render backend refuses the warm-up render", "render_url", r.c.URL(), "err", err)
			}
			return
		}
		s.log.Info("kvsource serve: render backend answers", "render_url", r.c.URL(), "after", time.Since(start).Round(time.Millisecond))
	}()
}

func (r *renderer) close() {
	if r != nil {
		r.c.Close()
	}
}

// renderUnavailable marks a render that failed for the backend: 503.
type renderUnavailable struct{ err error }

func (e renderUnavailable) Error() string { return e.err.Error() }
func (e renderUnavailable) Unwrap() error { return e.err }

// renderBadResponse marks an answer that is not vLLM's: 502.
type renderBadResponse struct{ err error }

func (e renderBadResponse) Error() string { return e.err.Error() }
func (e renderBadResponse) Unwrap() error { return e.err }

// openAIBody reports whether body is an OpenAI completions or chat body
// itself: an object with "messages" or "prompt", which no kvsource request
// has. It is asked only of a body that did not decode as one.
func openAIBody(body []byte) bool {
	var top map[string]json.RawMessage
	if json.Unmarshal(body, &top) != nil {
		return false
	}
	_, chat := top["messages"]
	_, completion := top["prompt"]
	return chat || completion
}

// promptOf is p's request: its tokens when it has them, else its OpenAI
// body (whole, when the request body is one, or p.Request) rendered, which
// also fills in p.Model when p has none and p.Tokens for the limits. The
// render's answer is counted in b.held, against --max-body-memory.
func (s *Service) promptOf(ctx context.Context, b *bodyBuf, p *Prompt, whole []byte) (hashing.Request, error) {
	body := whole
	if body == nil && p.Tokens == nil && len(p.Request) > 0 && string(p.Request) != "null" {
		body = p.Request
	}
	if body == nil {
		r, err := p.request()
		if err != nil {
			return r, badRequest{err}
		}
		return r, s.checkPrompt(p)
	}
	r, err := s.rendered(ctx, b, p, body)
	if err != nil {
		return r, err
	}
	if p.Model == "" {
		return r, badRequest{errors.New(`"model" is required: neither the request nor its render names one`)}
	}
	p.Tokens = r.Tokens
	return r, s.checkPrompt(p)
}

// rendered renders body for p, with the model the index knows it by,
// counting its answer in b.held.
func (s *Service) rendered(ctx context.Context, b *bodyBuf, p *Prompt, body []byte) (hashing.Request, error) {
	if s.render == nil {
		return hashing.Request{}, badRequest{errors.New(`"request" (an OpenAI body) needs kvsource serve --render-url; send "tokens" or "tokens_b64" instead`)}
	}
	rs, err := s.render.c.RenderCharged(ctx, body, func(n int64) error {
		if !s.reserveBody(n) {
			return errBodyMemory
		}
		b.held += n
		return nil
	})
	var re *render.Error
	switch {
	case errors.Is(err, errBodyMemory):
		return hashing.Request{}, err // an overload of this service, not of the backend
	case errors.As(err, &re) && re.Timeout > 0:
		flag := "--render-timeout"
		if re.Multimodal {
			flag = "--render-mm-timeout"
		}
		return hashing.Request{}, renderUnavailable{fmt.Errorf("no answer from %s within %v (%s): %w", s.render.c.URL(), re.Timeout, flag, err)}
	case err != nil && render.Kind(err) == "canceled" && errors.Is(ctx.Err(), context.DeadlineExceeded):
		// The request's deadline passed while the backend rendered.
		return hashing.Request{}, renderUnavailable{fmt.Errorf("no answer from %s within what was left of --request-timeout (%v): %w",
			s.render.c.URL(), s.cfg.RequestTimeout, err)}
	case errors.Is(err, render.ErrUnavailable):
		return hashing.Request{}, renderUnavailable{err}
	case errors.Is(err, render.ErrTooManyTokens):
		return hashing.Request{}, tooLarge{fmt.Errorf(`"request" renders to more than %d tokens (--max-tokens): %w`, s.cfg.MaxTokens, err)}
	case errors.Is(err, render.ErrBadRequest):
		return hashing.Request{}, badRequest{err}
	case errors.Is(err, render.ErrBadResponse):
		return hashing.Request{}, renderBadResponse{err}
	case err != nil:
		return hashing.Request{}, err
	}
	if len(rs) != 1 {
		return hashing.Request{}, badRequest{fmt.Errorf(`"request" renders %d prompts; score or pick one at a time`, len(rs))}
	}
	if p.Model == "" {
		p.Model = rs[0].Model
	}
	req := rs[0].Request
	if p.LoRAName != "" {
		req = rs[0].WithLoRA(p.LoRAName, false)
	}
	if p.CacheSalt != "" {
		req.CacheSalt = p.CacheSalt
	}
	return req, nil
}

func isRenderError(err error) bool { _, _, ok := renderStatus(err); return ok }

// renderStatus is the status and reason of a render error, for classify.
func renderStatus(err error) (int, string, bool) {
	var u renderUnavailable
	var b renderBadResponse
	switch {
	case errors.As(err, &u):
		return http.StatusServiceUnavailable, rejectRenderUnavailable, true
	case errors.As(err, &b):
		return http.StatusBadGateway, rejectRenderBadResponse, true
	}
	return 0, "", false
}
