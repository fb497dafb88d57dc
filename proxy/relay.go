package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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

// The relay's read buffers. A read returns whatever the decoder has sent so far, and that
// goes to the client at once: a buffer bounds a write, it never waits to fill. A stream holds
// its buffer for as long as it lasts, idle between tokens, so streams get small ones (an SSE
// event is a few hundred bytes, and the transport reads through 4 KiB anyway): 10,000 open
// streams then hold 40 MiB, not 320. A whole JSON answer, read at once, gets a large one.
var (
	streamBufPool = sync.Pool{New: func() any { b := make([]byte, 4<<10); return &b }}
	wholeBufPool  = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}
)

// decode sends the decode call and relays its answer to the client.
func (x *exchange) decode() *apiError {
	start := time.Now()
	defer func() { x.decodeT = time.Since(start) }()
	b := x.decodeB
	forward, hold, ok := x.s.table.StartDecodeHandoff(x.id, b.Name)
	if !ok {
		return x.gone()
	}
	// The hold passes to the decoder only once the decoder has acknowledged the decode by
	// answering its headers: from then on it pulls the blocks, or notifies the prefiller when
	// it aborts. Before that, a written request is no proof: a server still finishing the
	// previous response on a reused connection drops a request whose connection closes
	// before it reads it. So a decode cut short before its headers (the client left, the
	// connection failed, the decoder refused it) leaves the release to the proxy.
	var acked bool
	if hold != nil {
		defer func() {
			if !acked {
				x.endedElsewhere = true
				x.s.releaseUncertain(x.id, x.req, x.prefillB, x.kvParams, hold, x.decodeB.Name)
			}
		}()
	}
	var params json.RawMessage
	if forward {
		params = x.kvParams
	} else if x.kvParams != nil {
		// The hold deadline passed (race R4): these params are never forwarded, the decoder
		// recomputes. An engine with an explicit abort can free the stale hold right away.
		if p := x.prefillB; p != nil && kvbackend.HasAbort(p.Engine) {
			x.s.abortOnEngine(x.id, p)
		}
	}
	body, err := kvbackend.DecodeBody(x.req.fields, params)
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

	call := kvbackend.Call{Client: b.Client(), BaseURL: baseURL(b), Path: x.route, ID: x.id, Header: x.hdr, Body: body}
	resp, err := call.Do(wd.ctx)
	tried := []string{b.Name}
	for attempt := 0; err != nil && isConnectError(err) && x.ctx.Err() == nil && attempt < x.s.cfg.DecodeRetries; attempt++ {
		// The decoder provably never got the call: another one may take it.
		lease, aerr := x.s.router.Acquire(x.ctx, router.RoleDecode, x.hint(tried))
		if aerr != nil {
			break
		}
		x.decodeLease.Release(resultOf(err, x.ctx))
		x.decodeLease, x.decodeB, b = lease, lease.Backend(), lease.Backend()
		tried = append(tried, b.Name)
		x.s.m.retries.WithLabelValues(string(router.RoleDecode), "connect_error").Inc()
		call.Client, call.BaseURL = b.Client(), baseURL(b)
		resp, err = call.Do(wd.ctx)
	}
	if err == nil && hold != nil {
		acked = true
		hold.Release(lifecycle.ReleaseDecoded)
	}
	if err != nil {
		x.decodeRes = resultOf(err, x.ctx)
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
	x.decodeRes = router.Result{Status: http.StatusOK}
	return x.relay(resp, wd)
}

// relay copies the decoder's answer to the client as it arrives, flushing every read, so a
// stream reaches the client chunk by chunk with nothing added in between.
func (x *exchange) relay(resp *http.Response, wd *watchdog) *apiError {
	h := x.w.Header()
	ct := resp.Header.Get("Content-Type")
	if ct == "" {
		ct = "application/json"
		if x.req.stream {
			ct = "text/event-stream"
		}
	}
	h.Set("Content-Type", ct)
	if x.req.stream {
		h.Set("Cache-Control", "no-cache")
		// Tells an nginx in front not to buffer the stream either.
		h.Set("X-Accel-Buffering", "no")
	}
	// The decoder's Date is the answer's: a proxy passes it on (RFC 9110 section 6.6.1), and
	// the server then has none of its own to format.
	if d := resp.Header["Date"]; len(d) > 0 {
		h["Date"] = d
	}
	rc := http.NewResponseController(x.w)
	pool := &wholeBufPool
	if x.req.stream {
		pool = &streamBufPool
	}
	bufp := pool.Get().(*[]byte)
	defer pool.Put(bufp)
	buf := *bufp
	// tail is the last two bytes the client got: where a broken stream stopped, mid-line or
	// on an event boundary.
	var tail []byte
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			wd.onBytes()
			if x.ctx.Err() != nil {
				x.s.m.tokensAfter.Add(float64(countEvents(buf[:n])))
				return x.gone()
			}
			if !x.wrote {
				x.w.WriteHeader(http.StatusOK)
				x.wrote = true
				x.ttft = time.Since(x.start)
			}
			x.chunks++
			if x.s.cfg.ClientWriteTimeout > 0 {
				// A client that stops reading must not pin a decoder and its memory forever.
				_ = rc.SetWriteDeadline(time.Now().Add(x.s.cfg.ClientWriteTimeout))
			}
			_, werr := x.w.Write(buf[:n])
			if werr == nil {
				werr = rc.Flush()
			}
			if werr != nil {
				// The client is gone, or too slow: what this read held was never delivered.
				x.s.m.tokensAfter.Add(float64(countEvents(buf[:n])))
				x.cancel()
				return x.gone()
			}
			tail = append(tail, buf[max(0, n-2):n]...)
			tail = tail[max(0, len(tail)-2):]
		}
		if rerr == io.EOF {
			if !x.wrote {
				x.w.WriteHeader(http.StatusOK)
				x.wrote = true
			}
			x.s.table.Finish(x.id)
			return nil
		}
		if rerr != nil {
			return x.brokenAnswer(rerr, wd, tail)
		}
	}
}

// brokenAnswer ends an answer whose decoder failed or timed out after the call had begun;
// tail is the last bytes of it the client got.
func (x *exchange) brokenAnswer(rerr error, wd *watchdog, tail []byte) *apiError {
	if x.ctx.Err() != nil && !wd.timedOut() {
		return x.gone()
	}
	x.fail()
	if wd.timedOut() {
		rerr = errors.Join(context.Cause(wd.ctx), rerr)
		x.decodeRes = router.Result{Status: http.StatusGatewayTimeout}
	} else {
		x.decodeRes = router.Result{Err: rerr}
	}
	e := fromBackend(rerr, router.RoleDecode, "decode_timeout")
	if !x.wrote {
		return e
	}
	if x.req.stream {
		// The status line went out long ago; the stream ends with an error event in the
		// OpenAI shape, and no [DONE], so clients see it failed. A decoder that broke mid-event
		// left a partial line: the error starts an event of its own, or the client would read
		// it as the end of that line.
		x.w.Write(eventBreak(tail))
		x.w.Write([]byte("data: "))
		x.w.Write(e.body())
		x.w.Write([]byte("\n\n"))
		http.NewResponseController(x.w).Flush()
		return e
	}
	x.abortConn = true
	return e
}

// eventBreak is what ends the partial SSE event a stream stopped in, given its last bytes:
// nothing on an event boundary (a blank line), one more line end after a complete line.
func eventBreak(tail []byte) []byte {
	switch {
	case len(tail) == 0 || bytes.HasSuffix(tail, []byte("\n\n")):
		return nil
	case tail[len(tail)-1] == '\n':
		return []byte("\n")
	}
	// A lone CR ends a line too, but a CR followed by this LF is one line end: two LFs are
	// needed either way.
	return []byte("\n\n")
}

// countEvents counts the SSE events in p, which stand for tokens in a completion stream.
func countEvents(p []byte) int {
	n := bytes.Count(p, []byte("data:"))
	n -= bytes.Count(p, []byte("data: [DONE]"))
	if n < 0 {
		return 0
	}
	return n
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

// isConnectError reports whether a backend call failed before it reached the backend.
func isConnectError(err error) bool {
	var ce *kvbackend.CallError
	return errors.As(err, &ce) && ce.Connect
}
