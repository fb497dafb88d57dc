package router

import (
	"errors"
	"net"
	"syscall"
)

// refusal is a connect error that proves nothing listens at a backend's address.
type refusal struct {
	// label is the reason label of pdproxy_backend_down_total; text is for down_reason.
	label, text string
}

// refusals are the dial errors that are proof: the peer's kernel (or a router on the way)
// answered that nothing is there. A dial timeout, a DNS failure or the proxy's own limits
// (EMFILE, EADDRNOTAVAIL) prove nothing about the backend, and stay with passive ejection.
var refusals = []struct {
	errno syscall.Errno
	refusal
}{
	{syscall.ECONNREFUSED, refusal{"connection_refused", "connection refused"}},
	{syscall.EHOSTUNREACH, refusal{"host_unreachable", "no route to host"}},
	{syscall.ENETUNREACH, refusal{"network_unreachable", "network unreachable"}},
}

// refusalOf tells whether err, from a call or a check, is a refused dial.
func refusalOf(err error) (refusal, bool) {
	var op *net.OpError
	if err == nil || !errors.As(err, &op) || op.Op != "dial" {
		return refusal{}, false
	}
	for _, r := range refusals {
		if errors.Is(err, r.errno) {
			return r.refusal, true
		}
	}
	return refusal{}, false
}
