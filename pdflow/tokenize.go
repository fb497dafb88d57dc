package pdflow

import (
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// tokenize gets the request's token ids once, before any backend is picked, when a policy
// scores engines by them (precise_cache_aware) or conditional disaggregation weighs them: a
// prompt of token ids is its own; anything else is asked of the router, which tokenizes it
// itself or at an engine. A request whose
// tokenizing fails is routed on its text.
func (x *Exchange) tokenize() {
	cr, ok := x.s.router.(cacheRouter)
	if !ok || x.Legs.tokens != nil || x.Req.Key.Media {
		// A prompt with media is keyed by what the proxy cannot derive: no tokens match it.
		return
	}
	if !cr.WantsTokens(routerconfig.RolePrefill) && !cr.WantsTokens(routerconfig.RoleDecode) && x.s.cfg.PDUncachedTokenThreshold <= 0 {
		return
	}
	if x.Req.Tokens != nil {
		x.Legs.tokens = x.Req.Tokens
		return
	}
	if x.Req.Text == "" || x.Req.Prompts > 1 || x.Req.API == engine.APIResponses {
		// A Responses input renders through the engine's own conversion: the text routes it.
		return
	}
	req := router.TokenizeRequest{Model: x.Req.Model}
	if x.Req.API == engine.APIChat || x.Req.API == engine.APIMessages {
		req.Messages = x.Req.Messages
	} else {
		req.Prompt = x.Req.Text
	}
	toks, err := cr.Tokens(x.Ctx, req)
	if err != nil {
		if ce := x.s.logger.Check(zap.DebugLevel, "tokenize failed: routing on the text"); ce != nil {
			ce.Write(zap.String("request_id", x.ID), zap.Error(err))
		}
		return
	}
	x.Legs.tokens, x.Legs.lent = toks, true
}

// ReturnTokens hands the tokens Tokens lent back to the router once the exchange is over:
// no pick, and nothing else, reads them after it.
func (x *Exchange) ReturnTokens() {
	if !x.Legs.lent {
		return
	}
	toks := x.Legs.tokens
	x.Legs.tokens, x.Legs.lent = nil, false
	x.s.router.(cacheRouter).ReturnTokens(toks)
}

// cachedOnDecoder reports whether the reserved decoder already holds all but fewer than
// pd_uncached_token_threshold of the prompt's tokens, as its KV events tell: a remote
// prefill would only ship KV the decoder has, so the request goes decode-only.
func (x *Exchange) cachedOnDecoder() bool {
	th := x.s.cfg.PDUncachedTokenThreshold
	cr, ok := x.s.router.(cacheRouter)
	if th <= 0 || !ok || len(x.Legs.tokens) == 0 || x.Legs.Decode == nil {
		return false
	}
	n, fresh := cr.CachedTokens(x.Legs.Decode.Name, x.cacheHint())
	return fresh && len(x.Legs.tokens)-n < th
}
