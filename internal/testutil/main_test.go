package testutil

import (
	"fmt"
	"runtime"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package if a test leaves a goroutine behind (Scrape's tests run an
// HTTP server).
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is a testing.TB whose failures are recorded instead of reported, so that a test
// can assert that a helper fails the test it is given. Like testing.T, Fatal stops the
// goroutine that calls it.
type recorder struct {
	testing.TB // nil: calling anything not overridden below panics
	failed     bool
	msg        string
}

func (r *recorder) Helper() {}

func (r *recorder) Fatalf(format string, args ...any) {
	r.failed, r.msg = true, fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// run calls f with a recorder on a goroutine of its own (Fatalf ends it) and returns the
// recorder once f is done.
func run(f func(tb testing.TB)) *recorder {
	r := &recorder{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
	return r
}
