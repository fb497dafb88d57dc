package sim

import (
	"context"
	"errors"
	"strings"
	"sync"
)

// A request without kv_transfer_params (or with null) that asks for several
// choices, n > 1, best_of or several prompts in one completions request, is
// served as a vLLM OpenAI server serves it: one engine request per (prompt,
// sample), each computing its prompt in blocks of its own and freeing them
// when it ends, and one answer with every choice, index prompt*n+sample
// (vLLM's serving_completion). This is what a proxy's decode-only path
// gets from a decoder. A stream interleaves the choices' chunks as their
// tokens come, each with its own index and finish_reason, and ends with one
// [DONE] once every choice has ended; a whole answer lists the choices in
// index order. Usage counts each prompt once and every shown choice's
// tokens. best_of runs best_of samples per prompt and shows the first n,
// the sim having no scores (vLLM V0 picked the best n; V1 removed best_of).
//
// One choice's failure (an error the engine answers, such as its shutdown)
// fails the whole request, as in vLLM; an explicit /abort_request of one
// child's id ends that choice with finish_reason "abort". A client that
// leaves aborts every child.

// choiceEvent is what a child's driver hands the handler: a token, or the
// error that ended the child before its last token.
type choiceEvent struct {
	c   child
	o   output
	err error
}

// choiceResult is what the whole answer says of one shown choice.
type choiceResult struct {
	text     strings.Builder
	ids      []uint32
	finish   string
	complete int
}

// serveChoices runs all (the first request, then its fan-out) and answers
// with every shown choice. Only this goroutine writes to the client: a
// write may panic(http.ErrAbortHandler) (the close-after fault), which
// net/http recovers in the handler's goroutine only.
func (p *responder) serveChoices(all []child) {
	ctx, cancel := context.WithCancel(p.work)
	events := make(chan choiceEvent)
	var wg sync.WaitGroup
	// Deferred, so that a cut stream or a gone client still ends every
	// child: cancel makes each drive abort its request (its blocks freed at
	// the next step), then the handler waits for the drivers.
	defer wg.Wait()
	defer cancel()
	for _, c := range all {
		wg.Go(func() {
			send := func(ev choiceEvent) error {
				select {
				case events <- ev:
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			err := p.e.drive(ctx, c.req, func(o output) error { return send(choiceEvent{c: c, o: o}) })
			if err != nil {
				_ = send(choiceEvent{c: c, err: err})
			}
		})
	}

	results := make([]choiceResult, len(p.api.prompts)*p.api.n)
	for left := len(all); left > 0; {
		var ev choiceEvent
		select {
		case <-p.work.Done():
			p.end(p.work.Err())
			return
		case ev = <-events:
		}
		if ev.err != nil && !errors.Is(ev.err, errAborted) {
			cancel() // the other children end with it
			p.end(ev.err)
			return
		}
		if ev.err != nil || ev.o.finish != "" {
			left--
		}
		if !ev.c.shown {
			continue // best_of beyond n: it runs, nobody sees it
		}
		res := &results[ev.c.index]
		o := ev.o
		if ev.err != nil {
			o = output{finish: "abort", complete: res.complete}
		}
		res.text.WriteString(o.text)
		if o.kind == outToken {
			res.ids = append(res.ids, o.id)
		}
		res.finish, res.complete = o.finish, o.complete
		if !p.api.stream {
			continue
		}
		if err := p.streamChoice(len(results), ev.c.index, o); err != nil {
			p.end(err)
			return
		}
	}

	completionTokens := 0
	for i := range results {
		completionTokens += results[i].complete
	}
	if p.api.stream {
		if err := p.done(completionTokens); err != nil {
			p.end(err)
		}
		return
	}
	c := &completion{ID: p.id, Object: "text_completion", Created: p.created, Model: p.model,
		Usage: p.usage(completionTokens)}
	if !p.e.sglang() {
		c.KVTransferParams = (*prefillKVParams)(nil) // vLLM's null
	}
	if p.api.chat {
		c.Object = "chat.completion"
		c.PromptTokenIDs = p.promptIDs(0)
	}
	for i := range results {
		c.Choices = append(c.Choices, p.wholeChoice(i, results[i].text.String(), results[i].ids, results[i].finish))
	}
	reqs := make([]*request, len(all))
	for i, ch := range all {
		reqs[i] = ch.req
	}
	p.writeBody(c, reqs...)
}

// streamChoice writes one chunk of choice index, beginning the stream (of
// choices choices) if it has not begun.
func (p *responder) streamChoice(choices, index int, o output) error {
	if !p.started {
		if err := p.begin(choices); err != nil {
			return err
		}
	}
	var finish *string
	if o.finish != "" {
		finish = &o.finish
	}
	c := p.chunk(choice{Index: index, FinishReason: finish}, o.text)
	p.streamIDs(c, o)
	if o.kind == outToken && p.f.dieAfter == 0 {
		p.sentToken()
	}
	if err := p.event(c); err != nil {
		return err
	}
	if o.kind == outToken {
		p.sentToken()
	}
	return nil
}
