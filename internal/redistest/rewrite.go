package redistest

import (
	"bytes"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// Rewriter stands between clients and a real server on a loopback port of its own, passing
// everything through except that it replaces one byte string in the server's replies by
// another: a server (or whatever answers in its place) whose answers have the length a client
// expects and the wrong types inside. It also counts the commands it passed by name.
//
// A reply is rewritten within one read from the server; the small replies a test rewrites
// arrive in one read on loopback.
type Rewriter struct {
	ln       net.Listener
	upstream string
	from, to []byte
	calls    []byte // a command's name as clients send it, in lowercase
	sent     atomic.Int64
	rewrites atomic.Int64

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// Rewrite starts a Rewriter in front of s that replaces from by to in s's replies, and
// counts the client commands named command (case-insensitive). It stops when the test ends.
func (s *Server) Rewrite(t testing.TB, from, to, command string) *Rewriter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("redistest: rewriter: %v", err)
	}
	rw := &Rewriter{ln: ln, upstream: s.Addr(), from: []byte(from), to: []byte(to),
		calls: bytes.ToLower([]byte(command)), conns: map[net.Conn]struct{}{}}
	rw.wg.Add(1)
	go rw.accept()
	t.Cleanup(rw.close)
	return rw
}

// Addr is where clients reach the server through the rewriter.
func (rw *Rewriter) Addr() string { return rw.ln.Addr().String() }

// Commands is how many commands of the counted name clients have sent.
func (rw *Rewriter) Commands() int { return int(rw.sent.Load()) }

// Rewrites is how many replies were rewritten.
func (rw *Rewriter) Rewrites() int { return int(rw.rewrites.Load()) }

func (rw *Rewriter) accept() {
	defer rw.wg.Done()
	for {
		c, err := rw.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", rw.upstream)
		if err != nil {
			c.Close()
			continue
		}
		if !rw.track(c, u) {
			return
		}
		rw.wg.Add(2)
		go rw.pipe(u, c, rw.countCommands)
		go rw.pipe(c, u, rw.rewrite)
	}
}

// track keeps c and u for close; false when the rewriter is closing (both are closed then).
func (rw *Rewriter) track(c, u net.Conn) bool {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	if rw.conns == nil {
		c.Close()
		u.Close()
		return false
	}
	rw.conns[c], rw.conns[u] = struct{}{}, struct{}{}
	return true
}

// pipe copies src to dst through edit until either side ends, then closes both.
func (rw *Rewriter) pipe(dst, src net.Conn, edit func([]byte) []byte) {
	defer rw.wg.Done()
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(edit(buf[:n])); werr != nil {
				return
			}
		}
		if err != nil {
			return // EOF or a reset: the other direction ends with the close
		}
	}
}

// countCommands counts the commands of the counted name in a client's bytes; a bulk string
// equal to the name is a command's name in RESP.
func (rw *Rewriter) countCommands(b []byte) []byte {
	needle := append(append([]byte("\r\n"), rw.calls...), '\r', '\n')
	rw.sent.Add(int64(bytes.Count(bytes.ToLower(b), needle)))
	return b
}

func (rw *Rewriter) rewrite(b []byte) []byte {
	if len(rw.from) == 0 {
		return b
	}
	n := bytes.Count(b, rw.from)
	if n == 0 {
		return b
	}
	rw.rewrites.Add(int64(n))
	return bytes.ReplaceAll(b, rw.from, rw.to)
}

func (rw *Rewriter) close() {
	rw.ln.Close()
	rw.mu.Lock()
	for c := range rw.conns {
		c.Close()
	}
	rw.conns = nil
	rw.mu.Unlock()
	rw.wg.Wait()
}
