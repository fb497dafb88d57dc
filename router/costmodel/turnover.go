package costmodel

import (
	"sync"
	"sync/atomic"
	"time"
)

const (
	// turnoverSpacing is how many samples span one pool's worth of stored tokens: the
	// horizon is known to within capacity/turnoverSpacing tokens.
	turnoverSpacing = 64
	// maxTurnoverSamples bounds the samples kept, whatever the counts say.
	maxTurnoverSamples = 4 * turnoverSpacing
)

// Turnover tells, from an engine's count of the prompt tokens it stored in its KV pool (those
// it was sent and did not find there), from when text sent to it may still be cached there.
// A prefix cache evicts the least recently used of its free blocks (those no running request
// holds) to store new tokens: once the pool has stored as many tokens as it had free after a
// text, the text is gone, unless it was sent again since. The count is the engine's, so every
// replica that reads it draws the same horizon, whoever sent the tokens. The zero Turnover
// knows nothing; it is safe for concurrent use, and Horizon takes no lock.
type Turnover struct {
	// horizon is Horizon's answer in Unix nanoseconds, 0 for none; period is Period's.
	horizon, period atomic.Int64

	mu sync.Mutex
	// samples are counts at scrapes, oldest first, each at least capacity/turnoverSpacing
	// tokens past the one before; latest is the newest count, kept or not.
	samples  []turnoverSample
	latest   turnoverSample
	capacity float64
	// restarted is the scrape that found the engine restarted (its count lower than the last,
	// or its pool resized): its pool was empty then, so nothing sent before is cached.
	restarted time.Time
}

type turnoverSample struct {
	at     time.Time
	stored float64
}

// Observe records a scrape at at: the engine had stored stored tokens since it started, in a
// pool of capacity tokens of which free were free (cached or empty, held by no request; at
// least capacity/turnoverSpacing is counted). A capacity of 0 (not reported) forgets
// everything; a count lower than the last or another capacity is a restart: counting starts
// again, and the horizon is at least this scrape.
func (t *Turnover) Observe(at time.Time, stored, capacity, free float64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if capacity <= 0 || stored < t.latest.stored || capacity != t.capacity {
		t.restarted = time.Time{}
		if capacity > 0 && t.capacity > 0 {
			t.restarted = at
		}
		t.samples, t.latest, t.capacity = t.samples[:0], turnoverSample{}, capacity
		t.horizon.Store(0)
		t.period.Store(0)
		if capacity <= 0 {
			return
		}
	}
	t.latest = turnoverSample{at, stored}
	if n := len(t.samples); n == 0 || stored-t.samples[n-1].stored >= capacity/turnoverSpacing {
		t.samples = append(t.samples, t.latest)
	}
	// Only the newest sample a whole pool behind is needed: the free part is at most the pool.
	drop := 0
	for drop+1 < len(t.samples) && stored-t.samples[drop+1].stored >= capacity {
		drop++
	}
	drop = max(drop, len(t.samples)-maxTurnoverSamples)
	t.samples = append(t.samples[:0], t.samples[drop:]...)
	free = min(max(free, capacity/turnoverSpacing), capacity)
	t.horizon.Store(0)
	if !t.restarted.IsZero() {
		t.horizon.Store(t.restarted.UnixNano())
	}
	t.period.Store(0)
	for i := len(t.samples) - 1; i >= 0; i-- {
		if s := t.samples[i]; stored-s.stored >= free {
			t.horizon.Store(s.at.UnixNano())
			t.period.Store(int64(at.Sub(s.at)))
			break
		}
	}
}

// Period is how long the engine took to store what it had free, to the latest scrape; 0 when
// not known.
func (t *Turnover) Period() time.Duration { return time.Duration(t.period.Load()) }

// Horizon is the newest scrape since which the engine has stored as many tokens as it has
// free, or that found it restarted: text sent to it before then, and not since, is no longer
// cached there. Zero when neither is known.
func (t *Turnover) Horizon() time.Time {
	if ns := t.horizon.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// Gap is how long ago routed was, when the text a prompt continues was last routed: the
// conversation's next turn is taken to come as long after this one. Zero where routed is zero
// (none was, and nothing is known of when it comes back) or not before now.
func Gap(routed, now time.Time) time.Duration {
	if routed.IsZero() || !routed.Before(now) {
		return 0
	}
	return now.Sub(routed)
}

// AtRisk is how many of a prompt's tokens cached by an engine now it would have to compute
// again at the conversation's next turn, gap from now (Gap; 0 when not known): the prompt's
// tokens, by the chance that the engine evicts them first. The engine stores as many tokens
// as it has free in period (its Turnover's Period, 0 when not known): none is at risk where
// period is at least the gap, all where it is nothing, and between, the share of the gap
// that period falls short of.
func AtRisk(tokens float64, period, gap time.Duration) float64 {
	if period <= 0 || gap <= period {
		return 0
	}
	return tokens * (1 - period.Seconds()/gap.Seconds())
}

// Kept is gap where at least one of a pick's n candidates (candidate i's Turnover Period
// period(i)) would keep a prompt till it comes back with room to spare, its period at least
// twice the gap; 0, which puts nothing at risk anywhere, where none would. Where the prompt
// is lost wherever it goes, the periods' differences, which move with every scrape, tell
// less than their noise which engine would keep more of it.
func Kept(gap time.Duration, n int, period func(i int) time.Duration) time.Duration {
	for i := range n {
		if AtRisk(1, period(i)/2, gap) == 0 {
			return gap
		}
	}
	return 0
}
