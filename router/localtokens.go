package router

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// tokenizerCheckInterval is how often the router tries again to check the tokenizers no
// engine could check yet.
const tokenizerCheckInterval = time.Second

// The states of a local tokenizer: until an engine agrees with it on the samples, the
// model's requests are tokenized by the engines' /tokenize.
const (
	localUnchecked int32 = iota
	localAgreed
	localDisagreed
)

// localTokenizer is a model's routerconfig.LocalTokenizer and whether an engine agreed with it.
type localTokenizer struct {
	model string
	tok   routerconfig.LocalTokenizer
	state atomic.Int32
	// maxTokens is tokenize_max_tokens in force.
	maxTokens atomic.Int64
}

// CheckSamples are what the proxy tokenizes itself and through an engine's /tokenize before
// it tokenizes a model's requests itself: prompts and chats of the kinds a tokenizer gets
// wrong when it differs (spaces and line breaks, numbers, contractions, punctuation, case,
// non-Latin scripts, emoji, the special tokens of a template).
var CheckSamples = []TokenizeRequest{
	{Prompt: "The capital of France is Paris."},
	{Prompt: "  Leading spaces, trailing spaces,\tand tabs  \n\n\nthen three line breaks\r\n"},
	{Prompt: "Numbers 1234567 and 3.14159; don't, WE'LL, they're, I'm, it's."},
	{Prompt: "def main():\n    print(\"hello, world\")  # a comment\n    return {'a': [1, 2]}\n"},
	{Prompt: "naïve café, Straße, 東京タワー, Москва, 🙂👍🏽, ＡＢＣ ①"},
	{Messages: json.RawMessage(`[{"role":"user","content":"What is the capital of France?"}]`)},
	{Messages: json.RawMessage(`[{"role":"system","content":"You are a helpful assistant.\n"},{"role":"user","content":"  Hello!  "},` +
		`{"role":"assistant","content":"Hi there, how can I help?"},{"role":"user","content":"Tell me 3 facts about 東京 🙂"}]`)},
}

// localTokenizers builds the router's view of cfg's LocalTokenizers.
func newLocalTokenizers(cfg routerconfig.Config, reg prometheus.Registerer) (map[string]*localTokenizer, error) {
	if len(cfg.LocalTokenizers) == 0 {
		return nil, nil
	}
	out := make(map[string]*localTokenizer, len(cfg.LocalTokenizers))
	for model, tok := range cfg.LocalTokenizers {
		out[model] = &localTokenizer{model: model, tok: tok}
	}
	if reg != nil {
		c := prometheus.NewGaugeFunc // one series per configured model, a closed set
		for _, model := range slices.Sorted(maps.Keys(out)) {
			lt := out[model]
			g := c(prometheus.GaugeOpts{
				Namespace: "pdproxy", Name: "tokenizer_in_proxy",
				Help:        "1 while a model's requests are tokenized by the proxy's own tokenizer (its file agreed with an engine's /tokenize on the samples), 0 while an engine's /tokenize does it (no engine checked it yet, or it disagreed).",
				ConstLabels: prometheus.Labels{"model": model},
			}, func() float64 {
				if lt.state.Load() == localAgreed {
					return 1
				}
				return 0
			})
			if err := reg.Register(g); err != nil {
				return nil, fmt.Errorf("register router metrics: %w", err)
			}
		}
	}
	return out, nil
}

// TokenizerMismatchError is CheckTokenizers' answer when the proxy's tokenizer of a model
// and an engine's /tokenize disagree on a sample.
type TokenizerMismatchError struct {
	Model, Backend string
	Sample         TokenizeRequest
	// At is the first index where the two differ; Proxy and Engine are the tokens from
	// a little before it.
	At            int
	Proxy, Engine []uint32
	ProxyLen      int
	EngineLen     int
}

func (e *TokenizerMismatchError) Error() string {
	what := fmt.Sprintf("prompt %q", e.Sample.Prompt)
	if e.Sample.Messages != nil {
		what = fmt.Sprintf("chat %s", e.Sample.Messages)
	}
	return fmt.Sprintf("tokenizers.%s: the proxy's tokenizer and %s's /tokenize disagree on the %s: %d tokens against %d, first differing at token %d (proxy %v, engine %v from token %d); check that the file is the model's",
		e.Model, e.Backend, what, e.ProxyLen, e.EngineLen, e.At, e.Proxy, e.Engine, max(0, e.At-2))
}

// CheckTokenizers compares each local tokenizer not yet checked with an engine serving its
// model, on CheckSamples: agreeing, the proxy tokenizes the model's requests itself from
// then on; disagreeing, it answers a *TokenizerMismatchError (and the engines keep
// tokenizing the model). A model no engine answers for stays unchecked, and Run checks it
// again every second until one does, its requests tokenized by the engines meanwhile.
func (r *Router) CheckTokenizers(ctx context.Context) error {
	var errs []error
	for _, model := range slices.Sorted(maps.Keys(r.local)) {
		lt := r.local[model]
		if lt.state.Load() != localUnchecked {
			continue
		}
		if err := r.checkTokenizer(ctx, lt); err != nil {
			lt.state.Store(localDisagreed)
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// checkTokenizer checks lt at the first engine of its model that answers every sample;
// with none it leaves lt unchecked.
func (r *Router) checkTokenizer(ctx context.Context, lt *localTokenizer) error {
	if r.tokenizer == nil {
		return nil
	}
	timeout := r.settings.Load().tokenizeTimeout
	for _, role := range []routerconfig.Role{routerconfig.RolePrefill, routerconfig.RoleDecode} {
	backends:
		for _, b := range r.Available(role) {
			if !b.Serves(lt.model) {
				continue
			}
			for _, s := range CheckSamples {
				if s.Messages != nil && !lt.tok.Chats() {
					continue
				}
				own, err := lt.tok.Tokenize(nil, s.Prompt, s.Messages, math.MaxInt)
				if err != nil {
					return fmt.Errorf("tokenizers.%s: the proxy cannot tokenize a sample (%q%s): %w", lt.model, s.Prompt, s.Messages, err)
				}
				cctx, cancel := context.WithTimeout(ctx, timeout)
				theirs, err := r.tokenizer.Tokenize(cctx, b.client, strings.TrimSuffix(b.URLString, "/"), lt.model, s.Prompt, s.Messages)
				cancel()
				if err != nil {
					r.logger.Debug("tokenizer check: engine did not answer", zap.String("model", lt.model), zap.String("backend", b.Name), zap.Error(err))
					continue backends
				}
				if !slices.Equal(own, theirs) {
					at := 0
					for at < min(len(own), len(theirs)) && own[at] == theirs[at] {
						at++
					}
					from := max(0, at-2)
					return &TokenizerMismatchError{Model: lt.model, Backend: b.Name, Sample: s, At: at,
						Proxy: own[from:min(len(own), at+3)], Engine: theirs[from:min(len(theirs), at+3)], ProxyLen: len(own), EngineLen: len(theirs)}
				}
			}
			lt.state.Store(localAgreed)
			r.logger.Info("tokenizing in the proxy: the tokenizer agrees with the engine", zap.String("model", lt.model), zap.String("backend", b.Name),
				zap.Bool("chat", lt.tok.Chats()))
			return nil
		}
	}
	return nil
}

// checkTokenizersLoop runs CheckTokenizers every tokenizerCheckInterval until no tokenizer
// is left unchecked or ctx is done. A disagreement found here, after the start, is logged:
// the model's requests stay with the engines' /tokenize.
func (r *Router) checkTokenizersLoop(ctx context.Context) {
	unchecked := func() bool {
		for _, lt := range r.local {
			if lt.state.Load() == localUnchecked {
				return true
			}
		}
		return false
	}
	if !unchecked() {
		return
	}
	t := time.NewTicker(tokenizerCheckInterval)
	defer t.Stop()
	for unchecked() {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := r.CheckTokenizers(ctx); err != nil && ctx.Err() == nil {
				r.logger.Error("the proxy's tokenizer disagrees with an engine: its model is tokenized by the engines", zap.Error(err))
			}
		}
	}
}

// limitLocalTokens makes max (tokenize_max_tokens) the most tokens the local tokenizers
// give a request.
func (r *Router) limitLocalTokens(max int) {
	for _, lt := range r.local {
		lt.maxTokens.Store(int64(max))
	}
}

// localTokens tokenizes req in the proxy when its model's tokenizer was checked and can,
// into a buffer of the router's that ReturnTokens takes back; local reports that it did,
// or that the request has more tokens than tokenize_max_tokens (routerconfig.ErrTooManyTokens), which
// no engine need count either.
func (r *Router) localTokens(req TokenizeRequest) (_ []uint32, local bool, _ error) {
	lt := r.local[req.Model]
	if lt == nil || lt.state.Load() != localAgreed {
		return nil, false, nil
	}
	buf, _ := r.tokenBufs.Get().(*[]uint32)
	if buf == nil {
		buf = new([]uint32)
	}
	toks, err := lt.tok.Tokenize((*buf)[:0], req.Prompt, req.Messages, int(lt.maxTokens.Load()))
	if err != nil {
		if *buf = toks[:0]; cap(*buf) <= maxReturnedTokens {
			r.tokenBufs.Put(buf)
		}
		if errors.Is(err, routerconfig.ErrTooManyTokens) {
			return nil, true, fmt.Errorf("tokenize in the proxy: %w", err)
		}
		if !errors.Is(err, routerconfig.ErrNotLocal) {
			if ce := r.logger.Check(zap.DebugLevel, "tokenizing in the proxy failed: asking an engine"); ce != nil {
				ce.Write(zap.String("model", req.Model), zap.Error(err))
			}
		}
		return nil, false, nil
	}
	if toks == nil {
		toks = []uint32{} // tokens, none of them: not the absence of tokens
	}
	return toks, true, nil
}

// maxReturnedTokens bounds the buffers ReturnTokens keeps: a rare huge prompt's is left to
// the collector.
const maxReturnedTokens = 1 << 16

// ReturnTokens hands back tokens Tokens returned, once nothing reads them any more (the
// request was served): the next request the proxy tokenizes itself reuses their memory.
// Tokens from anywhere else are accepted and kept alike.
func (r *Router) ReturnTokens(toks []uint32) {
	if cap(toks) == 0 || cap(toks) > maxReturnedTokens {
		return
	}
	toks = toks[:0]
	r.tokenBufs.Put(&toks)
}
