package pdflow

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// serveLegs serves a request on an engine with paired legs (SGLang): the client's body goes
// to a prefiller and to the reserved decoder at once, both naming the same bootstrap room on
// the prefiller; the decoder's answer goes to the client, the prefiller's is read and dropped.
// The prefiller holds the request's KV in the room from the start until the decoder has it
// (its first byte, or the prefiller's answer, which comes once the transfer is done): until
// then every way out aborts the legs (release.go), the decoder's first.
//
// It hands the custody back with errMoveOn and errFreshPair, and ends it otherwise.
func (x *Exchange) serveLegs(c custody) (custody, *api.Error) {
	if ti, ok := engineOf(x.Legs.Decode).(engine.TokensIn); x.Req.API == engine.APIGenerate && (!ok || !ti.TokensIn()) {
		// SGLang has no token-in route: its engines would answer 404 to both legs.
		return custody{}, x.failWith(c, router.Result{Canceled: true}, api.NewError(api.KindNoRoute, fmt.Sprintf("the engines of model %s do not serve %s", x.Model(), api.GenerateRoute)))
	}
	c, lease, e := x.pickPair(c)
	if e != nil {
		return c, e
	}
	d, p := x.Legs.Decode, lease.Backend()
	eng := engineOf(d).(engine.Paired)
	x.Legs.Prefill = p
	bs, err := x.s.bootstrap(x.Ctx, p)
	if err == nil && len(bs.EngineIDs) > 0 {
		err = pickPrefillRank(&bs, lease)
	}
	if err != nil {
		lease.Release(resultOf(err, x.Ctx))
		return custody{}, x.failWith(c, router.Result{Canceled: true}, api.FromBackend(&engine.CallError{Err: err}, routerconfig.RolePrefill, api.KindPrefillTimeout))
	}
	leg := engine.Leg{Host: p.URL.Hostname(), Port: bs.Port, Room: engine.NewRoom(), RID: x.EngineID, Prompts: x.Req.Prompts,
		TransferID: "xfer-" + x.EngineID, Rank: -1, API: x.Req.API}
	if len(bs.EngineIDs) > 0 {
		leg.Rank = bs.Ranks()[0]
		leg.EngineID = bs.EngineIDs[leg.Rank]
	} else if r, ok := lease.Rank(); ok {
		leg.Rank = r
	}
	var calls engine.LegCalls
	route := x.Req.Route
	err = x.s.guard(x.ID, func() (err error) {
		f := x.fieldsFor(d)
		if f, route, err = x.asChat(d, f, &leg); err != nil {
			return err
		}
		calls, err = eng.Legs(f, leg)
		return err
	})
	if err != nil {
		lease.Release(router.Result{})
		return custody{}, x.failWith(c, router.Result{}, BuildFailed(err, "legs'"))
	}
	if !x.s.table.StartLegs(x.ID, p.Name, d.Name) {
		lease.Release(router.Result{Canceled: true})
		return custody{}, x.gone(c)
	}
	pl := &pairedLegs{rids: leg.RIDs(), drain: calls.Drain, start: time.Now()}
	x.Legs.paired = pl
	defer func() {
		if x.Times.Prefill == 0 {
			x.Times.Prefill = time.Since(pl.start)
		}
		x.Times.Decode = time.Since(pl.start)
	}()

	// The prefill leg: its answer only says whether the room was served. It comes about when
	// the decoder's answer begins, and may come after the client has the whole of it, so the
	// leg may outlive the handler (tracked as the server's background work, bounded by
	// prefill_timeout): it is cut only when the request fails or the client leaves.
	pctx, pcancel := context.WithTimeoutCause(context.WithoutCancel(x.Ctx), x.s.cfg.PrefillTimeout, api.ErrPhaseTimeout)
	prefilled := make(chan error, 1)
	pcall := withHeader(x.call(p, route, calls.Prefill), calls.PrefillHeader, nil)
	clientCtx := x.Ctx
	pspan := x.callSpan(SpanPrefillLeg, p)
	// prefillEnded is closed when the prefill leg's call is over; prefillOK records that it
	// was answered: the prefill ended, and the prefiller holds the KV.
	prefillEnded := make(chan struct{})
	var prefillOK atomic.Bool
	// prefillSent records that the prefill leg went out whole: cut with no answer, it may
	// have finished on the prefiller all the same (race R1).
	var prefillSent atomic.Bool
	sentTrace := &httptrace.ClientTrace{WroteRequest: func(i httptrace.WroteRequestInfo) { prefillSent.Store(i.Err == nil) }}
	x.s.bg.Add(1)
	go func() {
		defer x.s.bg.Done()
		defer close(prefillEnded)
		defer pcancel()
		err := x.s.guard(x.ID, func() error {
			resp, err := pcall.Do(httptrace.WithClientTrace(withSpan(pctx, pspan), sentTrace))
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			return err
		})
		if err != nil && context.Cause(pctx) == api.ErrPhaseTimeout {
			err = errors.Join(api.ErrPhaseTimeout, err)
		}
		endSpan(pspan, err)
		res := resultOf(err, clientCtx)
		if err != nil && pctx.Err() != nil && context.Cause(pctx) != api.ErrPhaseTimeout {
			// The proxy cut the leg itself (the decode failed): not the prefiller's fault.
			res = router.Result{Canceled: true}
		}
		lease.Release(res)
		prefillOK.Store(err == nil)
		prefilled <- err
	}()
	served := false
	defer func() {
		if !served {
			pcancel()
		}
	}()

	// The decode leg.
	wd := newWatchdog(x.Ctx, false, false, x.s.cfg.DecodeFirstByteTimeout, x.s.cfg.DecodeIdleTimeout)
	defer wd.stop()
	pl.cut = func() bool {
		wd.cancel(errLegsAborted)
		pcancel()
		// Its answer may be on its way as the connection closes: the leg's end says.
		<-prefillEnded
		if prefillOK.Load() {
			return true
		}
		// A prefill cut once it was sent may have finished as the cut came: an engine with
		// no abort (Mooncake) then holds its KV for its timer, 480 s, unless a drain leg
		// pulls it. A drain for a prefill that was aborted fails at once (the prefiller
		// knows the transfer ended), so where there is one, the proxy sends it.
		return calls.Drain != nil && prefillSent.Load()
	}
	type answer struct {
		resp *http.Response
		err  error
	}
	decoded := make(chan answer, 1)
	dcall := withHeader(x.call(d, route, calls.Decode), calls.DecodeHeader, c.lease)
	dspan := x.callSpan(SpanDecodeLeg, d)
	var derr error
	defer func() { endSpan(dspan, derr) }()
	go func() {
		var resp *http.Response
		err := x.s.guard(x.ID, func() (err error) {
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
				if eng.AnswersAfterTransfer() {
					// The prefiller answers once the room's KV went to the decoder.
					x.joinLegs()
				}
				continue
			}
			if x.Ctx.Err() != nil {
				continue // the decode leg ends on the same cancel
			}
			// The decoder would wait for a room nobody fills: it is aborted with the prefill,
			// and not blamed for it. A prefill leg that provably never started, or was
			// refused as unavailable, is tried again on a fresh pair.
			var fresh *api.Error
			if retriable(err, true) {
				c, fresh = x.freshPair(c, router.Result{Canceled: true}, routerconfig.RolePrefill, retryReason(err), p)
			}
			if fresh == nil {
				x.fail(c, router.Result{Canceled: true})
				c = custody{}
			}
			wd.cancel(errPrefillLegFailed)
			ans = <-decoded
			if ans.resp != nil {
				ans.resp.Body.Close()
			}
			if fresh != nil {
				return c, fresh
			}
			return custody{}, api.FromBackend(err, routerconfig.RolePrefill, api.KindPrefillTimeout)
		case ans = <-decoded:
			waiting = false
		}
	}
	if ans.err != nil {
		derr = ans.err
		if retriable(ans.err, false) && !wd.timedOut() {
			// Its decoder provably never took the leg: the room goes, and a fresh pair
			// serves the request.
			pl.neverTaken = true
			if c, e = x.freshPair(c, resultOf(ans.err, x.Ctx), routerconfig.RoleDecode, retryReason(ans.err), d); e != nil {
				return c, e
			}
		}
		if c, e = x.retryDecode(c, ans.err, wd); e != nil {
			return c, e
		}
		return custody{}, x.decodeFailed(c, ans.err, wd)
	}
	c, e = x.relayAnswer(c, ans.resp, wd)
	served = e == nil
	if e != nil {
		derr = e
	}
	return c, e
}

// pickPair takes a prefiller for the request's reserved decoder, and answers its lease. A pair
// never goes out half to an engine ejected or gone down since it was picked (passive health
// may eject one between the two picks, or while another request waits): the prefiller is
// picked again, and the decoder, if it is the one, reserved again, a few times at most. It
// returns the custody (holding the decoder's lease); on failure it ends it.
func (x *Exchange) pickPair(c custody) (custody, *router.Lease, *api.Error) {
	for try := 0; ; try++ {
		d := x.Legs.Decode
		h := x.hint(routerconfig.RolePrefill, nil)
		h.Accept = pairedWith(d.Engine)
		lease, err := x.s.router.Acquire(x.Ctx, routerconfig.RolePrefill, h)
		if err != nil {
			// A decoder in disaggregated mode cannot serve alone: no decode-only fallback.
			return custody{}, nil, x.failWith(c, router.Result{Canceled: true}, api.FromRouter(err, routerconfig.RolePrefill))
		}
		x.picked(routerconfig.RolePrefill, lease)
		if x.s.router.Usable(d) && x.s.router.Usable(lease.Backend()) {
			return c, lease, nil
		}
		lease.Release(router.Result{Canceled: true})
		if try == pairPicks {
			return custody{}, nil, x.failWith(c, router.Result{Canceled: true}, api.FromRouter(router.ErrNoBackend, routerconfig.RoleDecode))
		}
		if !x.s.router.Usable(d) {
			var e *api.Error
			if c, e = x.reserveDecoder(c.withoutLease(router.Result{Canceled: true}), pairedWith(d.Engine)); e != nil {
				return c, nil, e
			}
		}
	}
}

// pairPicks bounds how many times a pair is picked again because one of it went out of use.
const pairPicks = 3

var (
	errPrefillLegFailed = errors.New("the prefill leg failed")
	errLegsAborted      = errors.New("the legs were aborted")
)

// joinLegs records, once, that a paired request's decoder has the room's KV: the prefill is
// done. Sequential requests have nothing to join.
func (x *Exchange) joinLegs() {
	if pl := x.Legs.paired; pl != nil && !pl.joined {
		pl.joined = true
		x.s.table.LegsJoined(x.ID)
		x.Times.Prefill = time.Since(pl.start)
	}
}

// pickPrefillRank keeps, of a Mooncake prefiller's ranks, the one the prefill leg goes to:
// the lease's, when the backend declares its data-parallel ranks, else its first.
func pickPrefillRank(bs *engine.Bootstrap, lease *router.Lease) error {
	rank := bs.Ranks()[0]
	if r, ok := lease.Rank(); ok {
		rank = r
	}
	id, ok := bs.EngineIDs[rank]
	if !ok {
		return fmt.Errorf("the prefiller's bootstrap server names no rank %d (it names %v): its data_parallel_size is wrong", rank, bs.Ranks())
	}
	bs.EngineIDs = map[int]string{rank: id}
	return nil
}

// bootstrap is what p's bootstrap server says (its port; Mooncake's engine ids by rank),
// asked of the engine once (DiscoverBootstrapPorts asks again at start and on reload).
func (s *Flow) bootstrap(ctx context.Context, p *router.Backend) (engine.Bootstrap, error) {
	if bs, ok := s.bootstraps.known.Load(p.URLString); ok {
		return bs.(engine.Bootstrap), nil
	}
	v, err, _ := s.bootstraps.fetch.Do(p.URLString, func() (any, error) {
		// Shared by every request waiting on it, so detached from this one's client.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), defaultAbortCallTimeout)
		defer cancel()
		return s.discoverBootstrap(ctx, p)
	})
	if err != nil {
		return engine.Bootstrap{}, err
	}
	return v.(engine.Bootstrap), nil
}

func (s *Flow) discoverBootstrap(ctx context.Context, p *router.Backend) (engine.Bootstrap, error) {
	eng, ok := engineOf(p).(engine.Paired)
	if !ok {
		return engine.Bootstrap{}, errors.New("not a paired engine")
	}
	bs, err := eng.Bootstrap(ctx, p.Client(), BaseURL(p), p.BootstrapPort)
	if err != nil {
		return engine.Bootstrap{}, err
	}
	s.bootstraps.known.Store(p.URLString, bs)
	return bs, nil
}

// DiscoverBootstrapPorts asks every paired prefiller what its bootstrap server says (SGLang:
// its port, from GET /server_info, unless bootstrap_port is configured; Mooncake: its ranks'
// engine ids, from GET /query), at start and after a reload. One that does not answer is
// asked again by its first request.
func (s *Flow) DiscoverBootstrapPorts(ctx context.Context) error {
	var errs []error
	for _, p := range s.router.Available(routerconfig.RolePrefill) {
		if _, ok := engineOf(p).(engine.Paired); !ok {
			continue
		}
		if _, err := s.discoverBootstrap(ctx, p); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// asChat is the body and route of a request's legs on decoder d: a Messages request for an
// engine whose Messages handler cannot take part in P/D goes as the chat completion it stands
// for, its legs bounded as a chat's, and its answer translated (a translator for this
// attempt); any other request as it came.
func (x *Exchange) asChat(d *router.Backend, f *engine.Fields, leg *engine.Leg) (*engine.Fields, string, error) {
	x.Out.translate = nil
	mc, ok := engineOf(d).(engine.MessagesByChat)
	if x.Req.API != engine.APIMessages || !ok || !mc.MessagesByChat() {
		return f, x.Req.Route, nil
	}
	chat, err := x.Req.ToChat()
	if err != nil {
		return nil, "", err
	}
	leg.API = engine.APIChat
	x.Out.translate = &api.ChatToMessages{Stream: x.Req.Stream, Stops: x.Req.Anthropic.Stops}
	return chat, "/v1/chat/completions", nil
}
