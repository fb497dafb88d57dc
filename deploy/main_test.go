package deploy

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package if a test leaves a goroutine behind: the tests start pdproxy
// with its simulated engines and with each manifest's config.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
