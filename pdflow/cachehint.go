package pdflow

import (
	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/router"
)

// adapterRouter is a router that knows which models its engines serve as LoRA adapters
// (router.Router.Adapter). Checked by type assertion: without it every model is taken for a
// base model.
type adapterRouter interface {
	Adapter(model string) bool
}

// keyRequest completes the request's cache key once its model is resolved: the adapter it
// names, and the text cache-aware policies match (api.RouteText).
func (x *Exchange) KeyRequest() {
	req := x.Req
	if ar, ok := x.s.router.(adapterRouter); ok && ar.Adapter(req.Model) {
		req.Key.LoRA = req.Model
	}
	req.RouteText = api.RouteText(req.Text, req.Key)
}

// hintText is the text a pick for role matches: none for a request with media when role's
// policy scores by tokens, so that it is scored as holding nothing rather than by a text
// whose items the engines key otherwise.
func (x *Exchange) HintText(role router.Role) string {
	if x.Req.Key.Media {
		if cr, ok := x.s.router.(cacheRouter); ok && cr.WantsTokens(role) {
			return ""
		}
	}
	return x.Req.RouteText
}

// cacheHint is what the router weighs a decoder's cache by for conditional disaggregation.
func (x *Exchange) cacheHint() router.Hint {
	return router.Hint{Tokens: x.Legs.tokens, LoRA: x.Req.Key.LoRA, CacheSalt: x.Req.Key.Salt}
}
