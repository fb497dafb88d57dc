package pdflow

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
)

// The relay's read buffers. A read returns whatever the decoder has sent so far, and that
// goes to the client at once: a buffer bounds a write, it never waits to fill. A stream holds
// its buffer for as long as it lasts, idle between tokens, so streams get small ones (an SSE
// event is a few hundred bytes, and the transport reads through 4 KiB anyway): 10,000 open
// streams then hold 40 MiB, not 320. A whole JSON answer, read at once, gets a large one.
var (
	streamBufPool = sync.Pool{New: func() any { b := make([]byte, 4<<10); return &b }}
	wholeBufPool  = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}
)

// nextReader is a body that hands out its bytes from its own read buffer (h1client's): the
// relay then needs no buffer of its own, and learns whether more is already there.
type nextReader interface {
	Next() (p []byte, more bool, err error)
}

// nextOf is body's Next, or nil for a body without one.
func nextOf(body io.Reader) func() ([]byte, bool, error) {
	if nr, ok := body.(nextReader); ok {
		return nr.Next
	}
	return nil
}

// relay copies the decoder's answer to the client as it arrives, flushing as soon as nothing
// more of it has arrived, so a stream reaches the client chunk by chunk with nothing added in
// between, and chunks the decoder sent together go out in one write.
// It returns the custody when the answer is whole, and hands it back with errMoveOn and
// errFreshPair; it ends it otherwise.
func (x *Exchange) relay(c custody, resp *http.Response, wd *watchdog) (custody, *api.Error) {
	h := x.W.Header()
	ct := resp.Header.Get("Content-Type")
	if ct == "" {
		ct = "application/json"
		if x.Req.Stream {
			ct = "text/event-stream"
		}
	}
	h.Set("Content-Type", ct)
	if x.Req.Stream {
		h.Set("Cache-Control", "no-cache")
		// Tells an nginx in front not to buffer the stream either.
		h.Set("X-Accel-Buffering", "no")
	}
	// The decoder's Date is the answer's: a proxy passes it on (RFC 9110 section 6.6.1), and
	// the server then has none of its own to format.
	if d := resp.Header["Date"]; len(d) > 0 {
		h["Date"] = d
	}
	rc := http.NewResponseController(x.W)
	next := nextOf(resp.Body)
	if next == nil {
		pool := &wholeBufPool
		if x.Req.Stream {
			pool = &streamBufPool
		}
		bufp := pool.Get().(*[]byte)
		defer pool.Put(bufp)
		buf := *bufp
		next = func() ([]byte, bool, error) {
			n, err := resp.Body.Read(buf)
			return buf[:n], false, err
		}
	}
	rs := x.Out.Resume
	chain := x.relayStages()
	x.Out.end.API = x.Req.API
	answered := false
	// delivered: the stream's end (its [DONE], or its API's last event) was written and
	// flushed to the client, which then has the whole answer.
	delivered := false
	for {
		data, more, rerr := next()
		if len(data) > 0 {
			wd.onBytes() // the decoder answered, whatever of it goes out
			if !answered {
				// A decoder back from an ejection is alive again from its first byte on.
				answered = true
				c.lease.Answered()
				// A decoder answers only once it has the KV: paired legs have joined, even
				// where the client gets nothing before the whole answer (one converted
				// to another API), and a decoder silent from then on is the one to blame.
				x.joinLegs()
				if x.Req.Stream {
					// A stream's first byte is its first token: the prefill has ended.
					c.lease.Prefilled()
				}
			}
		}
		data, rerr = api.Pass(chain, data, rerr)
		if delivered && x.Ctx.Err() != nil {
			// The client has the whole answer, whatever it does next: one that closes its
			// connection as soon as it reads the end (as scripts and load tools do) cancels
			// the call before the engine's response ends, which it does a moment after its
			// last event. The request was served, and the engine has finished it: nothing is
			// aborted, and what it sends after the end is for nobody.
			data, rerr = nil, io.EOF
		}
		if n := len(data); n > 0 {
			if x.Ctx.Err() != nil {
				x.countAfterGone(data)
				return custody{}, x.gone(c)
			}
			if !x.Out.Wrote {
				x.W.WriteHeader(http.StatusOK)
				x.Out.Wrote = true
				x.Times.TTFT = time.Since(x.Times.Start)
			}
			if rs != nil && !rs.watching {
				// From its first byte on, a stream that can go on elsewhere leaves a decoder
				// that is going away before it breaks.
				rs.watching = true
				if continuable(x.Legs.Decode.Engine) {
					wd.cutWhenLeaving(x.Legs.Decode.Leaving(), rs.movable.Load)
				}
			}
			x.Out.chunks++
			// A client that stops reading must not pin a decoder and its memory forever.
			x.writeDeadline(rc)
			_, werr := x.W.Write(data)
			if werr == nil && !more {
				// What the decoder sent in one burst goes out in one write and one flush.
				werr = rc.Flush()
			}
			if werr != nil {
				// The client is gone, or too slow: what this read held was never delivered.
				x.countAfterGone(data)
				x.Cancel(werr)
				return custody{}, x.gone(c)
			}
			x.Out.end.Note(data)
			// Flushed when nothing more had arrived: the end is out once the client may read it.
			delivered = x.Req.Stream && !more && x.Out.end.Complete()
		}
		if delivered && rerr != nil {
			// So too when the decoder breaks, or falls silent past decode_idle_timeout, after
			// the end went out and before its response's own end: no error follows the end.
			rerr = io.EOF
		}
		if rerr == io.EOF {
			// A decoder that ends its answer before any byte of it (a 200 closed at once), or
			// a stream before its [DONE], failed: the client must not take it for complete.
			switch {
			case !x.Out.Wrote:
				rerr = errEmptyAnswer
			case x.Req.Stream && !x.Out.end.Complete():
				switch x.Req.API {
				case engine.APIResponses:
					rerr = errResponsesUnfinished
				case engine.APIMessages:
					rerr = errMessagesUnfinished
				default:
					rerr = errStreamUnfinished
				}
			default:
				// The deadline set for the last write may have passed while the decoder was
				// silent: the response's end (HTTP/1.1's last chunk) must still go out.
				x.writeDeadline(rc)
				x.s.table.Finish(x.ID)
				return c, nil
			}
		}
		if rerr != nil {
			cause := rerr
			if why := context.Cause(wd.ctx); wd.timedOut() || errors.Is(why, errDecoderLeaving) {
				cause = errors.Join(why, rerr)
			}
			if x.canMove(cause) {
				x.Out.broke = cause
				return c, errMoveOn
			}
			var e *api.Error
			if c, e = x.retryDecode(c, rerr, wd); e != nil {
				return c, e
			}
			return custody{}, x.decodeFailed(c, rerr, wd)
		}
	}
}

// countAfterGone counts the stream chunks in data, read after the client left.
func (x *Exchange) countAfterGone(data []byte) {
	n := api.CountEvents(data)
	x.Out.afterGone += n
	x.s.m.TokensAfter.Add(float64(n))
}

// errEmptyAnswer and errStreamUnfinished are answers a decoder ended too early.
var (
	errEmptyAnswer      = errors.New("the decoder answered 200 and closed without a body")
	errStreamUnfinished = errors.New("the decoder's stream ended before its [DONE]")
	// A Responses stream has no [DONE]: it ends at its last event.
	errResponsesUnfinished = errors.New("the decoder's stream ended before its last event (response.completed, .incomplete or .failed)")
	errMessagesUnfinished  = errors.New("the decoder's stream ended before its message_stop")
)

// writeDeadline gives the next write to the client client_write_timeout from now.
func (x *Exchange) writeDeadline(rc *http.ResponseController) {
	if x.s.cfg.ClientWriteTimeout > 0 {
		_ = rc.SetWriteDeadline(time.Now().Add(x.s.cfg.ClientWriteTimeout))
	}
}
