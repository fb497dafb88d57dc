package sim

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"go.uber.org/zap"
)

// A prefill with n > 1 or best_of, or with several prompts, fans out as in
// vLLM: one engine request per (prompt, sample), each holding its own
// blocks. Only the first, which keeps the X-Request-Id, answers with
// kv_transfer_params (vLLM #38900 for n, #54707 for prompt arrays); the
// others' holds are invisible to whoever reads the answer, and nothing but
// their leases frees them. A whole (non-streaming) answer lists every
// prompt's first n choices, index prompt*n+sample; a streaming one carries
// the first request's choice only, a simplification: a proxy streams
// nothing from a prefiller.

// A request without kv_transfer_params fans out the same way, each child
// computing its own prompt, and answers every choice (choices.go).

// childID names sample k of prompt i of request rid, after vLLM's "<k>_<id>"
// for n and "<id>-<i>" for prompt arrays. (0, 0) is rid itself.
func childID(rid string, i, k int) string {
	if i == 0 && k == 0 {
		return rid
	}
	return fmt.Sprintf("%d_%s-%d", k, rid, i)
}

// child is one request of a fan-out.
type child struct {
	req   *request
	index int  // choice index, prompt*n+sample
	shown bool // sample < n: its choice is in the answer
}

// childResult is what a child produced, for the answer.
type childResult struct {
	index    int
	text     string
	ids      []uint32 // the tokens' ids, for return_token_ids
	finish   string
	complete int
}

// newChildren builds the requests of a fan-out beyond the first (which
// keeps rid), or none for a request of one prompt and one sample. An error
// is the first prompt that cannot be served.
func (e *Engine) newChildren(rid string, a *apiRequest) ([]child, error) {
	if len(a.prompts) == 1 && a.samples == 1 {
		return nil, nil
	}
	var out []child
	for i, tokens := range a.prompts {
		for k := range a.samples {
			if i == 0 && k == 0 {
				continue
			}
			one := *a
			one.promptTokens = tokens
			if i < len(a.tokens) {
				one.tokens = a.tokens[i : i+1]
			}
			name := childID(rid, i, k)
			if a.sg != nil && a.sg.rids != nil && a.samples == 1 {
				name = a.sg.rids[i] // SGLang names each prompt's request
			}
			r, err := e.newRequest(name, &one)
			if err != nil {
				return nil, err
			}
			r.leg = a.sg.leg(i)
			out = append(out, child{req: r, index: i*a.n + k, shown: k < a.n})
		}
	}
	return out, nil
}

// fanOut runs children beside the first request. Its goroutines belong to
// the handler that started them, which waits for them with wait; ctx ends
// them with the handler's request.
type fanOut struct {
	wg      sync.WaitGroup
	results []childResult
}

func (e *Engine) startChildren(ctx context.Context, children []child) *fanOut {
	if len(children) == 0 {
		return nil
	}
	f := &fanOut{results: make([]childResult, len(children))}
	for i, c := range children {
		f.wg.Go(func() {
			var text strings.Builder
			res := childResult{index: c.index}
			err := e.drive(ctx, c.req, func(o output) error {
				text.WriteString(o.text)
				res.ids = append(res.ids, o.id)
				res.finish, res.complete = o.finish, o.complete
				return nil
			})
			if err != nil {
				if ctx.Err() == nil {
					e.log.Warn("fan-out request failed", zap.String("request_id", c.req.rid), zap.Error(err))
				}
				res.finish = "abort"
			}
			res.text = text.String()
			if !c.shown {
				res.index = -1 // best_of beyond n: it ran and holds, but is not shown
			}
			f.results[i] = res
		})
	}
	return f
}

// wait returns the shown children's results once all have ended.
func (f *fanOut) wait() []childResult {
	if f == nil {
		return nil
	}
	f.wg.Wait()
	out := make([]childResult, 0, len(f.results))
	for _, r := range f.results {
		if r.index >= 0 {
			out = append(out, r)
		}
	}
	return out
}
