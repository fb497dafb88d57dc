package costmodel

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Books are one engine's entries of requests whose prefill has not ended, in the order they
// were booked. The zero Books are empty; they are safe for concurrent use.
type Books struct {
	// n is len(entries), read without the lock: most engines of a large pool have no entry
	// at a pick, and every candidate's books are read.
	n       atomic.Int64
	mu      sync.Mutex
	entries []*Entry
	tokens  int64
}

// Entry is a request's entry in Books: when it was booked and its uncached prompt tokens.
type Entry struct {
	At     time.Time
	Tokens int64
}

// Remaining is the work the entries leave at now, in tokens, had the engine computed them
// one after another from the first's booking at secPerToken (as an engine's compute is
// shared: a prefill that began a while ago has done part of its work), and how many entries
// there are. An entry the engine should have done by now but whose prefill has not ended
// (waiting for a slot, or the engine slower than learned) counts for nothing: the lesson of
// its end corrects the rate.
func (bs *Books) Remaining(now time.Time, secPerToken float64) (tokens float64, entries int64) {
	if bs.n.Load() == 0 {
		return 0, 0
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	var free time.Time // when the entries before the one at hand are done
	for _, e := range bs.entries {
		start := e.At
		if free.After(start) {
			start = free
		}
		free = start.Add(time.Duration(float64(e.Tokens) * secPerToken * float64(time.Second)))
		if free.After(now) {
			if now.After(start) {
				tokens += free.Sub(now).Seconds() / secPerToken
			} else {
				tokens += float64(e.Tokens)
			}
		}
	}
	return tokens, int64(len(bs.entries))
}

// Add enters e last. The Books keep e itself: Remove takes out the same pointer.
func (bs *Books) Add(e *Entry) {
	bs.mu.Lock()
	bs.entries = append(bs.entries, e)
	bs.tokens += e.Tokens
	bs.n.Store(int64(len(bs.entries)))
	bs.mu.Unlock()
}

// Remove takes e out, if it is there.
func (bs *Books) Remove(e *Entry) {
	bs.mu.Lock()
	if i := slices.Index(bs.entries, e); i >= 0 {
		bs.entries = slices.Delete(bs.entries, i, i+1)
		bs.tokens -= e.Tokens
		bs.n.Store(int64(len(bs.entries)))
	}
	bs.mu.Unlock()
}

// Totals are the entries' uncached tokens and how many there are.
func (bs *Books) Totals() (tokens, entries int64) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	return bs.tokens, int64(len(bs.entries))
}
