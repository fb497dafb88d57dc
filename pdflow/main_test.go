package pdflow

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine a test started (a relay, a watchdog, a
// background KV release) outlives it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
