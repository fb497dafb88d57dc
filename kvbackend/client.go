package kvbackend

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
}

func (e *StatusError) Error() string {
	// The body stays out of the message: errors end up in log lines, and an engine's error
	// text may quote the request (a prompt must never reach a log). The client gets the body.
	return fmt.Sprintf("backend answered %d (%d-byte body)", e.Status, len(e.Body))
}

// CallError is a failure to get an answer from a backend at all. Connect tells whether the
// request provably never reached the backend (the connection or its TLS handshake failed, or
// nothing of the request was written), so that it is safe to send elsewhere.
type CallError struct {
	Connect bool
	Err     error
}

func (e *CallError) Error() string { return e.Err.Error() }
func (e *CallError) Unwrap() error { return e.Err }

// Call is one request to one backend.
type Call struct {
	Client  *http.Client
	BaseURL string // scheme://host:port, no trailing slash
	Path    string // e.g. /v1/completions
	ID      string // X-Request-Id, the same on the prefill and the decode call
	// ClientID, when set, is the client's own request id, sent as X-Client-Request-Id so that
	// an engine's logs can be matched with the proxy's and the client's.
	ClientID string
	Header   http.Header
	Body     []byte
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
	req.Header.Set("Content-Type", "application/json")
	// identity keeps an SSE stream relayable byte for byte; the transport would otherwise ask
	// for gzip and decompress behind our back.
	req.Header.Set("Accept-Encoding", "identity")
	req.Header.Set("X-Request-Id", c.ID)
	if c.ClientID != "" {
		req.Header.Set("X-Client-Request-Id", c.ClientID)
	}
	if c.OnAck != nil {
		req.Header.Set("Expect", "100-continue")
		req = req.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{Got100Continue: c.OnAck}))
	}
	return req, nil
}

// Do sends the call and returns the response of a 200, whose body the caller must close.
// Any other status comes back as a *StatusError, a transport failure as a *CallError.
func (c Call) Do(ctx context.Context) (*http.Response, error) {
	req, err := c.request(ctx)
	if err != nil {
		return nil, err
	}
	resp, err := c.Client.Do(req)
	if err != nil {
		return nil, &CallError{Connect: isConnectError(err), Err: fmt.Errorf("call %s%s: %w", c.BaseURL, c.Path, err)}
	}
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		return nil, &StatusError{Status: resp.StatusCode, ContentType: resp.Header.Get("Content-Type"), Body: body}
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
	if c.Engine != nil {
		return c.Engine.ParsePrefill(buf.Bytes())
	}
	return ParsePrefillResponse(buf.Bytes())
}

// prefillBufPool holds the buffers prefill answers are read into: one token and the params,
// a few hundred bytes, which ParsePrefillResponse copies out. A buffer that grew past
// maxPooledPrefillBuf for an odd answer is let go.
var prefillBufPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

const maxPooledPrefillBuf = 64 << 10

// ErrNoAbort is Engine.Abort's answer for an engine without an explicit abort.
var ErrNoAbort = errors.New("the engine has no explicit abort")

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
