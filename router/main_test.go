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
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
