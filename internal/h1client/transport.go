package h1client

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"sync"
	"time"
)

// Options tunes a Transport. Every zero value means the default named on the field.
type Options struct {
	// DialTimeout bounds a TCP connect; zero means 3 s.
	DialTimeout time.Duration
	// KeepAlive is the TCP keep-alive period; zero means 30 s.
	KeepAlive time.Duration
	// IdleTimeout closes a connection left idle this long; zero means 90 s.
	IdleTimeout time.Duration
	// MaxIdlePerHost is how many idle connections are kept per host; zero means 2.
	MaxIdlePerHost int
	// TLS is the client config for https backends; nil means tls.Config{} (system roots). An
	// empty ServerName is the URL's host.
	TLS *tls.Config
	// TLSHandshakeTimeout bounds a TLS handshake; zero means 5 s.
	TLSHandshakeTimeout time.Duration
	// MaxResponseHeaderBytes bounds a response's head: its status line and header lines,
	// those of interim (1xx) answers included. Zero means DefaultMaxResponseHeaderBytes,
	// net/http's default, so that the heads one engine client takes the other takes too.
	MaxResponseHeaderBytes int64
}

// Transport is an http.RoundTripper for HTTP/1.1 backends. It is safe for concurrent use.
type Transport struct {
	// auth, when set, replaces the request's Authorization header: a backend's own key.
	auth  string
	pools *pools
}

var _ http.RoundTripper = (*Transport)(nil)

// New returns a Transport with its own connection pool.
func New(o Options) *Transport {
	if o.DialTimeout == 0 {
		o.DialTimeout = 3 * time.Second
	}
	if o.KeepAlive == 0 {
		o.KeepAlive = 30 * time.Second
	}
	if o.IdleTimeout == 0 {
		o.IdleTimeout = 90 * time.Second
	}
	if o.MaxIdlePerHost == 0 {
		o.MaxIdlePerHost = 2
	}
	if o.TLSHandshakeTimeout == 0 {
		o.TLSHandshakeTimeout = 5 * time.Second
	}
	if o.TLS == nil {
		o.TLS = &tls.Config{}
	}
	if o.MaxResponseHeaderBytes == 0 {
		o.MaxResponseHeaderBytes = DefaultMaxResponseHeaderBytes
	}
	return &Transport{pools: &pools{opts: o, dialer: &net.Dialer{Timeout: o.DialTimeout, KeepAlive: o.KeepAlive}, m: make(map[string]*hostPool)}}
}

// WithAuthorization returns a Transport that sends value as every request's Authorization
// header (whatever the request carried), over the same connections as t.
func (t *Transport) WithAuthorization(value string) *Transport {
	return &Transport{auth: value, pools: t.pools}
}

// CloseIdleConnections closes the idle connections of every host; busy ones are left alone.
func (t *Transport) CloseIdleConnections() { t.pools.closeIdle() }

// Options returns what t was built with, defaults filled in.
func (t *Transport) Options() Options { return t.pools.opts }

// UnsentError is a failure that provably left the server without any of the request: the TLS
// handshake failed, or not one byte of it could be written to a new connection. Whatever the
// request was, another backend may take it. A failed TCP connect is the dialer's own
// *net.OpError (Op "dial"), which says as much already, as it does from net/http's transport.
type UnsentError struct{ Err error }

func (e *UnsentError) Error() string { return e.Err.Error() }
func (e *UnsentError) Unwrap() error { return e.Err }

// Unsent reports that the request never reached the server, so that a caller can tell with
// errors.As against interface{ Unsent() bool }, without importing this package.
func (e *UnsentError) Unsent() bool { return true }

// ErrClosedBeforeAnswer is a connection the server closed, or reset, after the request was
// written and before a byte of the answer came. It is not an UnsentError: the server may have
// read the request and begun it (then crashed, or was restarted), and on the wire that looks
// the same as an idle timeout that closed a pooled connection while the request was on its
// way. net/http's transport sends again only a request it knows to be idempotent (its
// shouldRetryRequest), and so does RoundTrip; a POST to an engine that may have started
// generating comes back with this error, for the caller to judge.
var ErrClosedBeforeAnswer = errors.New("h1client: connection closed before any answer")

// RoundTrip sends req and reads the response head on the caller's goroutine. The body reads
// from the connection itself; closing it before its end closes the connection.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	buf, err := t.writeRequest(req)
	if err != nil {
		return nil, err
	}
	defer putBuf(buf)
	trace := httptrace.ContextClientTrace(ctx)
	key := req.URL.Scheme + "://" + canonicalAddr(req.URL)
	// A request is sent again only on a new connection after a pooled one failed, and only when
	// the server cannot have acted on it (see the two cases below): every retry takes one idle
	// connection out of the pool, and a new one is never retried.
	for {
		c, reused, err := t.pools.get(ctx, req.URL, key)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, err
		}
		stop := context.AfterFunc(ctx, func() { c.nc.Close() })
		// On TLS, n counts only the records written whole: a record cut short cannot be
		// decrypted, so n == 0 means the server got nothing it could read.
		n, werr := c.nc.Write(*buf)
		if werr != nil {
			stop()
			c.nc.Close()
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if n == 0 && reused {
				// The server closed the idle connection as it was taken. The whole request
				// is in buf, so a new connection can carry it.
				continue
			}
			if trace != nil && trace.WroteRequest != nil {
				trace.WroteRequest(httptrace.WroteRequestInfo{Err: werr})
			}
			if n == 0 {
				return nil, &UnsentError{Err: fmt.Errorf("write request: %w", werr)}
			}
			return nil, fmt.Errorf("write request: %w", werr)
		}
		if trace != nil && trace.WroteRequest != nil {
			trace.WroteRequest(httptrace.WroteRequestInfo{})
		}
		if _, err := c.br.Peek(1); err != nil {
			stop()
			c.nc.Close()
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if reused && replayable(req) {
				// Most likely the keep-alive race: the server timed the idle connection
				// out as the request went. An idempotent request may go again.
				continue
			}
			return nil, fmt.Errorf("%w: %w", ErrClosedBeforeAnswer, err)
		}
		resp, err := c.readResponse(req, trace)
		if err != nil {
			stop()
			c.nc.Close()
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, err
		}
		resp.Request = req
		b := resp.Body.(*body)
		b.c, b.stop, b.ctx = c, stop, ctx
		if b.done {
			// No body at all: the connection is free now.
			b.finish()
		}
		return resp, nil
	}
}

// replayable reports whether req may be sent twice, as net/http's transport judges it: an
// idempotent method (RFC 9110 section 9.2.2), or a request that names itself idempotent with
// an Idempotency-Key.
func replayable(req *http.Request) bool {
	switch req.Method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	_, key := req.Header["Idempotency-Key"]
	_, xkey := req.Header["X-Idempotency-Key"]
	return key || xkey
}

// writeRequest encodes req, body included, into one pooled buffer, and closes its body.
func (t *Transport) writeRequest(req *http.Request) (*[]byte, error) {
	if req.Body != nil {
		defer req.Body.Close()
	}
	if req.URL == nil || req.URL.Host == "" || (req.URL.Scheme != "http" && req.URL.Scheme != "https") {
		return nil, fmt.Errorf("h1client: unsupported URL %v", req.URL)
	}
	bufp := getBuf()
	b := (*bufp)[:0]
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	b = append(b, method...)
	b = append(b, ' ')
	b = append(b, req.URL.RequestURI()...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	b = append(b, host...)
	b = append(b, "\r\n"...)
	for k, vs := range req.Header {
		switch k {
		case "Host", "Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive", "Te", "Upgrade", "Proxy-Connection", "Trailer":
			continue // set here, or hop-by-hop
		case "Authorization":
			if t.auth != "" {
				continue
			}
		}
		for _, v := range vs {
			if !validHeaderValue(v) || !validHeaderKey(k) {
				putBuf(bufp)
				return nil, fmt.Errorf("h1client: invalid header %q", k)
			}
			b = append(b, k...)
			b = append(b, ": "...)
			b = append(b, v...)
			b = append(b, "\r\n"...)
		}
	}
	if t.auth != "" {
		b = append(b, "Authorization: "...)
		b = append(b, t.auth...)
		b = append(b, "\r\n"...)
	}
	if _, ok := req.Header["User-Agent"]; !ok {
		b = append(b, "User-Agent: pdproxy\r\n"...)
	}
	if req.Body != nil && req.Body != http.NoBody {
		// The body follows the head in the same buffer, so that one write carries both.
		bodyp := getBuf()
		defer putBuf(bodyp)
		body := *bodyp
		if req.ContentLength > 0 {
			body = growTo(body, int(req.ContentLength))
		}
		for {
			if len(body) == cap(body) {
				body = growTo(body, 2*cap(body)+512)
			}
			n, err := req.Body.Read(body[len(body):cap(body)])
			body = body[:len(body)+n]
			if err == io.EOF {
				break
			}
			if err != nil {
				*bufp = b
				putBuf(bufp)
				return nil, fmt.Errorf("read request body: %w", err)
			}
		}
		*bodyp = body
		b = append(b, "Content-Length: "...)
		b = strconv.AppendInt(b, int64(len(body)), 10)
		b = append(b, "\r\n\r\n"...)
		b = append(b, body...)
	} else {
		if method != http.MethodGet && method != http.MethodHead {
			b = append(b, "Content-Length: 0\r\n"...)
		}
		b = append(b, "\r\n"...)
	}
	*bufp = b
	return bufp, nil
}

// growTo returns b with room for n bytes, its contents kept.
func growTo(b []byte, n int) []byte {
	if cap(b) >= n {
		return b
	}
	nb := make([]byte, len(b), n)
	copy(nb, b)
	return nb
}

// Request buffers: a request is written once and the buffer is free again; a buffer grown
// past maxPooledBuf for a long prompt is let go.
var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}

const maxPooledBuf = 64 << 10

func getBuf() *[]byte { return bufPool.Get().(*[]byte) }

func putBuf(b *[]byte) {
	if cap(*b) <= maxPooledBuf {
		*b = (*b)[:0]
		bufPool.Put(b)
	}
}

func validHeaderKey(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		if !isTokenByte(k[i]) {
			return false
		}
	}
	return true
}

func validHeaderValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c == '\r' || c == '\n' || c == 0 {
			return false
		}
	}
	return true
}

// canonicalAddr is the URL's host:port, with the scheme's port when it names none.
func canonicalAddr(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = "80"
		if u.Scheme == "https" {
			port = "443"
		}
	}
	return net.JoinHostPort(u.Hostname(), port)
}

// conn is one pooled connection to a backend.
type conn struct {
	nc        net.Conn
	br        *bufio.Reader
	key       string
	p         *pools
	idleTimer *time.Timer
}

// readerSize is a connection's read buffer: an SSE event is a few hundred bytes, and a stream
// keeps its buffer for as long as it lasts.
const readerSize = 4 << 10
