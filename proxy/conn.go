package proxy

import (
	"bytes"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Listener wraps the proxy's listener. It holds at most max_connections client connections,
// and closes any more as soon as it accepts them, with a reset, so that a flood of
// connections that never finish a request cannot take every file descriptor of the process.
// It bounds what each client socket keeps unsent (boundUnsent). And on plain HTTP/1.1 it
// tells a client that half-closed its connection after its request from one that left
// (clientConn.Read). tlsOn says that the server will put TLS on the connections: they are
// then only counted and bounded.
func (s *Server) Listener(ln net.Listener, tlsOn bool) net.Listener {
	return &clientListener{Listener: ln, s: s, max: int64(s.cfg.MaxConnections), tls: tlsOn}
}

type clientListener struct {
	net.Listener
	s *Server
	// max is the bound on open connections; zero or negative means none.
	max  int64
	tls  bool
	open atomic.Int64
	// warned is when the last refusal was logged as a warning (UnixNano), so that a flood
	// writes a line every refusalLogEvery rather than one per connection.
	warned atomic.Int64
}

// refusalLogEvery spaces the warnings about refused connections.
const refusalLogEvery = 10 * time.Second

func (l *clientListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.max > 0 && l.open.Load() >= l.max {
			l.refuse(c)
			continue
		}
		l.open.Add(1)
		l.s.m.ConnsOpen.Inc()
		boundUnsent(c)
		cc := &clientConn{Conn: c, l: l, closed: make(chan struct{}), wake: make(chan struct{}, 1)}
		cc.watch.Store(!l.tls)
		return cc, nil
	}
}

// refuse closes a connection beyond the bound at once. A reset (no linger) rather than a
// FIN: the client learns at once, and the proxy keeps no TIME_WAIT for it.
func (l *clientListener) refuse(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
	l.s.m.ConnsRefused.Inc()
	now := time.Now().UnixNano()
	if last := l.warned.Load(); now-last >= int64(refusalLogEvery) && l.warned.CompareAndSwap(last, now) {
		l.s.logger.Warn("max_connections reached: refusing new connections (pdproxy_connections_refused_total counts them)",
			zap.Int64("max_connections", l.max))
	}
}

// clientConn is one accepted client connection.
//
// A client may half-close its connection once it has sent its request: RFC 9112 section 9.6
// lets it, and only a close of both halves means it left. net/http cannot tell the two: its
// HTTP/1.1 server reads the connection in the background while a handler runs, and takes the
// end of input for the client's leaving (it cancels the request's context). Nor can anyone by
// reading: the same FIN arrives either way. Writing tells: a client that closed both halves
// answers with a reset, one that half-closed acknowledges. So when that background read (the
// only read net/http makes one byte at a time) meets the end of input before a byte of the
// answer went out, clientConn writes an interim "100 Continue" (which every client must
// accept, RFC 9110 section 15.2) and waits for the client's kernel to answer it (awaitPeer).
// Acknowledged, the end of input is kept from net/http and the request is served; a reset, or
// silence, passes it on. An answer already under way passes it on too, as does HTTP/2 (its
// streams have END_STREAM for this), TLS (the probe would have to be encrypted) and HTTP/1.0
// (which knows no interim answers).
type clientConn struct {
	net.Conn
	l         *clientListener
	closeOnce sync.Once
	closed    chan struct{}

	// watch: half-closes are told apart on this connection (plain HTTP/1.1).
	watch atomic.Bool
	// preface collects the connection's first bytes, to recognise HTTP/2's.
	preface []byte
	// halfClosed: the client half-closed its connection and acknowledged the probe; reads
	// end as they would at the end of input, but net/http's background read waits instead.
	halfClosed atomic.Bool

	// wmu serialises writes with the probe, so that it never lands inside an answer.
	wmu sync.Mutex
	// answered: a byte went out since the request in flight began. Guarded by wmu.
	answered bool
	// begun: a request was read. inLine: its request line is being read, lineEnd holds the
	// line's last bytes so far. http11: the line said HTTP/1.1; an HTTP/1.0 client must not
	// get a 1xx answer (RFC 9110 section 15.2). Guarded by wmu.
	begun, inLine, http11 bool
	lineEnd               []byte

	// mu guards the deadlines, which a read held back for a half-closed client must honour.
	mu            sync.Mutex
	readDeadline  time.Time
	writeDeadline time.Time
	// wake tells a held-back read that its deadline changed.
	wake chan struct{}
}

// http2Preface is how an HTTP/2 connection without TLS (prior knowledge) begins.
var http2Preface = []byte("PRI * HTTP/2.0")

func (c *clientConn) Read(p []byte) (int, error) {
	if c.halfClosed.Load() {
		return c.readHalfClosed(len(p))
	}
	n, err := c.Conn.Read(p)
	if !c.watch.Load() {
		return n, err
	}
	if n > 0 {
		if len(c.preface) < len(http2Preface) {
			c.preface = append(c.preface, p[:min(n, len(http2Preface)-len(c.preface))]...)
			if bytes.Equal(c.preface, http2Preface) {
				c.watch.Store(false)
				return n, err
			}
		}
		if len(p) > 1 {
			// A read of a request (the background read takes one byte).
			c.wmu.Lock()
			if c.answered || !c.begun {
				// After an answer, or first: the bytes of a new request.
				c.begun, c.inLine, c.http11, c.lineEnd = true, true, false, c.lineEnd[:0]
			}
			if c.inLine {
				c.readLine(p[:n])
			}
			c.answered = false
			c.wmu.Unlock()
		}
	}
	if err == io.EOF && n == 0 && len(p) == 1 && c.peerStillThere() {
		c.halfClosed.Store(true)
		return c.readHalfClosed(1)
	}
	return n, err
}

// readLine follows the request line through the bytes b read of it, which net/http may take
// in several reads (its first is the length of HTTP/2's preface), to learn its version.
func (c *clientConn) readLine(b []byte) {
	const keep = len(" HTTP/1.1\r")
	line, _, ended := bytes.Cut(b, []byte("\n"))
	c.lineEnd = append(c.lineEnd, line[max(0, len(line)-keep):]...)
	c.lineEnd = c.lineEnd[max(0, len(c.lineEnd)-keep):]
	if ended {
		c.inLine = false
		c.http11 = bytes.HasSuffix(bytes.TrimSuffix(c.lineEnd, []byte("\r")), []byte(" HTTP/1.1"))
	}
}

// peerStillThere probes a client whose input ended while its request is served, before any
// byte of its answer: it reports whether the client only half-closed its connection.
func (c *clientConn) peerStillThere() bool {
	c.wmu.Lock()
	if c.answered || !c.http11 {
		c.wmu.Unlock()
		return false
	}
	c.mu.Lock()
	d := time.Now().Add(halfCloseProbeTimeout)
	if !c.writeDeadline.IsZero() && c.writeDeadline.Before(d) {
		d = c.writeDeadline
	}
	c.Conn.SetWriteDeadline(d)
	c.mu.Unlock()
	_, err := c.Conn.Write(continueProbe)
	c.mu.Lock()
	c.Conn.SetWriteDeadline(c.writeDeadline)
	c.mu.Unlock()
	c.wmu.Unlock()
	if err != nil {
		return false
	}
	return awaitPeer(c.Conn, c.closed, halfCloseProbeTimeout)
}

// continueProbe is the interim answer written to a client whose input ended.
var continueProbe = []byte("HTTP/1.1 100 Continue\r\n\r\n")

// halfCloseProbeTimeout bounds the wait for the client's kernel to answer the probe, a round
// trip or two: a client that neither acknowledges nor resets in this time is taken as gone.
const halfCloseProbeTimeout = 3 * time.Second

// readHalfClosed is a read on a connection whose client half-closed it and is still there:
// the end of input, except for net/http's background read, which waits for its deadline
// (net/http sets one in the past to end it when the answer is done) or the connection's close.
func (c *clientConn) readHalfClosed(n int) (int, error) {
	if n != 1 {
		return 0, io.EOF
	}
	for {
		c.mu.Lock()
		d := c.readDeadline
		c.mu.Unlock()
		var t *time.Timer
		var expired <-chan time.Time
		if !d.IsZero() {
			left := time.Until(d)
			if left <= 0 {
				return 0, &net.OpError{Op: "read", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: os.ErrDeadlineExceeded}
			}
			t = time.NewTimer(left)
			expired = t.C
		}
		select {
		case <-c.wake:
		case <-expired:
		case <-c.closed:
		}
		if t != nil {
			t.Stop()
		}
		select {
		case <-c.closed:
			return 0, &net.OpError{Op: "read", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: net.ErrClosed}
		default:
		}
	}
}

func (c *clientConn) Write(p []byte) (int, error) {
	if !c.watch.Load() {
		return c.Conn.Write(p)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.answered = true
	return c.Conn.Write(p)
}

func (c *clientConn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	c.readDeadline, c.writeDeadline = t, t
	c.mu.Unlock()
	c.wakeReader()
	return c.Conn.SetDeadline(t)
}

func (c *clientConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	c.readDeadline = t
	c.mu.Unlock()
	c.wakeReader()
	return c.Conn.SetReadDeadline(t)
}

func (c *clientConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	c.writeDeadline = t
	c.mu.Unlock()
	return c.Conn.SetWriteDeadline(t)
}

func (c *clientConn) wakeReader() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

func (c *clientConn) Close() error {
	err := c.Conn.Close()
	c.closeOnce.Do(func() {
		close(c.closed)
		c.l.open.Add(-1)
		c.l.s.m.ConnsOpen.Dec()
	})
	return err
}

// CloseWrite half-closes the connection, as net/http does before it closes one whose
// client may still be sending (so that the client reads the answer rather than a reset).
func (c *clientConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
