package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/pdproxy/pdproxy/kvbackend"
	"github.com/pdproxy/pdproxy/router"
)

// serveLegs serves a request on an engine with paired legs (SGLang): the client's body goes
// to a prefiller and to the reserved decoder at once, both naming the same bootstrap room on
// the prefiller; the decoder's answer goes to the client, the prefiller's is read and dropped.
// The prefiller holds the request's KV in the room from the start until the decoder has it
// (its first byte, or the prefiller's answer, which comes once the transfer is done): until
// then every way out aborts the legs (abort.go), the decoder's first.
func (x *exchange) serveLegs() *apiError {
	d := x.decodeB
	eng := engineOf(d).(kvbackend.Paired)
	h := x.hint(nil)
	h.Accept = pairedWith(d.Engine)
	lease, err := x.s.router.Acquire(x.ctx, router.RolePrefill, h)
	if err != nil {
		if x.ctx.Err() != nil {
			return x.gone()
		}
		// A decoder in disaggregated mode cannot serve alone: no decode-only fallback.
		x.fail(router.Result{Canceled: true})
		return fromRouter(err, router.RolePrefill)
	}
	p := lease.Backend()
	x.prefillB = p
	port, err := x.s.bootstrapPort(x.ctx, p)
	if err != nil {
		lease.Release(resultOf(err, x.ctx))
		if x.ctx.Err() != nil {
			return x.gone()
		}
		x.fail(router.Result{Canceled: true})
		return fromBackend(&kvbackend.CallError{Err: err}, router.RolePrefill, "prefill_timeout")
	}
	leg := kvbackend.Leg{Host: p.URL.Hostname(), Port: port, Room: kvbackend.NewRoom(), RID: x.engineID, Prompts: x.req.prompts}
	x.legRIDs = leg.RIDs()
	var body []byte
	err = x.s.guard(x.id, func() (err error) {
		body, err = eng.LegBody(x.req.fields, leg)
		return err
	})
	if err != nil {
		lease.Release(router.Result{})
		x.fail(router.Result{})
		return buildFailed(err, "legs'")
	}
	if !x.s.table.StartLegs(x.id, p.Name, d.Name) {
		lease.Release(router.Result{Canceled: true})
		return x.gone()
	}
	x.paired, x.legsStart, x.heldAt = true, time.Now(), time.Now()
	defer func() {
		if x.prefillT == 0 {
			x.prefillT = time.Since(x.legsStart)
		}
		x.decodeT = time.Since(x.legsStart)
	}()

	// The prefill leg: its answer only says whether the room was served. It comes about when
	// the decoder's answer begins, and may come after the client has the whole of it, so the
	// leg may outlive the handler (tracked as the server's background work, bounded by
	// prefill_timeout): it is cut only when the request fails or the client leaves.
	pctx, pcancel := context.WithTimeoutCause(context.WithoutCancel(x.ctx), x.s.cfg.PrefillTimeout, errPhaseTimeout)
	prefilled := make(chan error, 1)
	pcall := x.call(p, x.route, body)
	clientCtx := x.ctx
	pspan := x.callSpan(spanPrefillLeg, p)
	x.s.bg.Add(1)
	go func() {
		defer x.s.bg.Done()
		defer pcancel()
		err := x.s.guard(x.id, func() error {
			resp, err := pcall.Do(withSpan(pctx, pspan))
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			return err
		})
		if err != nil && context.Cause(pctx) == errPhaseTimeout {
			err = errors.Join(errPhaseTimeout, err)
		}
		endSpan(pspan, err)
		res := resultOf(err, clientCtx)
		if err != nil && pctx.Err() != nil && context.Cause(pctx) != errPhaseTimeout {
			// The proxy cut the leg itself (the decode failed): not the prefiller's fault.
			res = router.Result{Canceled: true}
		}
		lease.Release(res)
		prefilled <- err
	}()
	served := false
	defer func() {
		if !served {
			pcancel()
		}
	}()

	// The decode leg.
	wd := newWatchdog(x.ctx, false, false, x.s.cfg.DecodeFirstByteTimeout, x.s.cfg.DecodeIdleTimeout)
	defer wd.stop()
	x.joined = func() { x.s.table.LegsJoined(x.id) }
	type answer struct {
		resp *http.Response
		err  error
	}
	decoded := make(chan answer, 1)
	dcall := x.call(d, x.route, body)
	dspan := x.callSpan(spanDecodeLeg, d)
	var derr error
	defer func() { endSpan(dspan, derr) }()
	go func() {
		var resp *http.Response
		err := x.s.guard(x.id, func() (err error) {
			resp, err = dcall.Do(withSpan(wd.ctx, dspan))
			return err
		})
		decoded <- answer{resp, err}
	}()
	var ans answer
	for waiting := true; waiting; {
		select {
		case err := <-prefilled:
			prefilled = nil // the leg is done; a nil channel is never ready again
			if err == nil {
				// The prefiller answers once the room's KV went to the decoder.
				x.joinLegs()
				continue
			}
			if x.ctx.Err() != nil {
				continue // the decode leg ends on the same cancel
			}
			// The decoder would wait for a room nobody fills: it is aborted with the prefill,
			// and not blamed for it.
			x.fail(router.Result{Canceled: true})
			wd.cancel(errPrefillLegFailed)
			ans = <-decoded
			if ans.resp != nil {
				ans.resp.Body.Close()
			}
			return fromBackend(err, router.RolePrefill, "prefill_timeout")
		case ans = <-decoded:
			waiting = false
		}
	}
	if ans.err != nil {
		derr = ans.err
		return x.decodeFailed(ans.err, wd)
	}
	defer ans.resp.Body.Close()
	x.own.res = router.Result{Status: http.StatusOK}
	e := x.relay(ans.resp, wd)
	served = e == nil
	if e != nil {
		derr = e
	}
	return e
}

var errPrefillLegFailed = errors.New("the prefill leg failed")

// joinLegs records, once, that the decoder has the room's KV: the prefill is done.
func (x *exchange) joinLegs() {
	if x.joined != nil {
		x.joined()
		x.joined = nil
		x.prefillT = time.Since(x.legsStart)
	}
}

// bootstrapPort is the port of p's bootstrap server: configured, or asked of the engine once
// (DiscoverBootstrapPorts asks again at start and on reload).
func (s *Server) bootstrapPort(ctx context.Context, p *router.Backend) (int, error) {
	if p.BootstrapPort > 0 {
		return p.BootstrapPort, nil
	}
	if port, ok := s.bootstrap.Load(p.URLString); ok {
		return port.(int), nil
	}
	v, err, _ := s.discover.Do(p.URLString, func() (any, error) {
		// Shared by every request waiting on it, so detached from this one's client.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), defaultAbortCallTimeout)
		defer cancel()
		return s.discoverBootstrapPort(ctx, p)
	})
	if err != nil {
		return 0, err
	}
	return v.(int), nil
}

func (s *Server) discoverBootstrapPort(ctx context.Context, p *router.Backend) (int, error) {
	eng, ok := engineOf(p).(kvbackend.Paired)
	if !ok {
		return 0, errors.New("not a paired engine")
	}
	port, err := eng.BootstrapPort(ctx, p.Client(), baseURL(p))
	if err != nil {
		return 0, err
	}
	s.bootstrap.Store(p.URLString, port)
	return port, nil
}

// DiscoverBootstrapPorts asks every paired prefiller without a configured bootstrap_port for
// its port (SGLang: GET /server_info), at start and after a reload. One that does not answer
// is asked again by its first request.
func (s *Server) DiscoverBootstrapPorts(ctx context.Context) error {
	var errs []error
	for _, p := range s.router.Available(router.RolePrefill) {
		if _, ok := engineOf(p).(kvbackend.Paired); !ok || p.BootstrapPort > 0 {
			continue
		}
		if _, err := s.discoverBootstrapPort(ctx, p); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
