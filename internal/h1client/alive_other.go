//go:build !unix

package h1client

import "net"

// alive cannot peek here without blocking: a closed idle connection shows as the request's
// error.
func alive(net.Conn) bool { return true }
