package engine

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a call's goroutines (a transport's connection
// readers) outlive the test that made them.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
