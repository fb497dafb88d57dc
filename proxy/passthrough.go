package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
)

// passBody is what a passthrough route's body is.
type passBody int

const (
	// passJSON: a JSON object naming its model.
	passJSON passBody = iota
	// passJSONAnyModel: a JSON object that may omit its model (vLLM's tokenizer routes):
	// any decoder serves it then.
	passJSONAnyModel
	// passMultipart: multipart/form-data with a model form field (audio transcriptions).
	passMultipart
)

// passRoute is a route that one engine serving the request's model answers, without P/D:
// the pooling and tokenizer routes, and transcriptions.
type passRoute struct {
	path string
	body passBody
}

// passthroughRoutes are vLLM's non-generation routes. They are served by one decoder each
// (llm-d's P/D sidecar sends every route but generation straight to its decoder too).
var passthroughRoutes = []passRoute{
	{"/v1/embeddings", passJSON},
	{"/tokenize", passJSONAnyModel},
	{"/detokenize", passJSONAnyModel},
	{"/v1/score", passJSON},
	{"/score", passJSON},
	{"/v1/rerank", passJSON},
	{"/rerank", passJSON},
	{"/v2/rerank", passJSON},
	{"/pooling", passJSON},
	{"/classify", passJSON},
	{"/v1/audio/transcriptions", passMultipart},
	// Anthropic's token count, which vLLM and SGLang serve beside /v1/messages.
	{api.CountTokensRoute, passJSON},
}

// passthrough serves a passthrough route as an exchange: the same body bounds, model
// resolution, table entry, metrics, log line and disconnect handling as generation.
func (s *Server) passthrough(p passRoute) http.HandlerFunc {
	return s.exchangeHandler(p.path, func(x *exchange) *api.Error { return x.runPass(p) })
}

func (x *exchange) runPass(p passRoute) *api.Error {
	body, e := readBody(x.w, x.r, x.s.cfg.MaxBodyBytes, x.s.cfg.ReadBodyTimeout)
	if e != nil {
		return e
	}
	var (
		model, ctype string
		fields       *engine.Fields
	)
	if p.body == passMultipart {
		ctype = x.r.Header.Get("Content-Type")
		if model, e = multipartModel(body, ctype); e != nil {
			return e
		}
	} else {
		if fields, e = parseObject(body); e != nil {
			return e
		}
		if e := api.StringField(fields, "model", p.body == passJSON, &model); e != nil {
			return e
		}
		if model == "" && p.body == passJSON {
			return api.BadRequest("model", "model must not be empty")
		}
	}
	x.req = &api.Request{Model: model, Fields: fields}
	if model != "" {
		served, label, e := x.s.resolveModel(model)
		x.names.label = label
		if e != nil {
			return e
		}
		if served != model {
			var err error
			if p.body == passMultipart {
				body, ctype, err = multipartWithModel(body, ctype, served)
			} else {
				v, _ := json.Marshal(served)
				if fields, err = fields.With("model", v); err == nil {
					body = fields.Bytes()
				}
			}
			if err != nil {
				return buildFailed(err, "engine")
			}
			x.names.client, x.req.Model, x.req.Fields = model, served, fields
			x.names.rename = api.NewRenamer(served, model)
		}
	}
	x.hdr = x.s.engineHeader(x.r.Header)
	// A decoder that failed before the first byte reached the client is replaced, as for a
	// generation (freshpair.go): the body goes to another one.
	return x.track(func(c *custody) *api.Error {
		return x.serve(c, func(c *custody) *api.Error { return x.servePass(c, body, ctype) })
	})
}

// servePass sends the request to one decoder serving its model and relays the answer as it
// comes; it takes the custody. The call carries the client's context: a client that leaves
// closes the engine's connection at once. decode_first_byte_timeout and decode_idle_timeout
// bound the answer.
func (x *exchange) servePass(c *custody, body []byte, ctype string) *api.Error {
	if e := x.reserveDecoder(c, nil); e != nil {
		return e
	}
	start := time.Now()
	defer func() { x.times.decode = time.Since(start) }()
	b := x.legs.decode
	if _, _, ok := x.s.table.StartDecode(x.id, b.Name); !ok {
		return x.gone(c)
	}
	wd := newWatchdog(x.ctx, false, false, x.s.cfg.DecodeFirstByteTimeout, x.s.cfg.DecodeIdleTimeout)
	defer wd.stop()
	span := x.callSpan(spanDecode, b)
	var err error
	defer func() { endSpan(span, err) }()
	call := x.call(b, x.route, body)
	call.ContentType = ctype
	resp, err := x.send(c, call, wd, span, nil, func(b *router.Backend, _ *engine.Call) error {
		if _, _, ok := x.s.table.StartDecode(x.id, b.Name); !ok {
			return errNotInTable
		}
		return nil
	})
	if err != nil {
		if e := x.retryDecode(c, err, wd); e != nil {
			return e
		}
		return x.decodeFailed(c, err, wd)
	}
	h := x.w.Header()
	for k, v := range api.UpstreamHeader(resp.Header) {
		h[k] = v
	}
	if !renamable(resp.Header.Get("Content-Type")) {
		// Only a JSON answer (or a stream of JSON events) names its model; a transcript in
		// plain text or subtitles is the engine's words, never rewritten.
		x.names.rename = nil
	}
	if e := x.relayAnswer(c, resp, wd); e != nil {
		err = e
		return e
	}
	return nil
}

// errNotInTable is a call the table no longer lets go out: the request was aborted (its
// client left, or shutdown gave up on it) as it moved to another engine.
var errNotInTable = errors.New("the request left the table")

// renamable reports whether an answer of media type ct is JSON, or SSE events of JSON.
func renamable(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		return ct == ""
	}
	return mt == "application/json" || mt == "text/event-stream" || strings.HasSuffix(mt, "+json")
}

// parseObject validates a body as one JSON object.
func parseObject(body []byte) (*engine.Fields, *api.Error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, api.BadRequest("", "request body is empty; expected a JSON object")
	}
	if !utf8.Valid(body) {
		return nil, api.BadRequest("", "request body is not valid UTF-8")
	}
	f, err := engine.ParseFields(body)
	if errors.Is(err, engine.ErrNullBody) {
		return nil, api.BadRequest("", "request body must be a JSON object, not null")
	}
	if err != nil {
		return nil, api.BadRequest("", "request body is not a valid JSON object: "+api.JSONProblem(err))
	}
	return f, nil
}

// multipartBoundary is the boundary of a multipart/form-data content type.
func multipartBoundary(ctype string) (string, *api.Error) {
	mt, params, err := mime.ParseMediaType(ctype)
	if err != nil || mt != "multipart/form-data" || params["boundary"] == "" {
		return "", api.NewError(api.KindInvalidContentType, "this route takes a multipart/form-data body with a boundary")
	}
	return params["boundary"], nil
}

// maxModelField bounds the model form field: a model name, not a file.
const maxModelField = 4 << 10

// multipartModel checks a multipart/form-data body part by part and returns its model form
// field, which is required.
func multipartModel(body []byte, ctype string) (string, *api.Error) {
	boundary, e := multipartBoundary(ctype)
	if e != nil {
		return "", e
	}
	malformed := func(err error) *api.Error {
		return api.NewError(api.KindInvalidValue, "the multipart/form-data body is malformed").With("", err, 0)
	}
	mr := multipart.NewReader(bytes.NewReader(body), boundary)
	model, found := "", false
	for {
		// Raw parts: a part's bytes are checked as they are, never decoded.
		part, err := mr.NextRawPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			return "", malformed(err)
		}
		if part.FormName() != "model" {
			if _, err := io.Copy(io.Discard, part); err != nil {
				return "", malformed(err)
			}
			continue
		}
		v, err := io.ReadAll(io.LimitReader(part, maxModelField+1))
		if err != nil {
			return "", malformed(err)
		}
		if len(v) > maxModelField {
			return "", api.BadRequest("model", "model is too long")
		}
		model, found = strings.TrimSpace(string(v)), true
	}
	switch {
	case !found:
		return "", api.BadRequest("model", "model is required")
	case model == "":
		return "", api.BadRequest("model", "model must not be empty")
	}
	return model, nil
}

// multipartWithModel is a multipart/form-data body with its model form field set to model,
// and its content type: every other part's headers and bytes as they came (a file's bytes
// untouched), under a boundary of its own.
func multipartWithModel(body []byte, ctype, model string) ([]byte, string, error) {
	boundary, e := multipartBoundary(ctype)
	if e != nil {
		return nil, "", e
	}
	mr := multipart.NewReader(bytes.NewReader(body), boundary)
	var out bytes.Buffer
	out.Grow(len(body) + len(model) + 64)
	mw := multipart.NewWriter(&out)
	for {
		part, err := mr.NextRawPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, "", err
		}
		pw, err := mw.CreatePart(part.Header)
		if err != nil {
			return nil, "", err
		}
		if part.FormName() == "model" {
			_, err = io.WriteString(pw, model)
		} else {
			_, err = io.Copy(pw, part)
		}
		if err != nil {
			return nil, "", err
		}
	}
	if err := mw.Close(); err != nil {
		return nil, "", err
	}
	return out.Bytes(), mw.FormDataContentType(), nil
}
