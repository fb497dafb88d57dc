package pdflow

import (
	"context"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// adapterRouter is a router that knows which models its engines serve as LoRA adapters
// (router.Router.Adapter). Checked by type assertion: without it every model is taken for a
// base model.
type adapterRouter interface {
	Adapter(model string) bool
}

// KeyRequest completes the request's cache key once its model is resolved: the adapter it
// names, and the text cache-aware policies match (api.RouteText).
func (x *Exchange) KeyRequest() {
	req := x.Req
	if ar, ok := x.s.router.(adapterRouter); ok && ar.Adapter(req.Model) {
		req.Key.LoRA = req.Model
	}
	req.RouteText = api.RouteText(req.Text, req.Key)
}

// HintText is the text a pick for role matches: none for a request with media when role's
// policy scores by tokens, so that it is scored as holding nothing rather than by a text
// whose items the engines key otherwise.
func (x *Exchange) HintText(role routerconfig.Role) string {
	if x.Req.Key.Media {
		if cr, ok := x.s.router.(cacheRouter); ok && cr.WantsTokens(role) {
			return ""
		}
	}
	return x.Req.RouteText
}

// turnEnds are where in text, the hint text of a pick (HintText), the request's last messages
// end (api.Request.TurnEnds); none where text is none.
func (x *Exchange) turnEnds(text string) []int {
	if text == "" || len(x.Req.TurnEnds) == 0 {
		return nil
	}
	ends := make([]int, len(x.Req.TurnEnds))
	for i, e := range x.Req.TurnEnds {
		ends[i] = e + len(text) - len(x.Req.Text) // behind RouteText's tag, if any
	}
	return ends
}

// cacheHint is what the router weighs a decoder's cache by for conditional disaggregation.
func (x *Exchange) cacheHint() router.Hint {
	return router.Hint{Tokens: x.Legs.tokens, LoRA: x.Req.Key.LoRA, CacheSalt: x.Req.Key.Salt}
}

// cacheRouter is what a router that routes on the engines' prefix caches offers: whether a
// role's policy wants the request's tokens, a tokenizer (the proxy's own for the models it
// has one of, else an engine's /tokenize), and how many
// of a prompt's leading tokens a backend holds. Checked by type assertion: a router without
// it routes on the text alone.
type cacheRouter interface {
	WantsTokens(role routerconfig.Role) bool
	Tokens(ctx context.Context, req router.TokenizeRequest) ([]uint32, error)
	CachedTokens(backend string, h router.Hint) (int, bool)
	ReturnTokens(tokens []uint32)
}
