//go:build !linux

package proxy

import (
	"net"
	"time"
)

// boundUnsent does nothing where TCP_NOTSENT_LOWAT is not known: a client that stops reading
// is then given up on once the kernel's buffers toward it are full.
func boundUnsent(net.Conn) {}

// awaitPeer cannot read the socket's state here: a client that half-closed its connection is
// taken for one that left, as net/http takes it.
func awaitPeer(net.Conn, <-chan struct{}, time.Duration) bool { return false }
