package proxy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/kvbackend"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
)

// exchange is one client request on its way through the P/D flow. Only the handler's
// goroutine touches it, except where a field says otherwise.
type exchange struct {
	s      *Server
	w      http.ResponseWriter
	r      *http.Request
	ctx    context.Context // the request's context: done when the client leaves
	cancel context.CancelFunc
	id     string
	route  string
	start  time.Time
	req    *genRequest
	hdr    http.Header // headers passed on to backends

	decodeLease *router.Lease
	decodeRes   router.Result
	// leaseHandedOff: the decode lease went to a drain and is released there.
	leaseHandedOff bool
	prefillB       *router.Backend
	decodeB        *router.Backend
	kvParams       json.RawMessage
	// endedElsewhere: a prefill let finish after the client left owns the table entry now.
	endedElsewhere bool

	goneAt   atomic.Int64 // UnixNano when ctx was seen done; written by an AfterFunc
	wrote    bool         // a byte of the answer went to the client
	ttft     time.Duration
	prefillT time.Duration
	decodeT  time.Duration
	fallback bool
	chunks   int
	// abortConn: the answer broke after its headers went out in a non-streaming response; the
	// only honest end is to cut the connection.
	abortConn bool
}

// generate serves /v1/completions (chat false) and /v1/chat/completions.
func (s *Server) generate(route string, chat bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		x := &exchange{s: s, w: w, r: r, route: route, start: time.Now(), id: requestID(r)}
		w.Header().Set("X-Request-Id", x.id)
		err := x.run(chat)
		status := http.StatusOK
		if err != nil {
			status = err.status
			if !x.wrote {
				writeError(w, err)
			}
		}
		s.finish(x, status, err)
		if x.abortConn {
			// The headers and part of a non-streaming body are out; ending the handler
			// normally would pass a truncated JSON off as complete.
			panic(http.ErrAbortHandler)
		}
	}
}

func (s *Server) finish(x *exchange, status int, err *apiError) {
	elapsed := time.Since(x.start)
	code := statusLabel(status)
	s.m.requests.WithLabelValues(x.route, code).Inc()
	s.m.duration.WithLabelValues(x.route).Observe(elapsed.Seconds())
	if x.ttft > 0 {
		s.m.ttft.WithLabelValues(x.route).Observe(x.ttft.Seconds())
	}
	level := zap.InfoLevel
	if status >= 500 && status != StatusClientClosed {
		level = zap.WarnLevel
	}
	ce := s.logger.Check(level, "request")
	if ce == nil {
		return
	}
	fields := []zap.Field{
		zap.String("request_id", x.id), zap.String("route", x.route), zap.Int("status", status),
		zap.Duration("duration", elapsed), zap.Duration("prefill_duration", x.prefillT),
		zap.Duration("decode_duration", x.decodeT), zap.Duration("ttft", x.ttft),
	}
	if x.req != nil {
		fields = append(fields, zap.Bool("stream", x.req.stream))
	}
	if x.prefillB != nil {
		fields = append(fields, zap.String("prefill_backend", x.prefillB.Name))
	}
	if x.decodeB != nil {
		fields = append(fields, zap.String("decode_backend", x.decodeB.Name))
	}
	if x.fallback {
		fields = append(fields, zap.Bool("decode_only_fallback", true))
	}
	if err != nil {
		fields = append(fields, zap.String("error", err.Error()))
	}
	ce.Write(fields...)
}

func statusLabel(status int) string {
	if status >= 100 && status < 1000 {
		var b [3]byte
		b[0] = byte('0' + status/100)
		b[1] = byte('0' + status/10%10)
		b[2] = byte('0' + status%10)
		return string(b[:])
	}
	return "other"
}

// requestID is the client's X-Request-Id when it sent a usable one, else a new random id.
func requestID(r *http.Request) string {
	if id := r.Header.Get("X-Request-Id"); id != "" && len(id) <= 128 && printable(id) {
		return id
	}
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

func (x *exchange) run(chat bool) *apiError {
	body, e := readBody(x.w, x.r, x.s.cfg.MaxBodyBytes)
	if e != nil {
		return e
	}
	req, e := parseRequest(body, chat)
	if e != nil {
		return e
	}
	x.req = req
	x.hdr = upstreamHeader(x.r.Header)
	if x.s.keys != nil {
		// The client's key is for the proxy; a backend that wants one has its own api_key.
		x.hdr.Del("Authorization")
	}

	ctx, cancel := context.WithCancel(x.r.Context())
	defer cancel()
	x.ctx, x.cancel = ctx, cancel
	stop := context.AfterFunc(ctx, func() { x.goneAt.Store(time.Now().UnixNano()) })
	defer stop()

	if err := x.s.table.Begin(x.id, x.route, cancel); err != nil {
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "duplicate_request_id",
			param: "X-Request-Id", message: "a request with this X-Request-Id is already in flight"}
	}
	defer func() {
		if !x.endedElsewhere {
			x.s.table.End(x.id)
		}
	}()
	defer func() {
		if x.decodeLease != nil && !x.leaseHandedOff {
			x.decodeLease.Release(x.decodeRes)
		}
	}()
	return x.serve()
}

func (x *exchange) hint(exclude []string) router.Hint {
	return router.Hint{RequestID: x.id, Prefix: x.req.prefix, Exclude: exclude}
}

func (x *exchange) serve() *apiError {
	before := x.s.cfg.DecoderReservation != ReserveAfterPrefill
	if before {
		// The decoder is reserved first, so that a prefilled request never waits for one and
		// its KV is held only as long as sending the decode takes.
		if e := x.reserveDecoder(); e != nil {
			return e
		}
	}
	if x.s.router.Has(router.RolePrefill) {
		if e := x.prefill(); e != nil {
			return e
		}
	}
	if !before {
		// Waiting for a decoder now happens in kv_held: a client leaving meanwhile gets its KV
		// released, and the hold deadline keeps running.
		if e := x.reserveDecoder(); e != nil {
			return e
		}
	}
	return x.decode()
}

func (x *exchange) reserveDecoder() *apiError {
	lease, err := x.s.router.Acquire(x.ctx, router.RoleDecode, x.hint(nil))
	if err != nil {
		if x.ctx.Err() != nil {
			return x.gone()
		}
		x.fail()
		return fromRouter(err, router.RoleDecode)
	}
	x.decodeLease, x.decodeB = lease, lease.Backend()
	x.decodeRes = router.Result{} // unused until the decode call says otherwise
	return nil
}

// fail ends the request as failed; KV still held for it is released.
func (x *exchange) fail() {
	if act, hold := x.s.table.Fail(x.id); act == lifecycle.ReleaseKV {
		var lease *router.Lease
		if x.decodeLease != nil && !x.leaseHandedOff {
			lease, x.leaseHandedOff = x.decodeLease, true
		}
		x.endedElsewhere = true // release ends the entry once the hold is released
		x.s.release(x.id, x.req, x.prefillB, x.kvParams, hold, lease)
	}
}

// prefill runs the prefill call, on another prefiller when one provably never started it,
// and falls back to a decode-only request when no prefiller can serve and that is allowed.
func (x *exchange) prefill() *apiError {
	start := time.Now()
	defer func() { x.prefillT = time.Since(start) }()
	body, err := kvbackend.PrefillBody(x.req.fields, x.req.chat)
	if err != nil {
		return &apiError{status: http.StatusInternalServerError, typ: "internal_error", code: "internal", message: "could not build the prefill request", cause: err}
	}
	var tried []string
	var lastErr error
	for attempt := 0; attempt <= x.s.cfg.PrefillRetries; attempt++ {
		lease, err := x.s.router.Acquire(x.ctx, router.RolePrefill, x.hint(tried))
		if err != nil {
			if x.ctx.Err() != nil {
				return x.gone()
			}
			if lastErr == nil {
				lastErr = err
			}
			break
		}
		b := lease.Backend()
		x.prefillB = b
		tried = append(tried, b.Name)
		if attempt > 0 {
			// Counted only now that another prefiller takes it: a retry with nobody left to
			// try is no retry.
			x.s.m.retries.WithLabelValues(string(router.RolePrefill), retryReason(lastErr)).Inc()
		}
		var started bool
		if attempt == 0 {
			started = x.s.table.StartPrefill(x.id, b.Name)
		} else {
			started = x.s.table.PrefillRetry(x.id, b.Name)
		}
		if !started {
			lease.Release(router.Result{Canceled: true})
			return x.gone()
		}
		params, err, detached := x.callPrefill(lease, b, body)
		if detached {
			return x.gone()
		}
		if err == nil {
			if act, hold := x.s.table.Prefilled(x.id, params != nil); act == lifecycle.ReleaseKV {
				// Cannot happen while only this goroutine moves the request; kept so a
				// hold is never dropped if that changes.
				x.s.release(x.id, x.req, b, params, hold, nil)
			}
			x.kvParams = params
			if x.ctx.Err() != nil {
				return x.gone()
			}
			return nil
		}
		if x.ctx.Err() != nil {
			return x.gone()
		}
		if mayHoldKV(err) && kvbackend.HasAbort(b.Engine) {
			// The prefiller took the request but its answer broke or timed out: it may hold
			// KV whose params never arrived. Its explicit abort frees that.
			x.s.abortOnEngine(x.id, b)
		}
		lastErr = err
		if !retriable(err) {
			break
		}
	}
	var se *kvbackend.StatusError
	clientFault := errors.As(lastErr, &se) && se.Status >= 400 && se.Status < 500
	if !clientFault && *x.s.cfg.DecodeOnlyFallback {
		// Nobody prefilled: move on without KV, the decoder computes the prompt itself.
		x.fallback = true
		x.s.m.fallbacks.Inc()
		if st, ok := x.s.table.State(x.id); ok && st == lifecycle.Prefilling {
			x.s.table.Prefilled(x.id, false)
		}
		return nil
	}
	x.fail()
	if rerr := lastErr; rerr != nil && (errors.Is(rerr, router.ErrNoBackend) || errors.Is(rerr, router.ErrQueueFull) || errors.Is(rerr, router.ErrQueueTimeout)) {
		return fromRouter(rerr, router.RolePrefill)
	}
	return fromBackend(lastErr, router.RolePrefill, "prefill_timeout")
}

// mayHoldKV reports whether a failed prefill call may have left KV held on the prefiller: the
// request reached it (no connect error) and it did not answer with an error status.
func mayHoldKV(err error) bool {
	var se *kvbackend.StatusError
	if errors.As(err, &se) {
		return false
	}
	var ce *kvbackend.CallError
	return !errors.As(err, &ce) || !ce.Connect
}

// retriable: the prefiller provably never started the work (no connection, or it refused
// with 502/503/504), so another one may take it.
func retriable(err error) bool {
	if isConnectError(err) {
		return true
	}
	var se *kvbackend.StatusError
	if errors.As(err, &se) {
		return se.Status == http.StatusBadGateway || se.Status == http.StatusServiceUnavailable || se.Status == http.StatusGatewayTimeout
	}
	return false
}

func retryReason(err error) string {
	var se *kvbackend.StatusError
	if errors.As(err, &se) {
		return statusLabel(se.Status)
	}
	return "connect_error"
}

type prefillResult struct {
	params json.RawMessage
	err    error
}

// callPrefill makes the prefill call. With abort_during_prefill cancel the call carries the
// request's context, so the client leaving closes the prefiller's connection at once. With
// finish_then_release it runs on a context detached from the client on purpose: if the
// client leaves, the call goes on in the background, and its KV is released as soon as the
// prefiller answers (detached is then true and the background owns the table entry).
func (x *exchange) callPrefill(lease *router.Lease, b *router.Backend, body []byte) (json.RawMessage, error, bool) {
	call := kvbackend.Call{Client: b.Client(), BaseURL: baseURL(b), Path: x.route, ID: x.id, Header: x.hdr, Body: body}
	timeout := x.s.cfg.PrefillTimeout
	if x.s.cfg.AbortDuringPrefill == AbortPrefillCancel {
		ctx, cancel := context.WithTimeoutCause(x.ctx, timeout, errPhaseTimeout)
		defer cancel()
		params, err := call.Prefill(ctx)
		lease.Release(resultOf(err, x.ctx))
		if err != nil && context.Cause(ctx) == errPhaseTimeout {
			err = errors.Join(errPhaseTimeout, err)
		}
		return params, err, false
	}

	var taken atomic.Bool // set by whichever side handles the answer: the handler, or the call
	ch := make(chan prefillResult, 1)
	s, id, req := x.s, x.id, x.req
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		ctx, cancel := context.WithTimeoutCause(context.WithoutCancel(x.ctx), timeout, errPhaseTimeout)
		defer cancel()
		params, err := call.Prefill(ctx)
		lease.Release(resultOf(err, nil))
		if err != nil && context.Cause(ctx) == errPhaseTimeout {
			err = errors.Join(errPhaseTimeout, err)
		}
		if taken.CompareAndSwap(false, true) {
			ch <- prefillResult{params, err}
			return
		}
		// The client left while the prefill ran: the entry is ours to end, by release when
		// there is KV to release.
		if err != nil || params == nil {
			if err != nil && mayHoldKV(err) && kvbackend.HasAbort(b.Engine) {
				s.abortOnEngine(id, b)
			}
			s.table.End(id)
			return
		}
		if act, hold := s.table.Prefilled(id, true); act == lifecycle.ReleaseKV {
			s.release(id, req, b, params, hold, nil)
			return
		}
		s.table.End(id)
	}()
	select {
	case res := <-ch:
		return res.params, res.err, false
	case <-x.ctx.Done():
		if taken.CompareAndSwap(false, true) {
			x.endedElsewhere = true
			return nil, nil, true
		}
		res := <-ch
		return res.params, res.err, false
	}
}

// resultOf turns a call's outcome into the router's passive-health input; a call ended by
// the client leaving says nothing about the backend.
func resultOf(err error, clientCtx context.Context) router.Result {
	if err == nil {
		return router.Result{Status: http.StatusOK}
	}
	if clientCtx != nil && clientCtx.Err() != nil {
		return router.Result{Canceled: true}
	}
	var se *kvbackend.StatusError
	if errors.As(err, &se) {
		return router.Result{Status: se.Status}
	}
	return router.Result{Err: err}
}

// gone handles the client leaving: one transition of the table says what to abort.
func (x *exchange) gone() *apiError {
	act, hold, stage := x.s.table.ClientGone(x.id)
	seen := time.Now()
	if at := x.goneAt.Load(); at != 0 {
		seen = time.Unix(0, at)
	}
	switch act {
	case lifecycle.CancelPrefill:
		// The call's context is already cancelled, which closed the prefiller's connection.
		x.s.m.propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
		if b := x.prefillB; b != nil && kvbackend.HasAbort(b.Engine) {
			// The engine may have finished its last step before the connection closed and
			// now hold KV nobody will pull (race R1): its explicit abort frees that too.
			x.s.abortOnEngine(x.id, b)
		}
	case lifecycle.ReleaseKV:
		var lease *router.Lease
		if x.decodeLease != nil && !x.leaseHandedOff {
			lease, x.leaseHandedOff = x.decodeLease, true
		}
		x.s.m.propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
		x.endedElsewhere = true
		x.s.release(x.id, x.req, x.prefillB, x.kvParams, hold, lease)
	case lifecycle.CancelDecode:
		x.s.m.propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
	}
	if ce := x.s.logger.Check(zap.DebugLevel, "client gone"); ce != nil {
		ce.Write(zap.String("request_id", x.id), zap.Stringer("stage", stage), zap.Stringer("action", act))
	}
	return errClientGone
}

// abortOnEngine sends an engine's explicit abort in the background, on its own short
// deadline: the client's context is already done.
func (s *Server) abortOnEngine(id string, b *router.Backend) {
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		if !s.abortCall(id, b, "engine abort failed") {
			return
		}
		// The abort travels on its own connection and can overtake the request it aborts
		// (the engine has not read it yet, so it ignores an unknown id, then finishes the
		// request and holds its KV). A second abort a moment later closes that gap; for an
		// engine that already forgot the request it is a no-op.
		s.bg.Add(1)
		time.AfterFunc(abortRepeatDelay, func() {
			defer s.bg.Done()
			s.abortCall(id, b, "repeated engine abort failed")
		})
	}()
}

// abortCall sends one explicit abort on its own short deadline (the client's context is done
// by then) and logs a failure with msg.
func (s *Server) abortCall(id string, b *router.Backend, msg string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), defaultAbortCallTimeout)
	defer cancel()
	if err := kvbackend.Abort(ctx, b.Client(), baseURL(b), id); err != nil {
		s.logger.Warn(msg, zap.String("request_id", id), zap.String("backend", b.Name), zap.Error(err))
		return false
	}
	return true
}

// abortRepeatDelay is when an explicit abort is sent again (see abortOnEngine).
const abortRepeatDelay = 250 * time.Millisecond

// release ends a KV hold whose params no decoder will get, as kv_release says, in the
// background: the client is gone and nothing waits for it. lease, when not nil, is a decoder
// reserved for the request, used for the drain and released after it. release ends the
// request's table entry once the hold is released, so the caller must not: an End before
// would release the hold as expired while the drain or abort is still on its way.
func (s *Server) release(id string, req *genRequest, p *router.Backend, params json.RawMessage, hold *lifecycle.Hold, lease *router.Lease) {
	s.releaseAs(s.cfg.KVRelease, id, req, p, params, hold, lease, nil)
}

// releaseUncertain releases a hold whose decode may or may not have reached a decoder. The
// engine's explicit abort, where it has one, is exact and a no-op if the decoder did pull the
// blocks; a drain is the way for engines without one.
func (s *Server) releaseUncertain(id string, req *genRequest, p *router.Backend, params json.RawMessage, hold *lifecycle.Hold, failed string) {
	mode := s.cfg.KVRelease
	if p != nil && kvbackend.HasAbort(p.Engine) && mode != ReleaseWait {
		mode = ReleaseAbort
	}
	// A drain does not go to the decoder that just failed this decode: it may be dead, and
	// with nothing in flight it would be the first pick.
	s.releaseAs(mode, id, req, p, params, hold, nil, []string{failed})
}

func (s *Server) releaseAs(mode, id string, req *genRequest, p *router.Backend, params json.RawMessage, hold *lifecycle.Hold, lease *router.Lease, exclude []string) {
	if mode == ReleaseWait || p == nil {
		if lease != nil {
			lease.Release(router.Result{Canceled: true})
		}
		hold.Release(lifecycle.ReleaseExpired)
		s.table.End(id)
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		defer s.table.End(id)
		if mode == ReleaseAbort && kvbackend.HasAbort(p.Engine) {
			if lease != nil {
				lease.Release(router.Result{Canceled: true})
			}
			if s.abortHold(id, p, hold) {
				return
			}
			s.m.releaseFailure.WithLabelValues(ReleaseAbort).Inc()
			hold.Release(lifecycle.ReleaseExpired)
			return
		}
		if s.drain(id, req, params, lease, exclude) {
			hold.Release(lifecycle.ReleaseDrained)
			return
		}
		s.m.releaseFailure.WithLabelValues(ReleaseDrain).Inc()
		if kvbackend.HasAbort(p.Engine) && s.abortHold(id, p, hold) {
			return
		}
		// Left to the engine's own timer; the proxy never forwards these params again.
		hold.Release(lifecycle.ReleaseExpired)
	}()
}

func (s *Server) abortHold(id string, p *router.Backend, hold *lifecycle.Hold) bool {
	if !s.abortCall(id, p, "kv release by abort failed") {
		return false
	}
	hold.Release(lifecycle.ReleaseAborted)
	return true
}

// drain sends a decoder a one-token decode with the held params, so that it pulls the blocks
// and the prefiller frees them. It runs on its own deadline: the client that asked is gone.
// It may go past the decoders' in-flight limit: it frees memory, it must not queue behind load.
// A drain whose deadline passes after it reached the decoder still releases: the decoder
// aborts a do_remote_prefill request that was never scheduled and notifies the prefiller,
// which frees the blocks (vLLM does this; so does the simulator).
func (s *Server) drain(id string, req *genRequest, params json.RawMessage, lease *router.Lease, exclude []string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.DrainTimeout)
	defer cancel()
	if lease == nil {
		var err error
		lease, err = s.router.Acquire(ctx, router.RoleDecode, router.Hint{RequestID: id, Overcommit: true, Exclude: exclude})
		if err != nil {
			s.logger.Warn("kv drain found no decoder", zap.String("request_id", id), zap.Error(err))
			return false
		}
	}
	b := lease.Backend()
	body, err := kvbackend.DrainBody(req.fields, req.chat, params)
	if err != nil {
		lease.Release(router.Result{})
		return false
	}
	path := "/v1/completions"
	if req.chat {
		path = "/v1/chat/completions"
	}
	var delivered atomic.Bool
	traced := httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		WroteRequest: func(i httptrace.WroteRequestInfo) { delivered.Store(i.Err == nil) },
	})
	call := kvbackend.Call{Client: b.Client(), BaseURL: baseURL(b), Path: path, ID: id, Body: body}
	resp, err := call.Do(traced)
	if err == nil {
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if err != nil && ctx.Err() != nil && delivered.Load() {
		lease.Release(router.Result{Canceled: true})
		return true
	}
	// A drain says little about the decoder's health (it may find the blocks already freed, by
	// design), so its outcome feeds no passive ejection.
	lease.Release(router.Result{})
	if err != nil {
		s.logger.Warn("kv drain failed", zap.String("request_id", id), zap.String("backend", b.Name), zap.Error(err))
		return false
	}
	return true
}

func baseURL(b *router.Backend) string { return strings.TrimRight(b.URLString, "/") }

// readBody reads the whole request body, bounded: a larger one is 413.
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, *apiError) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, &apiError{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error", code: "request_too_large",
				message: "request body is larger than the limit of " + formatBytes(limit)}
		}
		return nil, &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "unreadable_body", message: "could not read the request body", cause: err}
	}
	return body, nil
}

func formatBytes(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return itoa(n>>20) + " MiB"
	case n >= 1<<10 && n%(1<<10) == 0:
		return itoa(n>>10) + " KiB"
	}
	return itoa(n) + " bytes"
}

func itoa(n int64) string {
	if n == 0 {
		return "0"
	}
	var b [20]byte
	i := len(b)
	for n > 0 {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
	}
	return string(b[i:])
}

// hopHeaders are per-connection headers (RFC 9110 section 7.6.1) that a proxy must not pass on,
// plus what the proxy sets itself.
var hopHeaders = map[string]bool{
	"Connection": true, "Proxy-Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true,
	"Proxy-Authorization": true, "Te": true, "Trailer": true, "Transfer-Encoding": true, "Upgrade": true,
	"Content-Length": true, "Content-Type": true, "Accept-Encoding": true, "Host": true, "X-Request-Id": true,
}

// upstreamHeader is what of the client's headers goes to the backends. Headers that other P/D
// sidecars read to pick an upstream (x-prefiller-host-port and the like) are dropped:
// upstreams come from config only, never from a request.
func upstreamHeader(in http.Header) http.Header {
	out := make(http.Header, len(in))
	for k, v := range in {
		if hopHeaders[k] {
			continue
		}
		lk := strings.ToLower(k)
		if strings.HasPrefix(lk, "x-prefiller") || strings.HasPrefix(lk, "x-decoder") || strings.HasPrefix(lk, "x-forwarded-host") {
			continue
		}
		out[k] = v
	}
	return out
}
