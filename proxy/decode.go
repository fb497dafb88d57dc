package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/kvbackend"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
)

var (
	errFirstByteTimeout = fmt.Errorf("%w: no first byte from the decoder", errPhaseTimeout)
	errIdleTimeout      = fmt.Errorf("%w: the decoder went silent", errPhaseTimeout)
)

// decode sends the decode call and relays its answer to the client.
func (x *exchange) decode() *apiError {
	start := time.Now()
	defer func() { x.decodeT = time.Since(start) }()
	b := x.decodeB
	forward, hold, ok := x.s.table.StartDecode(x.id, b.Name)
	if !ok {
		return x.gone()
	}
	// The hold passes to the decoder only once the decoder has acknowledged the decode: with
	// "100 Continue", which its server sends as the handler begins to read the body, or with
	// its answer's headers. From then on it pulls the blocks, or tells the prefiller when it
	// aborts or refuses the request. Before that, a written request is no proof: a server
	// still finishing the previous response on a reused connection drops a request whose
	// connection closes before it reads it. So a decode cut short before it was acknowledged
	// (the client left, the connection failed, the decoder answered without reading it)
	// leaves the release to the proxy; one acknowledged is never sent to a second decoder,
	// even when the answer, which for a whole JSON answer comes only at its end, never does.
	// A client that leaves while the decode is on its way does not cut it before the
	// acknowledgement (see watchdog): the decoder may have read it already, and a release
	// would then send its params to a second decoder.
	x.own.hold = hold
	defer x.releaseUnsentHold()
	params := x.kvParams
	if !forward {
		params = nil
		if x.kvParams != nil {
			x.s.abortStaleHold(x.engineID, x.prefillB)
		}
	}
	body, err := engineOf(b).DecodeBody(x.req.fields, params)
	if err != nil {
		x.fail()
		return &apiError{status: http.StatusInternalServerError, typ: "internal_error", code: "internal", message: "could not build the decode request", cause: err}
	}
	// With abort_during_kv_pull after_first_token, a decode that is pulling KV is not cancelled
	// the moment the client leaves, but at its first byte (or its first-byte timeout): engines
	// that crash on an abort during the pull (race R3) never see one.
	deferCancel := params != nil && x.s.cfg.AbortDuringKVPull == PullAbortAfterFirstToken
	wd := newWatchdog(x.ctx, deferCancel, hold != nil, x.s.cfg.DecodeFirstByteTimeout, x.s.cfg.DecodeIdleTimeout)
	defer wd.stop()

	call := x.call(b, x.route, body)
	var handoff atomic.Int32 // handoffOpen until the decoder acknowledges, or the proxy withdraws the hold
	if hold != nil {
		call.OnAck = func() {
			if handoff.CompareAndSwap(handoffOpen, handoffAcked) {
				hold.Release(lifecycle.ReleaseDecoded)
			}
			wd.onAck()
		}
	}
	resp, err := call.Do(wd.ctx)
	tried := []string{b.Name}
	for attempt := 0; err != nil && retriable(err, false) && x.ctx.Err() == nil && attempt < x.s.cfg.DecodeRetries; attempt++ {
		// The decoder provably never got the call: another one may take it.
		h := x.hint(tried)
		h.Accept = sequential
		lease, aerr := x.s.router.Acquire(x.ctx, router.RoleDecode, h)
		if aerr != nil {
			break
		}
		x.own.giveBackLease(resultOf(err, x.ctx))
		x.own.lease, x.decodeB, b = lease, lease.Backend(), lease.Backend()
		tried = append(tried, b.Name)
		x.s.m.retries.WithLabelValues(string(router.RoleDecode), "connect_error").Inc()
		call.Client, call.BaseURL, call.Engine = b.Client(), baseURL(b), engineOf(b)
		resp, err = call.Do(wd.ctx)
	}
	if hold != nil {
		if err == nil && handoff.CompareAndSwap(handoffOpen, handoffAcked) {
			// Answered without a "100 Continue" first: the headers are the acknowledgement.
			hold.Release(lifecycle.ReleaseDecoded)
		}
		if err == nil {
			wd.onAck()
		}
		if handoff.CompareAndSwap(handoffOpen, handoffWithdrawn) {
			// Never acknowledged: the hold stays in the custody, for releaseUnsentHold. A
			// decoder that answered at all is alive, and may take the release's drain.
			var se *kvbackend.StatusError
			if !errors.As(err, &se) {
				x.own.avoid = b.Name
			}
		} else {
			x.own.hold = nil
			var se *kvbackend.StatusError
			if errors.As(err, &se) {
				x.s.refusedAfterHandoff(x.engineID, x.prefillB, b, se.Status)
			}
		}
	}
	if err != nil {
		x.own.res = resultOf(err, x.ctx)
		if x.ctx.Err() != nil && !wd.timedOut() {
			return x.gone()
		}
		x.fail()
		if cause := context.Cause(wd.ctx); wd.timedOut() {
			err = errors.Join(cause, err)
		}
		return fromBackend(err, router.RoleDecode, "decode_timeout")
	}
	defer resp.Body.Close()
	x.own.res = router.Result{Status: http.StatusOK}
	return x.relay(resp, wd)
}

// The states of a decode's hold handoff: open until the decoder acknowledges the decode
// (acked: the hold is the decoder's) or the proxy gives up on it first (withdrawn: the proxy
// releases it). The acknowledgement arrives on the transport's goroutine, hence an atomic.
const (
	handoffOpen int32 = iota
	handoffAcked
	handoffWithdrawn
)

// ackGrace bounds how long a decode whose client left waits for the decoder's acknowledgement
// before it is cut: a healthy server acknowledges as soon as its handler reads the body.
const ackGrace = time.Second

// watchdog bounds a decode's phases (first byte, silence between chunks) and defers the
// client's cancel, when asked: to the decode's first byte (abort_during_kv_pull
// after_first_token), and, for a decode that carries a hold, to the decoder's acknowledgement
// (or ackGrace), so that the proxy learns whether the decoder has the params before it cuts
// the call.
type watchdog struct {
	ctx        context.Context
	cancel     context.CancelCauseFunc
	timer      *time.Timer
	idle       time.Duration
	toByte     bool // defer the client's cancel to the first byte
	toAck      bool // defer the client's cancel to the acknowledgement
	sawByte    atomic.Bool
	acked      atomic.Bool
	clientGone atomic.Bool
	timeout    atomic.Bool
	graceOnce  sync.Once
	grace      *time.Timer
	stopAfter  func() bool
}

func newWatchdog(client context.Context, toByte, toAck bool, firstByte, idle time.Duration) *watchdog {
	base := client
	if toByte || toAck {
		// Detached from the client on purpose: clientLeft cancels it when the wait is over.
		base = context.WithoutCancel(client)
	}
	ctx, cancel := context.WithCancelCause(base)
	wd := &watchdog{ctx: ctx, cancel: cancel, idle: idle, toByte: toByte, toAck: toAck}
	wd.timer = time.AfterFunc(firstByte, func() {
		wd.timeout.Store(true)
		if wd.sawByte.Load() {
			cancel(errIdleTimeout)
		} else {
			cancel(errFirstByteTimeout)
		}
	})
	if toByte || toAck {
		wd.stopAfter = context.AfterFunc(client, func() {
			wd.clientGone.Store(true)
			wd.cancelIfDone()
		})
	}
	return wd
}

// cancelIfDone cancels the call for a client that left, once nothing it waits for is pending.
func (wd *watchdog) cancelIfDone() {
	if !wd.clientGone.Load() || wd.toByte && !wd.sawByte.Load() {
		return
	}
	if wd.toAck && !wd.acked.Load() {
		wd.graceOnce.Do(func() {
			wd.grace = time.AfterFunc(ackGrace, func() { wd.cancel(context.Canceled) })
		})
		return
	}
	wd.cancel(context.Canceled)
}

// onAck records the decoder's acknowledgement of the decode.
func (wd *watchdog) onAck() {
	if !wd.acked.Swap(true) {
		wd.cancelIfDone()
	}
}

func (wd *watchdog) onBytes() {
	if !wd.sawByte.Swap(true) {
		wd.acked.Store(true)
		wd.cancelIfDone()
	}
	wd.timer.Reset(wd.idle)
}

func (wd *watchdog) timedOut() bool { return wd.timeout.Load() }

func (wd *watchdog) stop() {
	wd.timer.Stop()
	if wd.stopAfter != nil {
		wd.stopAfter()
	}
	wd.graceOnce.Do(func() {}) // no grace timer starts after this
	if wd.grace != nil {
		wd.grace.Stop()
	}
	wd.cancel(context.Canceled)
}
