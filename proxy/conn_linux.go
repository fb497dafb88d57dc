package proxy

import (
	"net"

	"golang.org/x/sys/unix"
)

// boundUnsent caps the bytes written to a client socket that the kernel has not sent yet
// (TCP_NOTSENT_LOWAT): a write past it blocks, and so falls under client_write_timeout. Left
// to itself the kernel grows a socket's send buffer to megabytes (tcp_wmem), which a client
// that stopped reading lets fill at the stream's pace: minutes of a decode nobody reads
// before one write blocks. Bytes sent and not yet acknowledged are not capped, so a client
// that reads is not slowed down.
func boundUnsent(c net.Conn) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return
	}
	raw.Control(func(fd uintptr) {
		// An error leaves the kernel's default: the bound is a refinement, not a condition.
		_ = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT, clientUnsentLimit)
	})
}
