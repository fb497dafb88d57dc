package proxy

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine a test started (a handler, a relay, a
// background KV release, a connection of a backend's transport) outlives it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
