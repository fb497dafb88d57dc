//go:build !linux

package proxy

import "net"

// boundUnsent does nothing where TCP_NOTSENT_LOWAT is not known: a client that stops reading
// is then given up on once the kernel's buffers toward it are full.
func boundUnsent(net.Conn) {}
