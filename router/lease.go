package router

import (
	"fmt"
	"sync/atomic"

	"go.uber.org/zap"
)

// Result is what happened to the request sent under a lease. Its zero value means the
// lease was never used (e.g. a decoder reserved for a prefill that then failed): it
// counts nothing for the backend, neither a request nor a health signal.
type Result struct {
	// Status is the HTTP status the backend answered, 0 if none.
	Status int
	// Err is a connect or transport error talking to the backend.
	Err error
	// Canceled means the client went away; it takes precedence over Err and Status and
	// is never held against the backend.
	Canceled bool
}

// outcome turns a result into its metric code and whether it counts for passive health.
func (res Result) outcome() (code string, counted, failed bool) {
	switch {
	case res.Canceled:
		return "canceled", false, false
	case res.Err != nil:
		return "error", true, true
	case res.Status != 0:
		return fmtStatus(res.Status), true, res.Status >= 500
	}
	return "", false, false
}

// fmtStatus avoids strconv allocations for the common codes on the release path.
func fmtStatus(s int) string {
	switch s {
	case 200:
		return "200"
	case 400:
		return "400"
	case 429:
		return "429"
	case 500:
		return "500"
	case 502:
		return "502"
	case 503:
		return "503"
	}
	return fmt.Sprint(s)
}

// Lease is one in-flight request counted on a backend, from Acquire until Release.
type Lease struct {
	b        *Backend
	p        *pool
	released atomic.Bool
	// rank is the data-parallel rank the lease took, -1 for an engine of one rank;
	// rankCount its counter.
	rank      int
	rankCount *atomic.Int64
	// session is how the pick went for a request of a session; "" for one of none.
	session SessionChoice
	// booked is the lease's entry in its backend's cost books; nil for a pick not by cost.
	booked *booked
	// flow is the key of the flow (tenant) the lease was taken for; "" for none.
	flow string
}

// Session is how the pick of the lease's backend went for a request of a session
// (Hint.Session): kept on the engine it was bound to, placed, or yielded, and why. It is ""
// for a request of no session.
func (l *Lease) Session() SessionChoice {
	if l == nil {
		return ""
	}
	return l.session
}

// Rank is the data-parallel rank the lease took on its backend; ok is false for an engine
// of one rank, whose calls name none.
func (l *Lease) Rank() (rank int, ok bool) {
	if l == nil || l.rank < 0 {
		return 0, false
	}
	return l.rank, true
}

// Uncached is the prompt tokens its pick expected the backend to compute (0: not by cost).
func (l *Lease) Uncached() float64 {
	if l == nil || l.booked == nil {
		return 0
	}
	return l.booked.cost.Uncached
}

// Backend is the backend the lease counts on.
func (l *Lease) Backend() *Backend {
	if l == nil {
		return nil
	}
	return l.b
}

// Answered tells passive health that the backend has begun to answer the request under the
// lease (its first byte came back): a backend on probation after an ejection takes requests
// again from then on, not only once this one ends. The request's outcome still counts, at
// Release.
func (l *Lease) Answered() {
	if l == nil || l.released.Load() || !l.b.answered(l.p.r.now()) {
		return
	}
	l.p.mu.Lock()
	l.p.dispatchLocked() // requests queued while it took one at a time may go now
	l.p.mu.Unlock()
}

// Prefilled tells the cost books that the request's prefill on the lease's backend has ended
// (a prefill leg's answer, or a streamed answer's first byte): the work leaves the books, and
// the time it took teaches the engine's prefill rate and the prediction's error. Only the
// first call counts; a lease released without it leaves the books and teaches nothing (a
// non-streamed answer's first byte comes with its last).
func (l *Lease) Prefilled() {
	if l == nil || l.released.Load() {
		return
	}
	l.booked.settle(l.p.r, l.b, l.p.r.now(), true)
	if l.p.bounded.Load() {
		// The work left the books: a request held back by the TTFT bound may go now.
		l.p.kick()
	}
}

// Release ends the lease. Only the first call counts; later calls, from any goroutine,
// do nothing, so a deferred Release may back up an explicit one. res feeds passive
// health: a connect error or a 5xx counts a failure, a success resets the streak, a
// client cancel or the zero Result counts nothing against the backend. A connection refused
// (or with no route) takes the backend out at once: see Router.refused.
func (l *Lease) Release(res Result) {
	if l == nil || !l.released.CompareAndSwap(false, true) {
		return
	}
	l.booked.settle(l.p.r, l.b, l.p.r.now(), false)
	if l.rankCount != nil {
		l.rankCount.Add(-1)
	}
	r := l.p.r
	code, counted, failed := res.outcome()
	if counted {
		if ref, ok := refusalOf(res.Err); ok {
			r.refused(l.b, ref, res.Err)
		} else if d := l.b.observe(failed, r.now(), r.settings.Load().ejection); d > 0 {
			r.logger.Warn("backend ejected",
				zap.String("backend", l.b.Name), zap.String("role", string(l.b.Role)),
				zap.Duration("backoff", d), zap.Int64("ejections", l.b.Ejections()))
		}
	}
	l.p.release(l.b, code, l.flow)
}

func (p *pool) leaseLocked(b *Backend, choice SessionChoice, cost Cost, flow string) *Lease {
	b.st.inflight.Add(1)
	b.st.started.Add(1)
	if p.reservedSlots > 0 {
		p.flowSlots.took(flow) // gave, at the release, is a no-op for a flow not counted
	}
	l := &Lease{b: b, p: p, rank: -1, session: choice, flow: flow}
	if m := p.costModelLocked(); m != nil && cost != (Cost{}) {
		l.booked = book(m, b, cost, p.r.now())
	}
	if rp := b.st.ranks.counts.Load(); rp != nil && len(*rp) > 1 {
		ranks := *rp
		// The rank with the fewest in flight; ties rotate, so that an idle engine's ranks
		// share the work too.
		n := len(ranks)
		start := int(b.st.ranks.next.Add(1) % uint64(n))
		best := start
		for k := 1; k < n; k++ {
			if i := (start + k) % n; ranks[i].Load() < ranks[best].Load() {
				best = i
			}
		}
		ranks[best].Add(1)
		l.rank, l.rankCount = best, &ranks[best]
	}
	return l
}

// release ends one lease on b.
func (p *pool) release(b *Backend, code, flow string) {
	p.mu.Lock()
	p.flowSlots.gave(flow)
	removed := b.st.removed.Load()
	if code != "" && !removed {
		p.r.metrics.requests.WithLabelValues(b.Name, string(b.Role), code).Inc()
	}
	left := b.st.inflight.Add(-1)
	p.dispatchLocked()
	p.mu.Unlock()
	if left < 0 {
		// Cannot happen: a lease decrements once after incrementing once. Say so
		// loudly rather than hide a broken invariant.
		p.r.logger.Error("backend in-flight count went negative", zap.String("backend", b.Name), zap.Int64("inflight", left))
	}
	if removed && left == 0 {
		b.closeIdle()
	}
}
