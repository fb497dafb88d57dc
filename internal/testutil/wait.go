package testutil

import (
	"fmt"
	"testing"
	"time"
)

// Timeout is the bound for a wait that should end at once on a working build: long enough
// that only a hang or a lost event reaches it on a loaded machine.
const Timeout = 10 * time.Second

// Eventually polls cond until it holds, and fails the test if timeout passes first; the
// message (format and args, as for fmt.Sprintf) names what the test was waiting for.
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	if _, ok := poll(timeout, func() (bool, string) { return cond(), "" }); !ok {
		t.Fatalf("timed out after %s waiting for %s", timeout, fmt.Sprintf(format, args...))
	}
}

// WaitFor polls cond until it holds, and fails the test with the last reason cond gave if
// timeout passes first: cond says what it saw, so the failure shows the state that never
// came right.
func WaitFor(t testing.TB, timeout time.Duration, cond func() (ok bool, why string)) {
	t.Helper()
	if why, ok := poll(timeout, cond); !ok {
		t.Fatalf("not within %s: %s", timeout, why)
	}
}

// poll calls cond until it holds (ok), or until timeout has passed: then it returns cond's
// last reason.
func poll(timeout time.Duration, cond func() (bool, string)) (why string, ok bool) {
	deadline := time.Now().Add(timeout)
	// Short sleeps at first, since most waits end quickly; then a few milliseconds, so that
	// a poll that scrapes over HTTP does not load a busy machine.
	pause := 500 * time.Microsecond
	for {
		if ok, why = cond(); ok {
			return "", true
		}
		if time.Now().After(deadline) {
			return why, false
		}
		time.Sleep(pause)
		pause = min(2*pause, 5*time.Millisecond)
	}
}

// Recv receives from ch, and fails the test with the message if nothing comes within
// timeout. A closed channel gives its zero value at once, so Recv also waits for a close.
func Recv[T any](t testing.TB, timeout time.Duration, ch <-chan T, format string, args ...any) T {
	t.Helper()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatalf("timed out after %s waiting for %s", timeout, fmt.Sprintf(format, args...))
	}
	var zero T
	return zero
}
