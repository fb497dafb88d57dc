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
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/pdflow"
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
	return s.exchangeHandler(p.path, func(x *pdflow.Exchange) *api.Error { return s.runPass(x, p) })
}

func (s *Server) runPass(x *pdflow.Exchange, p passRoute) *api.Error {
	body, e := readBody(x.W, x.R, s.cfg.MaxBodyBytes, s.cfg.ReadBodyTimeout)
	if e != nil {
		return e
	}
	var (
		model, ctype string
		fields       *engine.Fields
	)
	if p.body == passMultipart {
		ctype = x.R.Header.Get("Content-Type")
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
	x.Req = &api.Request{Model: model, Fields: fields}
	if model != "" {
		served, label, e := s.resolveModel(model)
		x.Names.Label = label
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
				return pdflow.BuildFailed(err, "engine")
			}
			x.Names.Client, x.Req.Model, x.Req.Fields = model, served, fields
			x.Names.Rename = api.NewRenamer(served, model)
		}
	}
	x.Hdr = s.engineHeader(x.R.Header)
	// A decoder that failed before the first byte reached the client is replaced, as for a
	// generation (pdflow's freshpair.go): the body goes to another one.
	return x.ServePassTracked(body, ctype)
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
