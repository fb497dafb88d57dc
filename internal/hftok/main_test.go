package hftok

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// regexp2's match timeouts run on one clock goroutine of its own, which stops by
		// itself a second after the last match that needed it.
		goleak.IgnoreAnyFunction("github.com/dlclark/regexp2.runClock"))
}
