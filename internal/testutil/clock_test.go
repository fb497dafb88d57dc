package testutil

import (
	"sync"
	"testing"
	"time"
)

var start = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestClockMovesOnlyWhenAdvanced(t *testing.T) {
	c := NewClock(start)
	if got := c.Now(); !got.Equal(start) {
		t.Fatalf("Now = %v, want the start %v", got, start)
	}
	c.Advance(1500 * time.Millisecond)
	c.Advance(500 * time.Millisecond)
	if got, want := c.Now(), start.Add(2*time.Second); !got.Equal(want) {
		t.Errorf("Now after 2s of advances = %v, want %v", got, want)
	}
}

func fired(tm *Timer) bool {
	select {
	case <-tm.C():
		return true
	default:
		return false
	}
}

func TestTimerFiresWhenTheClockReachesIt(t *testing.T) {
	c := NewClock(start)
	tm := c.NewTimer(time.Second)
	c.Advance(time.Second - time.Nanosecond)
	if fired(tm) {
		t.Fatal("fired before it was due")
	}
	c.Advance(time.Nanosecond)
	select {
	case at := <-tm.C():
		if want := start.Add(time.Second); !at.Equal(want) {
			t.Errorf("fired with %v, want %v", at, want)
		}
	default:
		t.Fatal("not fired when due")
	}
	c.Advance(time.Hour)
	if fired(tm) {
		t.Error("fired twice")
	}
	if tm.Stop() {
		t.Error("Stop of a fired timer reported true")
	}
}

func TestTimerOfNoDurationHasFiredAlready(t *testing.T) {
	for _, d := range []time.Duration{0, -time.Second} {
		if tm := NewClock(start).NewTimer(d); !fired(tm) {
			t.Errorf("NewTimer(%v) not fired", d)
		}
	}
}

func TestStoppedTimerNeverFires(t *testing.T) {
	c := NewClock(start)
	stopped, other := c.NewTimer(time.Second), c.NewTimer(time.Second)
	if !stopped.Stop() {
		t.Fatal("Stop of a pending timer reported false")
	}
	if stopped.Stop() {
		t.Error("second Stop reported true")
	}
	c.Advance(time.Minute)
	if fired(stopped) {
		t.Error("a stopped timer fired")
	}
	if !fired(other) {
		t.Error("stopping one timer kept another from firing")
	}
}

func TestClockIsSafeForConcurrentUse(t *testing.T) {
	c := NewClock(start)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				c.Advance(time.Millisecond)
				c.NewTimer(time.Millisecond).Stop()
				_ = c.Now()
			}
		}()
	}
	wg.Wait()
	if got, want := c.Now(), start.Add(400*time.Millisecond); !got.Equal(want) {
		t.Errorf("Now = %v, want %v", got, want)
	}
}
