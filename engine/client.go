package engine

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"sync"
	"sync/atomic"
	"syscall"

	"go.opentelemetry.io/otel/propagation"
)

// maxPrefillResponse bounds how much of a prefiller's answer is read: it is one token plus
// the params, so anything near this size is a broken backend, not a completion.
const maxPrefillResponse = 4 << 20

// StatusError is a backend's answer with a status other than 200: the body is kept (bounded)
// so that 4xx answers can be passed to the client as they came.
type StatusError struct {
	Status      int
	ContentType string
	Body        []byte
	// Truncated: the body was longer than maxErrorBody, and Body holds only its start.
	Truncated bool
}

// maxErrorBody bounds how much of an error answer is kept: an engine's error is a short JSON
// object, and one past this size is passed to nobody whole.
const maxErrorBody = 64 << 10

func (e *StatusError) Error() string {
	// The body stays out of the message: errors end up in log lines, and an engine's error
	// text may quote the request (a prompt must never reach a log). The client gets the body.
	return fmt.Sprintf("backend answered %d (%d-byte body)", e.Status, len(e.Body))
}

// CallError is a failure to get an answer from a backend at all. Connect tells whether the
// request provably never reached the backend (the connection or its TLS handshake failed, or
// nothing of the request was written); Unprocessed whether the backend provably never took
// it (that, or the request never went out whole, or the backend reset the connection with the
// request unread), so that another try cannot do the work twice. A backend that closed the
// connection cleanly after the request went out may have read all of it: neither is set
// then, and the request must not be sent again (Go's own transport retries a POST only when
// nothing of it was written).
type CallError struct {
	Connect     bool
	Unprocessed bool
	Err         error
}

func (e *CallError) Error() string { return e.Err.Error() }
func (e *CallError) Unwrap() error { return e.Err }

// Call is one request to one backend.
type Call struct {
	// Client's transport carries the call; an engine's redirect comes back as a
	// *StatusError, never followed.
	Client  *http.Client
	BaseURL string // scheme://host:port, no trailing slash
	Path    string // e.g. /v1/completions
	ID      string // X-Request-Id, the same on the prefill and the decode call
	// ClientID, when set, is the client's own request id, sent as X-Client-Request-Id so that
	// an engine's logs can be matched with the proxy's and the client's.
	ClientID string
	Header   http.Header
	Body     []byte
	// ContentType is the body's media type, e.g. a multipart/form-data one with its
	// boundary; empty means application/json.
	ContentType string
	// Engine reads a prefill's answer; nil means vLLM.
	Engine Engine
	// OnAck, when set, asks the backend to acknowledge the call (Expect: 100-continue) and is
	// called, on another goroutine, when it does: the backend's handler has begun to read the
	// body, so the request has reached it. Servers send it before any answer (Go's net/http
	// and uvicorn on the handler's first read of the body); a server that answers without
	// reading the body sends none.
	OnAck func()
}

func (c Call) request(ctx context.Context) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+c.Path, bytes.NewReader(c.Body))
	if err != nil {
		return nil, fmt.Errorf("build request to %s: %w", c.BaseURL, err)
	}
	for k, v := range c.Header {
		req.Header[k] = v
	}
	ct := c.ContentType
	if ct == "" {
		ct = "application/json"
	}
	req.Header.Set("Content-Type", ct)
	// identity keeps an SSE stream relayable byte for byte; the transport would otherwise ask
	// for gzip and decompress behind our back.
	req.Header.Set("Accept-Encoding", "identity")
	req.Header.Set("X-Request-Id", c.ID)
	// The call's span (the proxy's, when it traces) goes on to the engine, whose own spans
	// then join the trace; a call without one passes on the client's traceparent, if any.
	traceContext.Inject(ctx, propagation.HeaderCarrier(req.Header))
	if c.ClientID != "" {
		req.Header.Set("X-Client-Request-Id", c.ClientID)
	}
	return req, nil
}

// callTrace records what a call's transport reports of it: whether the request went out
// whole, and whether the backend acknowledged it ("100 Continue", passed on to onAck).
type callTrace struct {
	wrote, acked atomic.Bool
}

func (t *callTrace) trace(onAck func()) *httptrace.ClientTrace {
	return &httptrace.ClientTrace{
		WroteRequest: func(i httptrace.WroteRequestInfo) { t.wrote.Store(i.Err == nil) },
		Got100Continue: func() {
			t.acked.Store(true)
			if onAck != nil {
				onAck()
			}
		},
	}
}

// Do sends the call and returns the response of a 200, whose body the caller must close.
// Any other status comes back as a *StatusError, a transport failure as a *CallError. A call
// the backend provably never took on a connection it had kept open (the keep-alive race: it
// closed the connection as the request went out) goes out once more on another connection,
// as Go's transport does with a request of which nothing was written.
func (c Call) Do(ctx context.Context) (*http.Response, error) {
	resp, err := c.do(ctx)
	var ce *CallError
	if errors.As(err, &ce) && ce.Unprocessed && !ce.Connect && ctx.Err() == nil {
		resp, err = c.do(ctx)
	}
	return resp, err
}

func (c Call) do(ctx context.Context) (*http.Response, error) {
	var tr callTrace
	req, err := c.request(httptrace.WithClientTrace(ctx, tr.trace(c.OnAck)))
	if err != nil {
		return nil, err
	}
	if c.OnAck != nil {
		req.Header.Set("Expect", "100-continue")
	}
	resp, err := c.send(req)
	if err != nil {
		connect := isConnectError(err)
		unread := tr.wrote.Load() && !tr.acked.Load() && isResetUnread(err)
		return nil, &CallError{Connect: connect, Unprocessed: connect || !tr.wrote.Load() || unread,
			Err: fmt.Errorf("call %s%s: %w", c.BaseURL, c.Path, err)}
	}
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody+1))
		resp.Body.Close()
		se := &StatusError{Status: resp.StatusCode, ContentType: resp.Header.Get("Content-Type"), Body: body}
		if len(body) > maxErrorBody {
			se.Body, se.Truncated = body[:maxErrorBody], true
		}
		return nil, se
	}
	return resp, nil
}

// send hands req to the client's transport itself where the client would add nothing but
// the following of redirects (no timeout, no cookie jar): an engine's redirect is answered as
// its status, never followed, as the router's clients are built to do anyway. http.Client.Do
// would copy the request's headers and URL for a redirect that never comes, on every call.
func (c Call) send(req *http.Request) (*http.Response, error) {
	if c.Client.Timeout != 0 || c.Client.Jar != nil {
		return c.Client.Do(req)
	}
	rt := c.Client.Transport
	if rt == nil {
		rt = http.DefaultTransport
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	if resp.Body == nil { // as Client.Do: a body the caller can always close
		resp.Body = http.NoBody
	}
	return resp, nil
}

// Prefill sends the prefill call and returns the prefiller's kv_transfer_params (nil when it
// holds nothing).
func (c Call) Prefill(ctx context.Context) (json.RawMessage, error) {
	resp, err := c.Do(ctx)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	buf := prefillBufPool.Get().(*bytes.Buffer)
	buf.Reset()
	defer func() {
		if buf.Cap() <= maxPooledPrefillBuf {
			prefillBufPool.Put(buf)
		}
	}()
	if n := resp.ContentLength; n > 0 && n <= maxPrefillResponse {
		buf.Grow(int(n))
	}
	if _, err := buf.ReadFrom(io.LimitReader(resp.Body, maxPrefillResponse)); err != nil {
		return nil, &CallError{Err: fmt.Errorf("read prefill answer from %s: %w", c.BaseURL, err)}
	}
	if e, ok := c.Engine.(Sequential); ok {
		return e.ParsePrefill(buf.Bytes())
	}
	return ParsePrefillResponse(buf.Bytes())
}

// prefillBufPool holds the buffers prefill answers are read into: one token and the params,
// a few hundred bytes, which ParsePrefillResponse copies out. A buffer that grew past
// maxPooledPrefillBuf for an odd answer is let go.
var prefillBufPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

const maxPooledPrefillBuf = 64 << 10

// abortRequest is SGLang's explicit abort, POST /abort_request {"rid": id, "abort_all": false}:
// it aborts a request or frees the KV held for it; an unknown id is a no-op on the engine,
// which matches ids by prefix (so the proxy's ids are of one length).
func abortRequest(ctx context.Context, client *http.Client, baseURL, id string) error {
	body, _ := json.Marshal(struct {
		RID      string `json:"rid"`
		AbortAll bool   `json:"abort_all"`
	}{id, false})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/abort_request", bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("build abort to %s: %w", baseURL, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	traceContext.Inject(ctx, propagation.HeaderCarrier(req.Header))
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("abort %s on %s: %w", id, baseURL, err)
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("abort %s on %s: status %d", id, baseURL, resp.StatusCode)
	}
	return nil
}

// traceContext writes W3C traceparent and tracestate: only a context with a span has any.
var traceContext propagation.TraceContext

// isResetUnread reports whether err is a connection reset before any answer: a server that
// closes a connection while data it has not read waits in it resets it rather than closing it
// cleanly (RFC 1122 4.2.2.13; Linux does so), so the request was not read whole, and an engine
// acts on a request only once it has read all of its JSON body. This is the keep-alive race:
// an idle connection the engine closed just as the request went out on it.
func isResetUnread(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// isConnectError reports whether err happened before the request could reach the backend:
// only then is a retry on another backend provably safe. That is a failed dial (the dialer's
// *net.OpError, from either engine client), a certificate the TLS handshake refused, or a
// failure the engine client itself knows left the request unsent (h1client's Unsent: a failed
// handshake, nothing written to a new connection). A connection lost after the request went
// out is not one, whatever the client: the engine may have begun the work.
func isConnectError(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return true
	}
	var cv *tls.CertificateVerificationError
	if errors.As(err, &cv) {
		return true
	}
	var u interface{ Unsent() bool }
	return errors.As(err, &u) && u.Unsent()
}
