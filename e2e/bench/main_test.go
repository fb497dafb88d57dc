package bench

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain runs the binary as a harness's proxy process when asked to (see startProxy), and
// otherwise fails the package if a test leaves a goroutine behind (a load generator's
// worker, a connection of a transport, a stream of the scale scenario). zmq4 v0.17.0's PUB
// socket starts a writer goroutine that its Close never stops: one parked goroutine per
// simulated engine that published KV events (as in engine/sim's and router's TestMain).
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		// Nor does any socket's reader of a connection stop when a message arrives as the
		// socket closes: qreader.listen then waits for ever to hand it to a Recv that no
		// longer comes (zmq4 v0.17.0 sends on its channel without watching its context).
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*qreader).listen"))
}
