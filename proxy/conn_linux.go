package proxy

import (
	"net"
	"time"

	"golang.org/x/sys/unix"
)

// clientUnsentLimit is how many bytes written to a client may wait in the kernel unsent
// (boundUnsent): a few SSE events. What the client's own kernel took and its application
// has not read is beyond any server's sight.
const clientUnsentLimit = 16 << 10

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

// awaitPeer waits for a client's kernel to answer what was just written to it: an
// acknowledgement of everything sent (the client only half-closed its connection, true) or
// a reset (it closed both halves: false). Neither within timeout (halfCloseProbeTimeout), or
// the connection closing meanwhile, is false. It polls the socket's state: a round trip, on
// loopback microseconds, rarely more than a few milliseconds elsewhere.
func awaitPeer(c net.Conn, closed <-chan struct{}, timeout time.Duration) bool {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return false
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return false
	}
	deadline := time.Now().Add(timeout)
	pause := 50 * time.Microsecond
	for {
		var info *unix.TCPInfo
		var ierr error
		if err := raw.Control(func(fd uintptr) {
			info, ierr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
		}); err != nil || ierr != nil {
			return false
		}
		switch {
		case info.State == unix.BPF_TCP_CLOSE:
			return false
		case info.Unacked == 0 && info.Notsent_bytes == 0:
			return true
		case time.Now().After(deadline):
			return false
		}
		t := time.NewTimer(pause)
		select {
		case <-closed:
			t.Stop()
			return false
		case <-t.C:
		}
		pause = min(2*pause, 10*time.Millisecond)
	}
}
