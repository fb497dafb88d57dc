package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/kvbackend"
	"github.com/pdproxy/pdproxy/router"
)

// StatusClientClosed is the status logged and counted when the client left before the answer
// was complete (nginx's 499). The client never sees it.
const StatusClientClosed = 499

// apiError is an error on its way to the client in the OpenAI shape. message is what the
// client reads; cause is for the log only.
type apiError struct {
	status     int
	typ        string
	code       string
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

func (e *apiError) Error() string {
	if e.cause != nil {
		return e.message + ": " + e.cause.Error()
	}
	return e.message
}

func badRequest(param, msg string) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "invalid_value", param: param, message: msg}
}

var errClientGone = &apiError{status: StatusClientClosed, typ: "client_closed_request", code: "client_closed_request", message: "client closed the request"}

// errShuttingDown is the cause a request's context is cancelled with when shutdown passes its
// drain deadline; errShutdownAnswer is what its client is told.
var (
	errShuttingDown   = errors.New("the proxy is shutting down")
	errShutdownAnswer = &apiError{status: http.StatusServiceUnavailable, typ: "service_unavailable", code: "shutting_down", retryAfter: 1,
		message: "the proxy is shutting down and gave up on this request; retry it", cause: errShuttingDown}
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
	b.Error.Message = e.message
	b.Error.Type = e.typ
	b.Error.Code = e.code
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
	w.Write(e.body())
}

// fromRouter maps a router's refusal to an answer.
func fromRouter(err error, role router.Role) *apiError {
	switch {
	case errors.Is(err, router.ErrQueueFull):
		return &apiError{status: http.StatusTooManyRequests, typ: "rate_limit_exceeded", code: "queue_full", retryAfter: 1,
			message: "every " + string(role) + " backend is busy and the wait queue is full; retry later", cause: err}
	case errors.Is(err, router.ErrQueueTimeout):
		return &apiError{status: http.StatusServiceUnavailable, typ: "service_unavailable", code: "queue_timeout", retryAfter: 1,
			message: "every " + string(role) + " backend stayed busy for the whole queue timeout; retry later", cause: err}
	default:
		return &apiError{status: http.StatusServiceUnavailable, typ: "service_unavailable", code: "no_backend", retryAfter: 1,
			message: "no healthy " + string(role) + " backend is available", cause: err}
	}
}

// fromBackend maps a failed backend call to an answer: a backend's 4xx goes to the client as
// it came (it is about the client's request); anything else is the proxy's 502 or 504.
func fromBackend(err error, role router.Role, timeoutCode string) *apiError {
	var se *kvbackend.StatusError
	if errors.As(err, &se) {
		if se.Status >= 400 && se.Status < 500 {
			return clientFault(se, role, err)
		}
		return &apiError{status: http.StatusBadGateway, typ: "bad_gateway", code: "backend_error",
			message: string(role) + " backend answered with status " + strconv.Itoa(se.Status), cause: err}
	}
	if errors.Is(err, errPhaseTimeout) {
		return &apiError{status: http.StatusGatewayTimeout, typ: "timeout", code: timeoutCode,
			message: string(role) + " backend did not answer in time (" + timeoutCode + ")", cause: err}
	}
	if errors.Is(err, kvbackend.ErrBadKVParams) {
		return &apiError{status: http.StatusBadGateway, typ: "bad_gateway", code: "bad_kv_transfer_params",
			message: "prefill backend answered with invalid kv_transfer_params", cause: err}
	}
	return &apiError{status: http.StatusBadGateway, typ: "bad_gateway", code: "backend_unreachable",
		message: string(role) + " backend could not be reached or failed", cause: err}
}

var errPhaseTimeout = errors.New("phase timeout")

// clientFault is a backend's 4xx answer on its way to the client: as it came when it is a
// whole JSON object (the engine's own OpenAI-shape error), else in the OpenAI shape with the
// backend's status: a body cut at the size bound, or an empty or non-JSON one, would leave
// the client a body it cannot parse under a JSON content type. A short plain-text reason is
// kept in the message.
func clientFault(se *kvbackend.StatusError, role router.Role, err error) *apiError {
	body := bytes.TrimSpace(se.Body)
	jsonType := se.ContentType == "" || strings.HasPrefix(strings.ToLower(strings.TrimSpace(se.ContentType)), "application/json")
	if !se.Truncated && jsonType && len(body) > 0 && body[0] == '{' && json.Valid(body) {
		return &apiError{status: se.Status, raw: se.Body, rawType: "application/json", cause: err}
	}
	msg := string(role) + " backend refused the request with status " + strconv.Itoa(se.Status)
	if strings.HasPrefix(strings.ToLower(se.ContentType), "text/plain") && !se.Truncated && len(body) > 0 && len(body) <= 512 && utf8.Valid(body) {
		msg += ": " + string(body)
	}
	typ := "invalid_request_error"
	switch se.Status {
	case http.StatusUnauthorized, http.StatusForbidden:
		typ = "authentication_error"
	case http.StatusNotFound:
		typ = "not_found_error"
	case http.StatusTooManyRequests:
		typ = "rate_limit_exceeded"
	}
	return &apiError{status: se.Status, typ: typ, code: "backend_refused", message: msg, cause: err}
}
