package pdflow

import (
	"mime"
	"net/http"
	"strings"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
)

// ServePassTracked serves a passthrough request while the table has it, on another decoder
// when one failed before the client got a byte.
func (x *Exchange) ServePassTracked(body []byte, ctype string) *api.Error {
	return x.track(func(c custody) *api.Error {
		return x.serve(c, func(c custody) (custody, *api.Error) { return x.servePass(c, body, ctype) })
	})
}

// servePass sends the request to one decoder serving its model and relays the answer as it
// comes. It hands the custody back with errFreshPair, and ends it otherwise. The call carries
// the client's context: a client that leaves closes the engine's connection at once.
// decode_first_byte_timeout and decode_idle_timeout bound the answer.
func (x *Exchange) servePass(c custody, body []byte, ctype string) (custody, *api.Error) {
	c, e := x.reserveDecoder(c, nil)
	if e != nil {
		return c, e
	}
	start := time.Now()
	defer func() { x.Times.Decode = time.Since(start) }()
	b := x.Legs.Decode
	if _, _, ok := x.s.table.StartDecode(x.ID, b.Name); !ok {
		return custody{}, x.gone(c)
	}
	wd := newWatchdog(x.Ctx, false, false, x.s.cfg.DecodeFirstByteTimeout, x.s.cfg.DecodeIdleTimeout)
	defer wd.stop()
	span := x.callSpan(SpanDecode, b)
	var err error
	defer func() { endSpan(span, err) }()
	call := x.call(b, x.Route, body)
	call.ContentType = ctype
	var resp *http.Response
	c, resp, err = x.send(c, call, wd, span, nil, func(b *router.Backend, _ *engine.Call) error {
		if _, _, ok := x.s.table.StartDecode(x.ID, b.Name); !ok {
			return errNotInTable
		}
		return nil
	})
	if err != nil {
		if c, e = x.retryDecode(c, err, wd); e != nil {
			return c, e
		}
		return custody{}, x.decodeFailed(c, err, wd)
	}
	h := x.W.Header()
	for k, v := range api.UpstreamHeader(resp.Header) {
		h[k] = v
	}
	if !renamable(resp.Header.Get("Content-Type")) {
		// Only a JSON answer (or a stream of JSON events) names its model; a transcript in
		// plain text or subtitles is the engine's words, never rewritten.
		x.Names.Rename = nil
	}
	if c, e = x.relayAnswer(c, resp, wd); e != nil {
		err = e
	}
	return c, e
}

// renamable reports whether an answer of media type ct is JSON, or SSE events of JSON.
func renamable(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		return ct == ""
	}
	return mt == "application/json" || mt == "text/event-stream" || strings.HasSuffix(mt, "+json")
}
