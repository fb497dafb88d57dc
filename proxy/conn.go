package proxy

import (
	"net"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Listener wraps the proxy's listener: it holds at most max_connections client connections,
// and closes any more as soon as it accepts them, with a reset, so that a flood of
// connections that never finish a request cannot take every file descriptor of the process.
// Every connection it hands out leaves the count when closed. It bounds what each client
// socket keeps unsent (boundUnsent).
func (s *Server) Listener(ln net.Listener) net.Listener {
	return &clientListener{Listener: ln, s: s, max: int64(s.cfg.MaxConnections)}
}

type clientListener struct {
	net.Listener
	s *Server
	// max is the bound on open connections; zero or negative means none.
	max  int64
	open atomic.Int64
	// warned is when the last refusal was logged as a warning (UnixNano), so that a flood
	// writes a line every refusalLogEvery rather than one per connection.
	warned atomic.Int64
}

// clientUnsentLimit is how many bytes written to a client may wait in the kernel unsent
// (boundUnsent): a few SSE events. What the client's own kernel took and its application
// has not read is beyond any server's sight.
const clientUnsentLimit = 16 << 10

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
		l.s.m.connsOpen.Inc()
		boundUnsent(c)
		return &clientConn{Conn: c, l: l}, nil
	}
}

// refuse closes a connection beyond the bound at once. A reset (no linger) rather than a
// FIN: the client learns at once, and the proxy keeps no TIME_WAIT for it.
func (l *clientListener) refuse(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
	l.s.m.connsRefused.Inc()
	now := time.Now().UnixNano()
	if last := l.warned.Load(); now-last >= int64(refusalLogEvery) && l.warned.CompareAndSwap(last, now) {
		l.s.logger.Warn("max_connections reached: refusing new connections (pdproxy_connections_refused_total counts them)",
			zap.Int64("max_connections", l.max))
	}
}

// clientConn is one accepted client connection.
type clientConn struct {
	net.Conn
	l         *clientListener
	closeOnce sync.Once
}

func (c *clientConn) Close() error {
	err := c.Conn.Close()
	c.closeOnce.Do(func() {
		c.l.open.Add(-1)
		c.l.s.m.connsOpen.Dec()
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
