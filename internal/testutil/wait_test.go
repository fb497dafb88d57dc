package testutil

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestEventuallyReturnsOnceTheConditionHolds(t *testing.T) {
	calls := 0
	Eventually(t, Timeout, func() bool { calls++; return calls == 3 }, "the third call")
	if calls != 3 {
		t.Errorf("cond called %d times, want 3 (polling stops once it holds)", calls)
	}
}

func TestEventuallyFailsNamingWhatItWaitedFor(t *testing.T) {
	r := run(func(tb testing.TB) {
		Eventually(tb, 5*time.Millisecond, func() bool { return false }, "the %s", "sky to fall")
	})
	if !r.failed || !strings.Contains(r.msg, "waiting for the sky to fall") {
		t.Errorf("failed %v with %q; want a failure naming what was awaited", r.failed, r.msg)
	}
}

func TestWaitForFailsWithTheLastReasonGiven(t *testing.T) {
	calls := 0
	r := run(func(tb testing.TB) {
		WaitFor(tb, 5*time.Millisecond, func() (bool, string) { calls++; return false, fmt.Sprintf("call %d", calls) })
	})
	if !r.failed || !strings.HasSuffix(r.msg, fmt.Sprintf(": call %d", calls)) {
		t.Errorf("failed %v with %q after %d calls; want the last call's reason", r.failed, r.msg, calls)
	}
}

func TestWaitForReturnsOnceTheConditionHolds(t *testing.T) {
	calls := 0
	WaitFor(t, Timeout, func() (bool, string) { calls++; return calls == 2, "first call" })
	if calls != 2 {
		t.Errorf("cond called %d times, want 2", calls)
	}
}

func TestRecv(t *testing.T) {
	t.Run("returns what is sent", func(t *testing.T) {
		ch := make(chan int, 1)
		ch <- 42
		if got := Recv(t, Timeout, ch, "a value"); got != 42 {
			t.Errorf("Recv = %d, want 42", got)
		}
	})
	t.Run("returns at a close", func(t *testing.T) {
		ch := make(chan struct{})
		close(ch)
		Recv(t, Timeout, ch, "the close")
	})
	t.Run("fails naming what it waited for when nothing comes", func(t *testing.T) {
		r := run(func(tb testing.TB) { Recv(tb, 5*time.Millisecond, make(chan int), "the %s", "answer") })
		if !r.failed || !strings.Contains(r.msg, "waiting for the answer") {
			t.Errorf("failed %v with %q; want a failure naming what was awaited", r.failed, r.msg)
		}
	})
}
