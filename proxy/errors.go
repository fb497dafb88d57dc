package proxy

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
)

// StatusClientClosed is the status logged and counted when the client left before the answer
// was complete (nginx's 499). The client never sees it.
const StatusClientClosed = 499

// errKind is what went wrong, as the proxy's code names it; wireCodes says once how each kind is
// spelled on the wire (status, OpenAI error type and code). Call sites name a kind and say
// what happened; they never spell a status or a type.
type errKind int

const (
	errInvalidValue        errKind = iota // a field of the request is wrong (badRequest)
	errUnsupportedParam                   // a field the proxy cannot serve as asked
	errInvalidContentType                 // a body of the wrong media type
	errUnreadableBody                     // the body could not be read
	errInvalidPrefiller                   // a sidecar prefiller header that names no host:port
	errInvalidAPIKey                      // no client key, or a wrong one
	errPrefillerNotAllowed                // a sidecar prefiller the allowlist does not cover
	errNoRoute                            // no such route
	errModelNotFound                      // a model no engine serves
	errMethodNotAllowed                   // a route that takes another method
	errBodyTimeout                        // the body did not arrive in time
	errDuplicateID                        // an X-Request-Id already in flight
	errTooLarge                           // a body over the limit
	errRateLimited                        // a client over its limits
	errQueueFull                          // every backend busy and the wait queue full
	errTenantQueueFull                    // the tenant's share of the wait queue is full
	errPoolSaturated                      // the wait queue full within every tenant's share
	errClientClosed                       // the client left
	errInternal                           // the proxy could not build what it sends
	errPanicked                           // serving the request panicked
	errBackendStatus                      // a backend answered with a 5xx
	errBackendUnreachable                 // a backend could not be reached, or broke
	errBadKVParams                        // a prefiller's kv_transfer_params are unusable
	errBackendRefused                     // a backend's 4xx that is not a whole JSON error
	errNoBackend                          // no healthy backend
	errQueueTimeout                       // every backend stayed busy for the queue timeout
	errShutdown                           // the proxy is shutting down
	errPrefillTimeout                     // a prefill did not answer in time
	errDecodeTimeout                      // a decode did not answer in time, or went silent
)

// wire is how an error kind is spelled to a client.
type wire struct {
	status int
	typ    string
	code   string
}

// wireCodes maps every error kind to the wire. A 429 has one type, whoever refuses: OpenAI's
// "requests".
var wireCodes = map[errKind]wire{
	errInvalidValue:        {http.StatusBadRequest, "invalid_request_error", "invalid_value"},
	errUnsupportedParam:    {http.StatusBadRequest, "invalid_request_error", "unsupported_parameter"},
	errInvalidContentType:  {http.StatusBadRequest, "invalid_request_error", "invalid_content_type"},
	errUnreadableBody:      {http.StatusBadRequest, "invalid_request_error", "unreadable_body"},
	errInvalidPrefiller:    {http.StatusBadRequest, "invalid_request_error", "invalid_prefiller"},
	errInvalidAPIKey:       {http.StatusUnauthorized, "authentication_error", "invalid_api_key"},
	errPrefillerNotAllowed: {http.StatusForbidden, "permission_error", "prefiller_not_allowed"},
	errNoRoute:             {http.StatusNotFound, "invalid_request_error", "not_found"},
	errModelNotFound:       {http.StatusNotFound, "invalid_request_error", "model_not_found"},
	errMethodNotAllowed:    {http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed"},
	errBodyTimeout:         {http.StatusRequestTimeout, "invalid_request_error", "request_timeout"},
	errDuplicateID:         {http.StatusConflict, "invalid_request_error", "duplicate_request_id"},
	errTooLarge:            {http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large"},
	errRateLimited:         {http.StatusTooManyRequests, "requests", "rate_limit_exceeded"},
	errQueueFull:           {http.StatusTooManyRequests, "requests", "queue_full"},
	errTenantQueueFull:     {http.StatusTooManyRequests, "requests", "tenant_queue_full"},
	errPoolSaturated:       {http.StatusServiceUnavailable, "service_unavailable", "pool_saturated"},
	errClientClosed:        {StatusClientClosed, "client_closed_request", "client_closed_request"},
	errInternal:            {http.StatusInternalServerError, "internal_error", "internal"},
	errPanicked:            {http.StatusBadGateway, "internal_error", "internal"},
	errBackendStatus:       {http.StatusBadGateway, "bad_gateway", "backend_error"},
	errBackendUnreachable:  {http.StatusBadGateway, "bad_gateway", "backend_unreachable"},
	errBadKVParams:         {http.StatusBadGateway, "bad_gateway", "bad_kv_transfer_params"},
	errBackendRefused:      {http.StatusBadRequest, "invalid_request_error", "backend_refused"},
	errNoBackend:           {http.StatusServiceUnavailable, "service_unavailable", "no_backend"},
	errQueueTimeout:        {http.StatusServiceUnavailable, "service_unavailable", "queue_timeout"},
	errShutdown:            {http.StatusServiceUnavailable, "service_unavailable", "shutting_down"},
	errPrefillTimeout:      {http.StatusGatewayTimeout, "timeout", "prefill_timeout"},
	errDecodeTimeout:       {http.StatusGatewayTimeout, "timeout", "decode_timeout"},
}

// refusedTypes are the types of a backend's refusal by its status (errBackendRefused takes
// the backend's status); invalid_request_error for any other.
var refusedTypes = map[int]string{
	http.StatusUnauthorized:    "authentication_error",
	http.StatusForbidden:       "authentication_error",
	http.StatusNotFound:        "not_found_error",
	http.StatusTooManyRequests: "requests",
}

// apiError is an error on its way to the client in the OpenAI shape. message is what the
// client reads; cause is for the log only.
type apiError struct {
	kind errKind
	// status is the answer's status: the kind's, or a backend's own for a refusal passed on.
	status     int
	param      string
	message    string
	retryAfter int
	cause      error
	// raw, when set, is a backend's own error answer, passed to the client as it came.
	raw     []byte
	rawType string
	// limit, for a refusal by a client's limits, is its reason (limits.go).
	limit string
	// bearerChallenge adds "WWW-Authenticate: Bearer", which a 401 must carry (RFC 9110
	// section 15.5.2).
	bearerChallenge bool
}

// newError is an error of kind telling the client message.
func newError(kind errKind, message string) *apiError {
	return &apiError{kind: kind, status: wireCodes[kind].status, message: message}
}

// with returns e with a param, a cause and a Retry-After (seconds) where they are set.
func (e *apiError) with(param string, cause error, retryAfter int) *apiError {
	e.param, e.cause, e.retryAfter = param, cause, retryAfter
	return e
}

// wire is how e is spelled to the client: its kind's, with a refused status's own type.
func (e *apiError) wire() wire {
	w := wireCodes[e.kind]
	w.status = e.status
	if e.kind == errBackendRefused {
		if t, ok := refusedTypes[e.status]; ok {
			w.typ = t
		}
	}
	return w
}

func (e *apiError) Error() string {
	if e.cause != nil {
		return e.message + ": " + e.cause.Error()
	}
	return e.message
}

func badRequest(param, msg string) *apiError {
	return newError(errInvalidValue, msg).with(param, nil, 0)
}

var errClientGone = newError(errClientClosed, "client closed the request")

// errShuttingDown is the cause a request's context is cancelled with when shutdown passes its
// drain deadline; errShutdownAnswer is what its client is told.
var (
	errShuttingDown   = errors.New("the proxy is shutting down")
	errShutdownAnswer = newError(errShutdown, "the proxy is shutting down and gave up on this request; retry it").with("", errShuttingDown, 1)
)

// errorBody is the OpenAI error shape.
type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	} `json:"error"`
}

func (e *apiError) body() []byte {
	var b errorBody
	w := e.wire()
	b.Error.Message = e.message
	b.Error.Type = w.typ
	b.Error.Code = w.code
	if e.param != "" {
		p := e.param
		b.Error.Param = &p
	}
	out, _ := json.Marshal(b)
	return out
}

// writeError is the one place an error becomes an HTTP answer.
func writeError(w http.ResponseWriter, e *apiError) {
	if e.status == StatusClientClosed {
		return // nobody is listening
	}
	h := w.Header()
	if e.retryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.retryAfter))
	}
	if e.bearerChallenge {
		h.Set("WWW-Authenticate", "Bearer")
	}
	if _, ok := w.(*anthropicWriter); ok && e.raw != nil {
		// A backend's own error, in the route's shape.
		h.Set("Content-Type", "application/json")
		w.WriteHeader(e.status)
		w.Write(e.anthropicBody())
		return
	}
	if e.raw != nil {
		ct := e.rawType
		if ct == "" {
			ct = "application/json"
		}
		h.Set("Content-Type", ct)
		w.WriteHeader(e.status)
		w.Write(e.raw)
		return
	}
	h.Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	if _, ok := w.(*anthropicWriter); ok {
		w.Write(e.anthropicBody())
		return
	}
	w.Write(e.body())
}

// fromRouter maps a router's refusal to an answer.
func fromRouter(err error, role router.Role) *apiError {
	switch {
	case errors.Is(err, router.ErrQueueFull):
		return newError(errQueueFull, "every "+string(role)+" backend is busy and the wait queue is full; retry later").with("", err, 1)
	case errors.Is(err, router.ErrTenantQueueFull):
		return newError(errTenantQueueFull, "your share of the "+string(role)+" wait queue is full: your other requests are waiting; retry later").with("", err, 1)
	case errors.Is(err, router.ErrPoolSaturated):
		return newError(errPoolSaturated, "every "+string(role)+" backend is busy and the wait queue is full within every tenant's share; retry later").with("", err, 1)
	case errors.Is(err, router.ErrQueueTimeout):
		return newError(errQueueTimeout, "every "+string(role)+" backend stayed busy for the whole queue timeout; retry later").with("", err, 1)
	default:
		return newError(errNoBackend, "no healthy "+string(role)+" backend is available").with("", err, 1)
	}
}

// fromBackend maps a failed backend call to an answer: a backend's 4xx goes to the client as
// it came (it is about the client's request); anything else is the proxy's 502, or a 504 of
// kind timeout.
func fromBackend(err error, role router.Role, timeout errKind) *apiError {
	var se *engine.StatusError
	if errors.As(err, &se) {
		if se.Status >= 400 && se.Status < 500 {
			return clientFault(se, role, err)
		}
		return newError(errBackendStatus, string(role)+" backend answered with status "+strconv.Itoa(se.Status)).with("", err, 0)
	}
	if errors.Is(err, errPhaseTimeout) {
		return newError(timeout, string(role)+" backend did not answer in time ("+wireCodes[timeout].code+")").with("", err, 0)
	}
	if errors.Is(err, engine.ErrBadKVParams) {
		return newError(errBadKVParams, "prefill backend answered with invalid kv_transfer_params").with("", err, 0)
	}
	return newError(errBackendUnreachable, string(role)+" backend could not be reached or failed").with("", err, 0)
}

var errPhaseTimeout = errors.New("phase timeout")

// clientFault is a backend's 4xx answer on its way to the client: as it came when it is a
// whole JSON object (the engine's own OpenAI-shape error), else in the OpenAI shape with the
// backend's status: a body cut at the size bound, or an empty or non-JSON one, would leave
// the client a body it cannot parse under a JSON content type. A short plain-text reason is
// kept in the message.
func clientFault(se *engine.StatusError, role router.Role, err error) *apiError {
	body := bytes.TrimSpace(se.Body)
	jsonType := se.ContentType == "" || strings.HasPrefix(strings.ToLower(strings.TrimSpace(se.ContentType)), "application/json")
	if !se.Truncated && jsonType && len(body) > 0 && body[0] == '{' && json.Valid(body) {
		return &apiError{kind: errBackendRefused, status: se.Status, raw: se.Body, rawType: "application/json", cause: err}
	}
	msg := string(role) + " backend refused the request with status " + strconv.Itoa(se.Status)
	if strings.HasPrefix(strings.ToLower(se.ContentType), "text/plain") && !se.Truncated && len(body) > 0 && len(body) <= 512 && utf8.Valid(body) {
		msg += ": " + string(body)
	}
	e := newError(errBackendRefused, msg).with("", err, 0)
	e.status = se.Status
	return e
}
