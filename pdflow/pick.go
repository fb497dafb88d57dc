package pdflow

import (
	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func (x *Exchange) hint(role routerconfig.Role, exclude []string) router.Hint {
	if len(x.Tries.avoid) > 0 {
		exclude = x.Tries.avoided(exclude[:len(exclude):len(exclude)])
	}
	h := router.Hint{RequestID: x.ID, Prefix: x.Req.Prefix, Text: x.HintText(role), Tokens: x.Legs.tokens, Model: x.Req.Model, Exclude: exclude,
		LoRA: x.Req.Key.LoRA, CacheSalt: x.Req.Key.Salt, Session: x.Sess.Key, Bound: x.Sess.bound(role),
		BoundText: x.Sess.boundText(role)}
	h.Class, h.Slack, h.Flow, h.MaxWait = x.Class, x.Slack, x.Tenant, x.MaxWait
	h.Placed, h.Sent = x.placed(role, h)
	return h
}

// reservation says whether the request's decoder is reserved before its prefill, and which
// engines that reservation accepts (nil: any). Under before_prefill it always is. Under
// after_prefill it is not, except for a request that only paired engines (SGLang, Mooncake)
// can serve now, every usable decoder of its model being one: their legs go out together, so
// the decoder is needed with the prefiller, and is reserved first as under before_prefill.
// While a decoder of a sequential engine (vLLM's NixlConnector) may serve the request, it is
// served by one, as after_prefill asks.
func (x *Exchange) reservation() (before bool, accept func(routerconfig.Engine) bool) {
	if x.s.cfg.DecoderReservation != ReserveAfterPrefill {
		return true, nil
	}
	for _, d := range x.s.router.Available(routerconfig.RoleDecode) {
		if x.Req.Model != "" && !d.Serves(x.Req.Model) {
			continue
		}
		if sequential(d.Engine) {
			return false, nil
		}
		before = true
	}
	return before, paired
}

// reserveDecoder takes a lease on a decoder for the request, one accept takes when set, and
// returns the custody holding it; on failure it ends the custody.
func (x *Exchange) reserveDecoder(c custody, accept func(routerconfig.Engine) bool) (custody, *api.Error) {
	h := x.hint(routerconfig.RoleDecode, nil)
	h.Accept = accept
	if rs := x.Out.Resume; rs != nil && rs.Attempt > 0 {
		h.Accept = func(e routerconfig.Engine) bool { return continuable(e) && (accept == nil || accept(e)) }
	}
	lease, err := x.s.router.Acquire(x.Ctx, routerconfig.RoleDecode, h)
	if err != nil {
		return custody{}, x.failWith(c, router.Result{}, api.FromRouter(err, routerconfig.RoleDecode))
	}
	x.picked(routerconfig.RoleDecode, lease)
	c.lease, x.Legs.Decode = lease, lease.Backend()
	return c, nil
}

// pickPrefiller is the prefiller for a prefill attempt: the router's pick, or, in the sidecar
// mode, the one the header named, for the first attempt only (there is no other to retry on).
// A detached prefiller comes with no lease; a nil lease releases nothing.
func (x *Exchange) pickPrefiller(h router.Hint) (*router.Lease, *router.Backend, error) {
	if x.s.sidecar {
		if len(h.Exclude) > 0 {
			return nil, nil, router.ErrNoBackend
		}
		return nil, x.Legs.Named, nil
	}
	lease, err := x.s.router.Acquire(x.Ctx, routerconfig.RolePrefill, h)
	if err == nil {
		x.picked(routerconfig.RolePrefill, lease)
	}
	return lease, lease.Backend(), err
}
