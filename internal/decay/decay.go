// Package decay holds a count that fades: each addition halves every HalfLife, so that the
// count says what happened lately.
package decay

import (
	"math"
	"sync"
	"time"
)

// HalfLife is how fast a Count halves: long enough to remember where the conversations and
// prompt groups of the last minutes went, short enough that an engine restarted or added takes
// new ones at once.
const HalfLife = time.Minute

// Count is a count that halves every HalfLife. Its zero value is 0; it is safe for concurrent
// use.
type Count struct {
	mu sync.Mutex
	v  float64
	at time.Time
}

// Value is the count at now.
func (c *Count) Value(now time.Time) float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.valueLocked(now)
}

func (c *Count) valueLocked(now time.Time) float64 {
	if c.v == 0 || !now.After(c.at) {
		return c.v
	}
	return c.v * math.Exp2(-float64(now.Sub(c.at))/float64(HalfLife))
}

// Add counts n more at now. An addition at a time before the latest counts as of the latest.
func (c *Count) Add(now time.Time, n float64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.v = c.valueLocked(now) + n
	if now.After(c.at) {
		c.at = now
	}
}
