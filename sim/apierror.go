package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
)

// Errors in the shapes the API answers them, and the JSON writers every
// handler shares.

// apiError is an answer in the OpenAI error shape.
type apiError struct {
	Status  int    `json:"-"`
	Message string `json:"message"`
	Type    string `json:"type"`
	Code    string `json:"code"`
	// Param names the field at fault, when known.
	Param string `json:"param,omitempty"`
	// numeric: one of vLLM's own errors, written in its shape (models.go).
	numeric bool
}

func (e *apiError) Error() string { return e.Message }

func badRequest(code, format string, args ...any) *apiError {
	return &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: code, Message: fmt.Sprintf(format, args...)}
}

func statusError(status int, code, format string, args ...any) *apiError {
	typ := "server_error"
	switch {
	case status == http.StatusNotFound:
		typ = "not_found_error"
	case status == http.StatusTooManyRequests:
		typ = "rate_limit_error"
	case status < 500:
		typ = "invalid_request_error"
	case status == http.StatusServiceUnavailable:
		typ = "service_unavailable"
	}
	return &apiError{Status: status, Type: typ, Code: code, Message: fmt.Sprintf(format, args...)}
}

// MarshalJSON writes vLLM's own errors (numeric: the status as the code, a
// param) in vLLM's ErrorInfo shape, and the sim's others with their string code.
func (e *apiError) MarshalJSON() ([]byte, error) {
	if !e.numeric {
		type plain apiError
		return json.Marshal((*plain)(e))
	}
	return json.Marshal(struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    int     `json:"code"`
	}{e.Message, e.Type, nullable(e.Param), e.Status})
}

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeError is the one place that turns an error into an HTTP answer: in
// the OpenAI error shape, or Anthropic's on a Messages route (messages.go).
func writeError(w http.ResponseWriter, err error) {
	var ae *apiError
	if !errors.As(err, &ae) {
		ae = statusError(http.StatusInternalServerError, "internal_error", "internal error")
	}
	if _, ok := w.(*anthropicWriter); ok {
		writeJSON(w, ae.Status, anthropicError(ae))
		return
	}
	writeJSON(w, ae.Status, map[string]*apiError{"error": ae})
}

// anthropicWriter marks the writer of a Messages route: writeError answers
// in Anthropic's error shape on it.
type anthropicWriter struct{ http.ResponseWriter }

// Unwrap lets http.ResponseController reach the connection's writer.
func (w *anthropicWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func anthropicShape(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) { next(&anthropicWriter{w}, r) }
}

// anthropicError is ae in Anthropic's shape, its type chat's.
func anthropicError(ae *apiError) any {
	type inner struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	}
	return struct {
		Type  string `json:"type"`
		Error inner  `json:"error"`
	}{"error", inner{ae.Type, ae.Message}}
}
