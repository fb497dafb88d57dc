package bench

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain runs the binary as a harness's proxy process when asked to (see startProxy), and
// otherwise fails the package if a test leaves a goroutine behind (a load generator's
// worker, a connection of a transport, a stream of the scale scenario).
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	goleak.VerifyTestMain(m)
}
