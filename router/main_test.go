package router

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// zmq4's PUB socket never stops its writer goroutine on Close (pubSocket.Close closes
		// the socket, not its pubMWriter). Only the tests' stand-in engines publish; the
		// router's own sockets are SUB and DEALER, which stop.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		// Nor does any socket's reader of a connection stop when a message arrives as the
		// socket closes: qreader.listen then waits for ever to hand it to a Recv that no
		// longer comes (zmq4 v0.17.0 sends on its channel without watching its context).
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*qreader).listen"))
}
