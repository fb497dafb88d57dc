package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

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
	// The hold passes to the decoder only once the decoder has acknowledged the decode by
	// answering its headers: from then on it pulls the blocks, or notifies the prefiller when
	// it aborts. Before that, a written request is no proof: a server still finishing the
	// previous response on a reused connection drops a request whose connection closes
	// before it reads it. So a decode cut short before its headers (the client left, the
	// connection failed, the decoder refused it) leaves the release to the proxy.
	x.own.hold = hold
	defer x.releaseUnsentHold()
	params := x.kvParams
	if !forward {
		params = nil
		if x.kvParams != nil {
			x.s.abortStaleHold(x.id, x.prefillB)
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
	wd := newWatchdog(x.ctx, deferCancel, x.s.cfg.DecodeFirstByteTimeout, x.s.cfg.DecodeIdleTimeout)
	defer wd.stop()

	call := x.call(b, x.route, body)
	resp, err := call.Do(wd.ctx)
	tried := []string{b.Name}
	for attempt := 0; err != nil && retriable(err, false) && x.ctx.Err() == nil && attempt < x.s.cfg.DecodeRetries; attempt++ {
		// The decoder provably never got the call: another one may take it.
		lease, aerr := x.s.router.Acquire(x.ctx, router.RoleDecode, x.hint(tried))
		if aerr != nil {
			break
		}
		x.own.giveBackLease(resultOf(err, x.ctx))
		x.own.lease, x.decodeB, b = lease, lease.Backend(), lease.Backend()
		tried = append(tried, b.Name)
		x.s.m.retries.WithLabelValues(string(router.RoleDecode), "connect_error").Inc()
		call = x.call(b, x.route, body)
		resp, err = call.Do(wd.ctx)
	}
	if err == nil && x.own.hold != nil {
		x.own.hold.Release(lifecycle.ReleaseDecoded)
		x.own.hold = nil
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

// watchdog bounds a decode's phases (first byte, silence between chunks) and, when asked,
// defers the client's cancel to the decode's first byte.
type watchdog struct {
	ctx        context.Context
	cancel     context.CancelCauseFunc
	timer      *time.Timer
	idle       time.Duration
	sawByte    atomic.Bool
	clientGone atomic.Bool
	timeout    atomic.Bool
	stopAfter  func() bool
}

func newWatchdog(client context.Context, deferCancel bool, firstByte, idle time.Duration) *watchdog {
	base := client
	if deferCancel {
		// Detached from the client on purpose: the AfterFunc below cancels it at the first byte.
		base = context.WithoutCancel(client)
	}
	ctx, cancel := context.WithCancelCause(base)
	wd := &watchdog{ctx: ctx, cancel: cancel, idle: idle}
	wd.timer = time.AfterFunc(firstByte, func() {
		wd.timeout.Store(true)
		if wd.sawByte.Load() {
			cancel(errIdleTimeout)
		} else {
			cancel(errFirstByteTimeout)
		}
	})
	if deferCancel {
		wd.stopAfter = context.AfterFunc(client, func() {
			wd.clientGone.Store(true)
			if wd.sawByte.Load() {
				cancel(context.Canceled)
			}
		})
	}
	return wd
}

func (wd *watchdog) onBytes() {
	if !wd.sawByte.Load() {
		wd.sawByte.Store(true)
		if wd.clientGone.Load() {
			wd.cancel(context.Canceled)
		}
	}
	wd.timer.Reset(wd.idle)
}

func (wd *watchdog) timedOut() bool { return wd.timeout.Load() }

func (wd *watchdog) stop() {
	wd.timer.Stop()
	if wd.stopAfter != nil {
		wd.stopAfter()
	}
	wd.cancel(context.Canceled)
}
