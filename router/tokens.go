package router

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// WantsTokens reports whether role's pool scores requests by their tokens
// (precise_cache_aware): only then is Router.Tokens worth its round trip before Acquire.
func (r *Router) WantsTokens(role routerconfig.Role) bool {
	p := r.pool(role)
	if p == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.caps.WantsTokens
}

// TokenizeRequest is what Router.Tokens tokenizes: a completion's Prompt, or a chat's
// Messages (the request's messages array as the client sent it), which the engine renders
// through its chat template with the generation prompt, as it will for the request.
type TokenizeRequest struct {
	Model    string
	Prompt   string
	Messages json.RawMessage
}

// ErrNoTokenizer means no backend is available to tokenize with, or the router was given
// no routerconfig.Tokenizer (routerconfig.Config.EngineTokenizer).
var ErrNoTokenizer = errors.New("router: no backend available to tokenize")

// Tokens tokenizes a request with the router's Tokenizer, on the least loaded available
// backend of either role (any engine of the model tokenizes alike), through its own client
// (its key, its CA), within tokenize_timeout. It takes no lease: the call is small and must
// not queue behind the load. On an error the proxy routes the request by its text alone.
// The tokens may be handed back with ReturnTokens once nothing reads them. A request the
// proxy tokenizes itself and finds longer than tokenize_max_tokens answers
// routerconfig.ErrTooManyTokens, without asking an engine.
func (r *Router) Tokens(ctx context.Context, req TokenizeRequest) ([]uint32, error) {
	if toks, local, err := r.localTokens(req); local {
		return toks, err
	}
	if r.tokenizer == nil {
		return nil, ErrNoTokenizer
	}
	var pick *Backend
	for _, role := range []routerconfig.Role{routerconfig.RolePrefill, routerconfig.RoleDecode} {
		for _, b := range r.Available(role) {
			if pick == nil || b.Inflight() < pick.Inflight() {
				pick = b
			}
		}
	}
	if pick == nil {
		return nil, ErrNoTokenizer
	}
	timeout := r.settings.Load().tokenizeTimeout
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	toks, err := r.tokenizer.Tokenize(ctx, pick.client, strings.TrimSuffix(pick.URLString, "/"), req.Model, req.Prompt, req.Messages)
	if err != nil {
		return nil, fmt.Errorf("tokenize at %s: %w", pick.Name, err)
	}
	return toks, nil
}
