package app

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine a Main started outlives its test.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
