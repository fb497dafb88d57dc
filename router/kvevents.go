package router

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/kvcache"
)

// kvEndpoints are the backends' KV event endpoints as the subscribers know them. Every
// backend is one, so that a topic on kv_events.listen can name it by its URL's host:port.
func kvEndpoints(all []*Backend) []kvcache.Endpoint {
	out := make([]kvcache.Endpoint, 0, len(all))
	for _, b := range all {
		out = append(out, kvcache.Endpoint{Engine: b.Name, HostPort: hostPort(b.URL), Dial: b.kvEvents, Replay: b.kvReplay})
	}
	return out
}

// setKVEndpoints hands the subscribers the backends and kv_events.allowed_sources.
func (r *Router) setKVEndpoints(cfg Config, all []*Backend) {
	allowed := make([]netip.Prefix, 0, len(cfg.KVEvents.AllowedSources))
	for _, s := range cfg.KVEvents.AllowedSources {
		if p, err := kvcache.ParseSource(s); err == nil { // Validate refused the others
			allowed = append(allowed, p)
		}
	}
	r.events.SetAllowedSources(allowed)
	r.events.SetEndpoints(kvEndpoints(all))
}

// runEvents runs the KV event subscribers until ctx is done.
func (r *Router) runEvents(ctx context.Context) {
	if err := r.events.Run(ctx); err != nil {
		r.logger.Error("kv events stopped", zap.Error(err))
	}
}

// forgetCache drops what the proxy believes b's prefix cache holds: an engine that went
// down may come back empty, and until it does it is no candidate anyway.
func (r *Router) forgetCache(b *Backend) {
	r.index.Forget(b.Name)
	if p := r.pool(b.Role); p != nil {
		p.mu.Lock()
		pol := p.policy
		p.mu.Unlock()
		if f, ok := pol.(forgetter); ok {
			f.Forget(b.Name)
		}
	}
}

// prefixCacheStatus is what the pool's cache-aware policy believes b holds, nil under
// another policy.
func (r *Router) prefixCacheStatus(b *Backend, now time.Time) *PrefixCacheStatus {
	p := r.pool(b.Role)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	pol := p.policy
	p.mu.Unlock()
	if ca, ok := pol.(*CacheAware); ok {
		return ca.prefixCacheStatus(b, now)
	}
	return nil
}

// CachedBlocks returns up to limit of the index's keys of the blocks that the backend called
// name holds as its KV events told, in no order: for showing an engine's cache as the proxy
// sees it (its count is in Backends' PrefixCache). Nil when the proxy has none of its events.
func (r *Router) CachedBlocks(name string, limit int) []uint64 {
	return r.index.BlockKeys(name, limit)
}

// WantsTokens reports whether role's pool scores requests by their tokens
// (precise_cache_aware): only then is Router.Tokens worth its round trip before Acquire.
func (r *Router) WantsTokens(role Role) bool {
	p := r.pool(role)
	if p == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.policyName == PolicyPreciseCacheAware
}

// TokenizeRequest is what Router.Tokens tokenizes: a completion's Prompt, or a chat's
// Messages (the request's messages array as the client sent it), which the engine renders
// through its chat template with the generation prompt, as it will for the request.
type TokenizeRequest struct {
	Model    string
	Prompt   string
	Messages json.RawMessage
}

// Limits of a /tokenize answer: a prompt of a million tokens is well under.
const maxTokenizeBytes = 32 << 20

// ErrNoTokenizer means no backend is available to tokenize with.
var ErrNoTokenizer = errors.New("router: no backend available to tokenize")

// Tokens tokenizes a request with an engine's POST /tokenize, on the least loaded available
// backend of either role (any engine of the model tokenizes alike), through its own client
// (its key, its CA), within tokenize_timeout. It takes no lease: the call is small and must
// not queue behind the load. On an error the proxy routes the request by its text alone.
func (r *Router) Tokens(ctx context.Context, req TokenizeRequest) ([]uint32, error) {
	var pick *Backend
	for _, role := range []Role{RolePrefill, RoleDecode} {
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
	return tokenize(ctx, pick, req)
}

// tokenizeBody is POST /tokenize's body, vLLM's and SGLang's.
type tokenizeBody struct {
	Model               string          `json:"model,omitempty"`
	Prompt              *string         `json:"prompt,omitempty"`
	Messages            json.RawMessage `json:"messages,omitempty"`
	AddGenerationPrompt bool            `json:"add_generation_prompt,omitempty"`
}

func tokenize(ctx context.Context, b *Backend, req TokenizeRequest) ([]uint32, error) {
	body := tokenizeBody{Model: req.Model}
	if len(req.Messages) > 0 {
		body.Messages, body.AddGenerationPrompt = req.Messages, true
	} else {
		body.Prompt = &req.Prompt
	}
	data, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("tokenize: %w", err)
	}
	u := strings.TrimSuffix(b.URLString, "/") + "/tokenize"
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := b.client.Do(hr)
	if err != nil {
		return nil, fmt.Errorf("tokenize at %s: %w", b.Name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		return nil, fmt.Errorf("tokenize at %s: answered %d", b.Name, resp.StatusCode)
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	dec := json.NewDecoder(io.LimitReader(resp.Body, maxTokenizeBytes))
	if err := dec.Decode(&out); err != nil {
		return nil, fmt.Errorf("tokenize at %s: %w", b.Name, err)
	}
	if out.Tokens == nil {
		return nil, fmt.Errorf("tokenize at %s: no tokens in the answer", b.Name)
	}
	return out.Tokens, nil
}

// CachedTokens returns how many of tokens' leading tokens the backend called name holds in
// its prefix cache as its KV events tell, in whole blocks: what conditional disaggregation
// weighs against the prompt's length. ok is false when the proxy has no events of the
// backend newer than kv_events.stale_after, so nothing can be said.
func (r *Router) CachedTokens(name string, tokens []uint32) (n int, ok bool) {
	v := r.index.Match(kvcache.NewMatcher(tokens), name)
	stale := r.staleAfter.Load()
	if v.Last.IsZero() || stale == nil || r.now().Sub(v.Last) >= *stale {
		return 0, false
	}
	return v.Matched, true
}
