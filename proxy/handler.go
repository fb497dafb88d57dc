package proxy

import (
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"go.uber.org/zap"
)

// generate serves a generation route (/v1/completions, /v1/chat/completions, /v1/responses),
// whose bodies parse reads.
func (s *Server) generate(route string, parse func([]byte) (*api.Request, *api.Error)) http.HandlerFunc {
	return s.exchangeHandler(route, func(x *pdflow.Exchange) *api.Error { return s.run(x, parse) })
}

// exchangeHandler serves route with run, as one exchange: its id, its answer when run fails
// before a byte went out, its metrics and log line (finish), and the cut of a connection
// nothing honest can be sent on.
func (s *Server) exchangeHandler(route string, run func(x *pdflow.Exchange) *api.Error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		x := s.flow.NewExchange(w, r, route, requestID(r))
		if s.tenants != nil {
			// Every route's legs queue as their tenant's.
			x.Tenant, x.MaxWait = s.tenants.flowOf(r), s.tenants.wait
		}
		if len(s.cfg.SessionAffinity.Headers) > 0 {
			x.Picked = func(role routerconfig.Role, lease *router.Lease) { s.picked(x, role, lease) }
		}
		w.Header().Set("X-Request-Id", x.ID)
		defer s.recoverAnswer(x)
		err := run(x)
		status := http.StatusOK
		if err != nil {
			status = err.Status
			if !x.Out.Wrote {
				api.WriteError(w, err)
			}
		}
		s.finish(x, status, err)
		x.ReturnTokens()
		if x.Out.AbortConn || status == api.StatusClientClosed {
			// Nothing honest can be sent: the client left, or stopped reading, or the
			// headers and part of a non-streaming body are out. Returning would let net/http
			// answer 200 of its own when nothing was written, end a stream cleanly, or pass a
			// truncated JSON off as complete; cutting the connection (on HTTP/2, the stream)
			// tells a client still there that it failed.
			panic(http.ErrAbortHandler)
		}
	}
}

func (s *Server) finish(x *pdflow.Exchange, status int, err *api.Error) {
	x.Out.Finished = true
	x.EndRequest(status, err)
	elapsed := time.Since(x.Times.Start)
	code := strconv.Itoa(status)
	model := x.Names.Label
	if model == "" {
		model = s.modelLabel(x.Model()) // refused before its model was resolved
	}
	s.m.Requests.WithLabelValues(x.Route, code, model).Inc()
	s.m.Duration.WithLabelValues(x.Route, model).Observe(elapsed.Seconds())
	if x.Times.TTFT > 0 {
		s.m.TTFT.WithLabelValues(x.Route, model).Observe(x.Times.TTFT.Seconds())
	}
	level := zap.InfoLevel
	if status >= 500 && status != api.StatusClientClosed {
		level = zap.WarnLevel
	}
	ce := s.logger.Check(level, "request")
	if ce == nil {
		return
	}
	buf := logFields.Get().(*[]zap.Field)
	defer func() {
		clear(*buf) // the strings and errors they name go with the request
		logFields.Put(buf)
	}()
	fields := append((*buf)[:0],
		zap.String("request_id", x.ID), zap.String("engine_request_id", x.EngineID), zap.String("route", x.Route), zap.Int("status", status),
		zap.Duration("duration", elapsed), zap.Duration("prefill_duration", x.Times.Prefill),
		zap.Duration("decode_duration", x.Times.Decode), zap.Duration("ttft", x.Times.TTFT),
	)
	if x.Req != nil {
		fields = append(fields, zap.Bool("stream", x.Req.Stream), zap.String("model", x.Req.Model))
		if x.Names.Client != "" {
			fields = append(fields, zap.String("model_alias", x.Names.Client))
		}
	}
	if p := x.Legs.Prefill; p != nil {
		fields = append(fields, zap.String("prefill_backend", p.Name))
	}
	if d := x.Legs.Decode; d != nil {
		fields = append(fields, zap.String("decode_backend", d.Name))
	}
	if x.Legs.Fallback {
		fields = append(fields, zap.Bool("decode_only_fallback", true))
	}
	if x.Tries.N > 1 {
		// Served by more than one attempt: on fresh pairs, or moved mid-stream.
		fields = append(fields, zap.Int("attempts", x.Tries.N))
		if rs := x.Out.Resume; rs != nil && rs.Attempt > 0 {
			fields = append(fields, zap.Int("migrations", rs.Attempt))
		}
	}
	if err != nil {
		fields = append(fields, zap.String("error", err.Error()))
	}
	ce.Write(fields...)
	*buf = fields
}

// logFields are the buffers of the request log line's fields, reused: zap's cores encode
// the fields as Write is called (the observer of the tests copies them) and keep none.
var logFields = sync.Pool{New: func() any { b := make([]zap.Field, 0, 20); return &b }}

func (s *Server) run(x *pdflow.Exchange, parse func([]byte) (*api.Request, *api.Error)) *api.Error {
	if s.sidecar != nil {
		// Before the body is read: a request naming a prefiller it may not is refused
		// whatever it carries.
		if e := s.namePrefiller(x); e != nil {
			return e
		}
	}
	if hs := s.cfg.SessionAffinity.Headers; len(hs) > 0 {
		if e := s.readSession(x, hs); e != nil {
			return e
		}
	}
	body, e := readBody(x.W, x.R, s.cfg.MaxBodyBytes, s.cfg.ReadBodyTimeout)
	if e != nil {
		return e
	}
	req, e := parse(body)
	if e != nil {
		return e
	}
	req.Route = x.Route
	class, e := s.classes.classify(x.R, req)
	if e != nil {
		return e
	}
	if class != nil {
		x.Class, x.Slack = class.Name, class.MaxQueueWait
		if a := admissionOf(x.R.Context()); a != nil {
			a.class = class.Name
		}
	}
	x.Req = req
	if e := s.refuseState(x); e != nil {
		return e
	}
	if e := s.resolveRequestModel(x); e != nil {
		return e
	}
	x.KeyRequest()
	if e := x.PlanResume(); e != nil {
		return e
	}
	x.Hdr = s.engineHeader(x.R.Header)
	return x.ServeTracked()
}

// engineHeader is what of a client's headers goes to the engines.
func (s *Server) engineHeader(in http.Header) http.Header {
	hdr := api.UpstreamHeader(in)
	if s.keys != nil {
		// The client's key is for the proxy; a backend that wants one has its own api_key.
		hdr.Del("Authorization")
		hdr.Del("X-Api-Key")
	}
	if s.sidecar != nil {
		// api.UpstreamHeader drops x-prefiller-*; a header of another name is dropped here.
		hdr.Del(s.sidecar.header)
	}
	if s.classes != nil && s.classes.header != "" {
		hdr.Del(s.classes.header) // the proxy's own
	}
	return hdr
}

// refuseState refuses, under P/D, a Responses request that needs state on one engine: an
// earlier response the engine stored (previous_response_id), a run it keeps after answering
// (background), or a response it is to store for later (store: true). Disaggregated serving
// puts a request on two engines and the next one on two others, so that state would be on an
// engine the next request may never reach. Without prefillers, the request goes to one
// engine and passes.
func (s *Server) refuseState(x *pdflow.Exchange) *api.Error {
	if x.Req.State == "" || (s.sidecar == nil && !s.router.Has(routerconfig.RolePrefill)) {
		return nil
	}
	how := map[string]string{
		"previous_response_id": "send the conversation so far in input, or the earlier response whole in previous_response",
		"background":           "send it in the foreground (stream it to keep the connection busy)",
		"store":                "send store: false (or leave it out) and keep the response on the client",
	}[x.Req.State]
	return api.NewError(api.KindUnsupportedParam, fmt.Sprintf("%s needs state kept on one engine, which disaggregated prefill/decode serving cannot promise; %s", x.Req.State, how)).With(x.Req.State, nil, 0)
}

// recoverAnswer is the handler's last safety net, for a panic outside a request's serving
// (reading, parsing, answering): counted, logged, and a 502 when nothing was sent. The
// handler's own cut of a connection (http.ErrAbortHandler) passes.
func (s *Server) recoverAnswer(x *pdflow.Exchange) {
	v := recover()
	if v == nil {
		return
	}
	if v == http.ErrAbortHandler {
		panic(v)
	}
	s.m.Panics.Inc()
	s.logger.Error("panic answering a request", zap.String("request_id", x.ID), zap.Any("panic", v), zap.StackSkip("stack", 1))
	if !x.Out.Finished {
		s.finish(x, pdflow.ErrPanic.Status, pdflow.ErrPanic)
	}
	if !x.Out.Wrote {
		api.WriteError(x.W, pdflow.ErrPanic)
		return
	}
	// Part of the answer went out: only cutting the connection tells the client it failed.
	panic(http.ErrAbortHandler)
}
