package render

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// Errors that callers branch on. Every error of a render wraps exactly one
// of them, except a render the caller's own context ended, which wraps the
// context's error instead.
var (
	// ErrUnavailable reports a backend that did not render: refused or
	// dropped connections, no answer within the timeout, 5xx answers
	// (other than 501), 408 and 429. A service answers 503.
	ErrUnavailable = errors.New("render: backend unavailable")
	// ErrBadRequest reports a body the client refuses (not one JSON object,
	// too large) or one the backend refused with a 4xx or 501 answer, its
	// message included. A service answers 400.
	ErrBadRequest = errors.New("render: request refused")
	// ErrBadResponse reports a 2xx answer that is not what vLLM's render
	// endpoints give: malformed JSON, wrong types, impossible token ids or
	// placeholders, more than Config.MaxResponseBytes. A service answers
	// 502.
	ErrBadResponse = errors.New("render: bad response from the backend")
	// ErrTooManyTokens is wrapped, beside ErrBadRequest, by a render whose
	// prompt has more token ids than Config.MaxTokens: the client stops
	// reading the answer there. A service answers 413.
	ErrTooManyTokens = errors.New("render: the rendered prompt has more tokens than Config.MaxTokens")
)

// errTooManyItems is a rendered prompt with more multimodal items than the
// client reads (maxFeatureBytes): an ErrBadRequest.
var errTooManyItems = errors.New("the rendered prompt has more multimodal items than the client reads")

// Error is a render's error: which backend endpoint failed, and why.
type Error struct {
	// Endpoint is the URL posted to.
	Endpoint string
	// Status is the HTTP status of the answer, 0 when there was none.
	Status int
	// Type and Message are vLLM's error type and message from an error
	// answer's ErrorResponse JSON; Message is the start of the body when it
	// is not that JSON.
	Type, Message string
	// Multimodal reports a chat or messages render with part-array
	// content, which Config.MMTimeout bounds.
	Multimodal bool
	// Timeout is the client's own timeout (Config.Timeout, or MMTimeout
	// when Multimodal) when it ended the render, else 0: the backend
	// gave no answer in time (ErrUnavailable). A caller's deadline that
	// came first is no Timeout but the caller's context error.
	Timeout time.Duration

	kind error // one of the sentinels, nil when the caller's context ended
	err  error // the cause, if any
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("render: POST ")
	b.WriteString(e.Endpoint)
	b.WriteString(": ")
	switch {
	case e.Status != 0:
		fmt.Fprintf(&b, "status %d", e.Status)
		if e.Type != "" {
			b.WriteString(" ")
			b.WriteString(e.Type)
		}
		if e.Message != "" {
			b.WriteString(": ")
			b.WriteString(e.Message)
		}
		if e.err != nil {
			b.WriteString(": ")
			b.WriteString(e.err.Error())
		}
	case e.err != nil:
		b.WriteString(e.err.Error())
	default:
		b.WriteString(e.kind.Error())
	}
	return b.String()
}

// Unwrap gives the sentinel and the cause, for errors.Is and errors.As.
func (e *Error) Unwrap() []error {
	var errs []error
	if e.kind != nil {
		errs = append(errs, e.kind)
	}
	if e.err != nil {
		errs = append(errs, e.err)
	}
	return errs
}

// Kind names the class of a render error for a metric's label:
// "unavailable", "bad_request", "bad_response", "canceled" (the caller's
// context ended) or "" for nil and other errors.
func Kind(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrUnavailable):
		return "unavailable"
	case errors.Is(err, ErrBadRequest):
		return "bad_request"
	case errors.Is(err, ErrBadResponse):
		return "bad_response"
	}
	var e *Error
	if errors.As(err, &e) && e.kind == nil {
		return "canceled"
	}
	return ""
}

// maxErrorBody bounds what is read of an error answer: vLLM's messages are
// short, and a proxy's HTML error page need not be read whole.
const maxErrorBody = 8 << 10

// maxErrorMessage bounds the message an Error carries.
const maxErrorMessage = 512

// vllmError reads vLLM's ErrorResponse: {"error": {"message", "type",
// "param", "code"}} since 2025, {"object": "error", "message", "type",
// "param", "code"} before. Anything else is quoted as it came.
func vllmError(body []byte) (typ, msg string) {
	var v struct {
		Error *struct {
			Message string `json:"message"`
			Type    string `json:"type"`
		} `json:"error"`
		Message string `json:"message"`
		Type    string `json:"type"`
	}
	if err := json.Unmarshal(body, &v); err == nil {
		if v.Error != nil {
			return clip(v.Error.Type), clip(v.Error.Message)
		}
		if v.Message != "" {
			return clip(v.Type), clip(v.Message)
		}
	}
	return "", clip(strings.TrimSpace(string(body)))
}

// clip bounds s to maxErrorMessage bytes on a rune boundary.
func clip(s string) string {
	if len(s) <= maxErrorMessage {
		return s
	}
	s = s[:maxErrorMessage]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "..."
}
