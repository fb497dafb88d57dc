package proxy

// The wrappers a request passes before its route: the deadline on its body, the client's key
// (api_keys_file, api_keys_env) and, on the model routes, the client's limits (limits.go).

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/api"
)

// bodyDeadline puts read_body_timeout on the body of every request that has one, whatever
// its route: net/http reads what a handler left of a body before it answers (to keep the
// connection), and that read must not wait on a stalled client either. The deadline ends
// with the body (see readBody). On HTTP/2 it is the stream's: its body read fails, the
// connection's other streams go on.
func (s *Server) bodyDeadline(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength != 0 {
			// Not supported only by writers that are not net/http's (tests' recorders).
			_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(s.cfg.ReadBodyTimeout))
		}
		next.ServeHTTP(w, r)
	})
}

// requireKey answers 401 to a request without a valid key, before any route sees it. The
// key is never logged; only whether one was sent.
func (s *Server) requireKey(mux *chi.Mux, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.keys.isOpen(r) {
			next.ServeHTTP(w, r)
			return
		}
		tok, sent := clientKey(r)
		if sent && s.keys.valid(tok) {
			next.ServeHTTP(w, r)
			return
		}
		// The route label comes from the router's own patterns, a closed set; an unknown
		// path must not become a label. chi routes on the escaped path when there is one.
		path := r.URL.Path
		if r.URL.RawPath != "" {
			path = r.URL.RawPath
		}
		route := mux.Find(chi.NewRouteContext(), r.Method, path)
		if route == "" {
			route = "unmatched"
		}
		s.m.Requests.WithLabelValues(route, "401", "").Inc()
		msg := "invalid API key"
		if !sent {
			msg = "missing API key: send it as Authorization: Bearer <key>, or as x-api-key: <key>"
		}
		id := requestID(r)
		w.Header().Set("X-Request-Id", id)
		e := api.NewError(api.KindInvalidAPIKey, msg)
		e.BearerChallenge = true
		api.WriteError(w, e)
		if ce := s.logger.Check(zap.InfoLevel, "request refused: no valid api key"); ce != nil {
			ce.Write(zap.String("request_id", id), zap.String("route", route), zap.Bool("key_sent", sent))
		}
	})
}

// limit wraps a model route: the request is admitted by its identity's limits before its
// body is read, and counted per key and class when it ends. A refusal is answered here and
// never reaches a backend.
func (s *Server) limit(next http.Handler) http.Handler {
	if s.lim == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a, e := s.lim.admit(r, s.lim.now())
		if e != nil {
			route := chi.RouteContext(r.Context()).RoutePattern()
			s.m.Requests.WithLabelValues(route, strconv.Itoa(e.Status), "").Inc()
			s.m.LimitRejected.WithLabelValues(a.key, a.tenant, e.Limit).Inc()
			id := requestID(r)
			w.Header().Set("X-Request-Id", id)
			api.WriteError(w, e)
			if ce := s.logger.Check(zap.InfoLevel, "request refused by its limits"); ce != nil {
				ce.Write(zap.String("request_id", id), zap.String("route", route), zap.String("reason", e.Limit),
					zap.String("key", a.key), zap.String("tenant", a.tenant))
			}
			return
		}
		defer func() {
			s.lim.release(a, s.lim.now())
			class := a.class
			if class == "" {
				class = "none"
			}
			s.m.KeyRequests.WithLabelValues(a.key, a.tenant, class).Inc()
		}()
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), admissionKey{}, a)))
	})
}
