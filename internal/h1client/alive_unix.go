//go:build unix

package h1client

import (
	"crypto/tls"
	"net"
	"syscall"
)

// alive tells whether an idle connection is still open, with a non-blocking peek: an idle
// connection that is readable was closed by the server (EOF) or sent something unasked, and
// either way cannot carry a request. net/http's transport learns this from the read loop it
// keeps on every idle connection; this costs one system call at reuse instead.
func alive(nc net.Conn) bool {
	if tc, ok := nc.(*tls.Conn); ok {
		nc = tc.NetConn()
	}
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	ok = false
	err = rc.Read(func(fd uintptr) bool {
		var b [1]byte
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		_ = n
		ok = err == syscall.EAGAIN || err == syscall.EWOULDBLOCK
		return true
	})
	return err == nil && ok
}
