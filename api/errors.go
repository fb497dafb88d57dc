package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// StatusClientClosed is the status logged and counted when the client left before the answer
// was complete (nginx's 499). The client never sees it.
const StatusClientClosed = 499

// Kind is what went wrong, as the proxy's code names it; wireCodes says once how each kind is
// spelled on the wire (status, OpenAI error type and code). Call sites name a kind and say
// what happened; they never spell a status or a type.
type Kind int

const (
	KindInvalidValue        Kind = iota // a field of the request is wrong (BadRequest)
	KindUnsupportedParam                // a field the proxy cannot serve as asked
	KindInvalidContentType              // a body of the wrong media type
	KindUnreadableBody                  // the body could not be read
	KindInvalidPrefiller                // a sidecar prefiller header that names no host:port
	KindInvalidAPIKey                   // no client key, or a wrong one
	KindPrefillerNotAllowed             // a sidecar prefiller the allowlist does not cover
	KindNoRoute                         // no such route
	KindModelNotFound                   // a model no engine serves
	KindMethodNotAllowed                // a route that takes another method
	KindBodyTimeout                     // the body did not arrive in time
	KindDuplicateID                     // an X-Request-Id already in flight
	KindTooLarge                        // a body over the limit
	KindRateLimited                     // a client over its limits
	KindQueueFull                       // every backend busy and the wait queue full
	KindTenantQueueFull                 // the tenant's share of the wait queue is full
	KindPoolSaturated                   // the wait queue full within every tenant's share
	KindClientClosed                    // the client left
	KindInternal                        // the proxy could not build what it sends
	KindPanicked                        // serving the request panicked
	KindBackendStatus                   // a backend answered with a 5xx
	KindBackendUnreachable              // a backend could not be reached, or broke
	KindBadKVParams                     // a prefiller's kv_transfer_params are unusable
	KindBackendRefused                  // a backend's 4xx that is not a whole JSON error
	KindNoBackend                       // no healthy backend
	KindQueueTimeout                    // every backend stayed busy for the queue timeout
	KindShutdown                        // the proxy is shutting down
	KindPrefillTimeout                  // a prefill did not answer in time
	KindDecodeTimeout                   // a decode did not answer in time, or went silent
)

// wire is how an error kind is spelled to a client.
type wire struct {
	status int
	typ    string
	code   string
}

// wireCodes maps every error kind to the wire. A 429 has one type, whoever refuses: OpenAI's
// "requests".
var wireCodes = map[Kind]wire{
	KindInvalidValue:        {http.StatusBadRequest, "invalid_request_error", "invalid_value"},
	KindUnsupportedParam:    {http.StatusBadRequest, "invalid_request_error", "unsupported_parameter"},
	KindInvalidContentType:  {http.StatusBadRequest, "invalid_request_error", "invalid_content_type"},
	KindUnreadableBody:      {http.StatusBadRequest, "invalid_request_error", "unreadable_body"},
	KindInvalidPrefiller:    {http.StatusBadRequest, "invalid_request_error", "invalid_prefiller"},
	KindInvalidAPIKey:       {http.StatusUnauthorized, "authentication_error", "invalid_api_key"},
	KindPrefillerNotAllowed: {http.StatusForbidden, "permission_error", "prefiller_not_allowed"},
	KindNoRoute:             {http.StatusNotFound, "invalid_request_error", "not_found"},
	KindModelNotFound:       {http.StatusNotFound, "invalid_request_error", "model_not_found"},
	KindMethodNotAllowed:    {http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed"},
	KindBodyTimeout:         {http.StatusRequestTimeout, "invalid_request_error", "request_timeout"},
	KindDuplicateID:         {http.StatusConflict, "invalid_request_error", "duplicate_request_id"},
	KindTooLarge:            {http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large"},
	KindRateLimited:         {http.StatusTooManyRequests, "requests", "rate_limit_exceeded"},
	KindQueueFull:           {http.StatusTooManyRequests, "requests", "queue_full"},
	KindTenantQueueFull:     {http.StatusTooManyRequests, "requests", "tenant_queue_full"},
	KindPoolSaturated:       {http.StatusServiceUnavailable, "service_unavailable", "pool_saturated"},
	KindClientClosed:        {StatusClientClosed, "client_closed_request", "client_closed_request"},
	KindInternal:            {http.StatusInternalServerError, "internal_error", "internal"},
	KindPanicked:            {http.StatusBadGateway, "internal_error", "internal"},
	KindBackendStatus:       {http.StatusBadGateway, "bad_gateway", "backend_error"},
	KindBackendUnreachable:  {http.StatusBadGateway, "bad_gateway", "backend_unreachable"},
	KindBadKVParams:         {http.StatusBadGateway, "bad_gateway", "bad_kv_transfer_params"},
	KindBackendRefused:      {http.StatusBadRequest, "invalid_request_error", "backend_refused"},
	KindNoBackend:           {http.StatusServiceUnavailable, "service_unavailable", "no_backend"},
	KindQueueTimeout:        {http.StatusServiceUnavailable, "service_unavailable", "queue_timeout"},
	KindShutdown:            {http.StatusServiceUnavailable, "service_unavailable", "shutting_down"},
	KindPrefillTimeout:      {http.StatusGatewayTimeout, "timeout", "prefill_timeout"},
	KindDecodeTimeout:       {http.StatusGatewayTimeout, "timeout", "decode_timeout"},
}

// refusedTypes are the types of a backend's refusal by its status (KindBackendRefused takes
// the backend's status); invalid_request_error for any other.
var refusedTypes = map[int]string{
	http.StatusUnauthorized:    "authentication_error",
	http.StatusForbidden:       "authentication_error",
	http.StatusNotFound:        "not_found_error",
	http.StatusTooManyRequests: "requests",
}

// Error is an error on its way to the client in the OpenAI shape. message is what the
// client reads; cause is for the log only.
type Error struct {
	Kind Kind
	// Status is the answer's Status: the kind's, or a backend's own for a refusal passed on.
	Status     int
	Param      string
	Message    string
	RetryAfter int
	Cause      error
	// raw, when set, is a backend's own error answer, passed to the client as it came.
	raw     []byte
	rawType string
	// Limit, for a refusal by a client's limits, is its reason (the proxy's limits).
	Limit string
	// BearerChallenge adds "WWW-Authenticate: Bearer", which a 401 must carry (RFC 9110
	// section 15.5.2).
	BearerChallenge bool
}

// NewError is an error of kind telling the client message.
func NewError(kind Kind, message string) *Error {
	return &Error{Kind: kind, Status: wireCodes[kind].status, Message: message}
}

// With returns e With a param, a cause and a Retry-After (seconds) where they are set.
func (e *Error) With(param string, cause error, retryAfter int) *Error {
	e.Param, e.Cause, e.RetryAfter = param, cause, retryAfter
	return e
}

// wire is how e is spelled to the client: its kind's, with a refused status's own type.
func (e *Error) wire() wire {
	w := wireCodes[e.Kind]
	w.status = e.Status
	if e.Kind == KindBackendRefused {
		if t, ok := refusedTypes[e.Status]; ok {
			w.typ = t
		}
	}
	return w
}

func (e *Error) Error() string {
	if e.Cause != nil {
		return e.Message + ": " + e.Cause.Error()
	}
	return e.Message
}

func BadRequest(param, msg string) *Error {
	return NewError(KindInvalidValue, msg).With(param, nil, 0)
}

var ErrClientGone = NewError(KindClientClosed, "client closed the request")

// ErrShuttingDown is the cause a request's context is cancelled with when shutdown passes its
// drain deadline; ErrShutdownAnswer is what its client is told.
var (
	ErrShuttingDown   = errors.New("the proxy is shutting down")
	ErrShutdownAnswer = NewError(KindShutdown, "the proxy is shutting down and gave up on this request; retry it").With("", ErrShuttingDown, 1)
)

// ErrorBody is the OpenAI error shape.
type ErrorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	} `json:"error"`
}

func (e *Error) Body() []byte {
	var b ErrorBody
	w := e.wire()
	b.Error.Message = e.Message
	b.Error.Type = w.typ
	b.Error.Code = w.code
	if e.Param != "" {
		p := e.Param
		b.Error.Param = &p
	}
	out, _ := json.Marshal(b)
	return out
}

// WriteError is the one place an error becomes an HTTP answer.
func WriteError(w http.ResponseWriter, e *Error) {
	if e.Status == StatusClientClosed {
		return // nobody is listening
	}
	h := w.Header()
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	if e.BearerChallenge {
		h.Set("WWW-Authenticate", "Bearer")
	}
	if _, ok := w.(*anthropicWriter); ok && e.raw != nil {
		// A backend's own error, in the route's shape.
		h.Set("Content-Type", "application/json")
		w.WriteHeader(e.Status)
		w.Write(e.anthropicBody())
		return
	}
	if e.raw != nil {
		ct := e.rawType
		if ct == "" {
			ct = "application/json"
		}
		h.Set("Content-Type", ct)
		w.WriteHeader(e.Status)
		w.Write(e.raw)
		return
	}
	h.Set("Content-Type", "application/json")
	w.WriteHeader(e.Status)
	if _, ok := w.(*anthropicWriter); ok {
		w.Write(e.anthropicBody())
		return
	}
	w.Write(e.Body())
}

// FromRouter maps a router's refusal to an answer.
func FromRouter(err error, role routerconfig.Role) *Error {
	switch {
	case errors.Is(err, router.ErrQueueFull):
		return NewError(KindQueueFull, "every "+string(role)+" backend is busy and the wait queue is full; retry later").With("", err, 1)
	case errors.Is(err, router.ErrTenantQueueFull):
		return NewError(KindTenantQueueFull, "your share of the "+string(role)+" wait queue is full: your other requests are waiting; retry later").With("", err, 1)
	case errors.Is(err, router.ErrPoolSaturated):
		return NewError(KindPoolSaturated, "every "+string(role)+" backend is busy and the wait queue is full within every tenant's share; retry later").With("", err, 1)
	case errors.Is(err, router.ErrQueueTimeout):
		return NewError(KindQueueTimeout, "every "+string(role)+" backend stayed busy for the whole queue timeout; retry later").With("", err, 1)
	default:
		return NewError(KindNoBackend, "no healthy "+string(role)+" backend is available").With("", err, 1)
	}
}

// FromBackend maps a failed backend call to an answer: a backend's 4xx goes to the client as
// it came (it is about the client's request); anything else is the proxy's 502, or a 504 of
// kind timeout.
func FromBackend(err error, role routerconfig.Role, timeout Kind) *Error {
	var se *engine.StatusError
	if errors.As(err, &se) {
		if se.Status >= 400 && se.Status < 500 {
			return clientFault(se, role, err)
		}
		return NewError(KindBackendStatus, string(role)+" backend answered with status "+strconv.Itoa(se.Status)).With("", err, 0)
	}
	if errors.Is(err, ErrPhaseTimeout) {
		return NewError(timeout, string(role)+" backend did not answer in time ("+wireCodes[timeout].code+")").With("", err, 0)
	}
	if errors.Is(err, engine.ErrBadKVParams) {
		return NewError(KindBadKVParams, "prefill backend answered with invalid kv_transfer_params").With("", err, 0)
	}
	return NewError(KindBackendUnreachable, string(role)+" backend could not be reached or failed").With("", err, 0)
}

var ErrPhaseTimeout = errors.New("phase timeout")

// clientFault is a backend's 4xx answer on its way to the client: as it came when it is a
// whole JSON object (the engine's own OpenAI-shape error), else in the OpenAI shape with the
// backend's status: a body cut at the size bound, or an empty or non-JSON one, would leave
// the client a body it cannot parse under a JSON content type. A short plain-text reason is
// kept in the message.
func clientFault(se *engine.StatusError, role routerconfig.Role, err error) *Error {
	body := bytes.TrimSpace(se.Body)
	jsonType := se.ContentType == "" || strings.HasPrefix(strings.ToLower(strings.TrimSpace(se.ContentType)), "application/json")
	if !se.Truncated && jsonType && len(body) > 0 && body[0] == '{' && json.Valid(body) {
		return &Error{Kind: KindBackendRefused, Status: se.Status, raw: se.Body, rawType: "application/json", Cause: err}
	}
	msg := string(role) + " backend refused the request with status " + strconv.Itoa(se.Status)
	if strings.HasPrefix(strings.ToLower(se.ContentType), "text/plain") && !se.Truncated && len(body) > 0 && len(body) <= 512 && utf8.Valid(body) {
		msg += ": " + string(body)
	}
	e := NewError(KindBackendRefused, msg).With("", err, 0)
	e.Status = se.Status
	return e
}

// anthropicWriter is the writer of an answer on a Messages route: the errors written to it
// take Anthropic's shape ({"type":"error","error":{"type","message"}}), which Anthropic's
// SDKs read, whoever refuses the request (the key check, the limits, the proxy, an engine).
type anthropicWriter struct{ http.ResponseWriter }

// Unwrap lets http.ResponseController reach the connection's writer (flushes, deadlines).
func (w *anthropicWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
