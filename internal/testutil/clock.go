package testutil

import (
	"sync"
	"time"
)

// Clock is a fake clock: it moves only when Advance says so, and its timers fire then. It is
// safe for concurrent use; the zero value is not usable, call NewClock.
type Clock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*Timer // pending, in the order they were made
}

// NewClock returns a clock that reads start until it is advanced.
func NewClock(start time.Time) *Clock { return &Clock{now: start} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock by d and fires the timers that fall due, each once.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	kept := c.timers[:0]
	for _, t := range c.timers {
		if t.at.After(c.now) {
			kept = append(kept, t)
			continue
		}
		t.c <- c.now // never blocks: a timer fires once into its own buffered channel
	}
	clear(c.timers[len(kept):])
	c.timers = kept
}

// NewTimer returns a timer that fires once the clock has advanced d past now; with d <= 0 it
// has fired already.
func (c *Clock) NewTimer(d time.Duration) *Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &Timer{c: make(chan time.Time, 1), at: c.now.Add(d), clock: c}
	if d <= 0 {
		t.c <- c.now
		return t
	}
	c.timers = append(c.timers, t)
	return t
}

// Timer is a one-shot timer of a Clock, shaped like the part of *time.Timer code under test
// uses (a method C, so that an interface can hold it).
type Timer struct {
	c     chan time.Time
	at    time.Time
	clock *Clock
}

// C delivers the clock's time when the timer fires.
func (t *Timer) C() <-chan time.Time { return t.c }

// Stop prevents the timer from firing and reports whether it stopped it (false: it had
// fired or been stopped already).
func (t *Timer) Stop() bool {
	c := t.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, x := range c.timers {
		if x == t {
			c.timers = append(c.timers[:i], c.timers[i+1:]...)
			return true
		}
	}
	return false
}
