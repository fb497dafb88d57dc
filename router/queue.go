package router

import "time"

// dispatchLocked hands free slots to waiters: the flows in their turn (fairQueue.byTurn),
// each flow's waiters earliest deadline first. A waiter that excludes the free backends does
// not block the ones behind it.
func (p *pool) dispatchLocked() {
	for p.waiters.Len() > 0 && p.dispatchOneLocked() {
	}
}

// dispatchOneLocked serves the first waiter that can be served, and reports whether one was:
// the flows' turns change with each service.
func (p *pool) dispatchOneLocked() bool {
	now := p.r.now()
flows:
	for _, f := range p.waiters.byTurn() {
		for e := f.waiters.Front(); e != nil; {
			next := e.Next()
			w := e.Value.(*waiter)
			h := w.h
			if p.ttftBound > 0 {
				h.waited = time.Since(w.since)
			}
			b, avail, choice, cost := p.pickLocked(h)
			switch {
			case b != nil:
				p.waiters.served(w, charge(cost, w.h))
				w.ch <- waitResult{lease: p.leaseLocked(b, choice, cost, w.h.Flow.Key)}
				return true
			case !avail:
				// Every backend it could use went down while it waited: waiting longer
				// would only turn a clear 503 into a slow one.
				p.waiters.remove(w)
				w.ch <- waitResult{err: ErrNoBackend}
			case p.reservedLocked(w.h, now) > 0:
				// The slots left are kept for an idle tenant: a tenant with nothing running
				// may take them, and may be next in line.
				continue flows
			case len(w.h.Exclude) == 0 && w.h.Model == "":
				// Everything is full; nobody behind can be served either. A waiter restricted
				// to some backends (by exclusion or model) says nothing about the others.
				return false
			}
			e = next
		}
	}
	return false
}

// leave takes w out of the queue after its ctx ended or its time ran out. If a
// dispatcher already served it, the result is waiting in w.ch: a lease is given back
// unused, and an error stands.
func (p *pool) leave(w *waiter, err error) waitResult {
	p.mu.Lock()
	if w.elem != nil { // still queued: w.elem is cleared under p.mu when served
		p.waiters.remove(w)
		p.mu.Unlock()
		return waitResult{err: err}
	}
	p.mu.Unlock()
	res := <-w.ch
	if res.lease != nil {
		res.lease.Release(Result{})
		return waitResult{err: err}
	}
	return res
}

// kick dispatches waiters after a change that may free capacity outside a Release.
func (p *pool) kick() {
	p.mu.Lock()
	p.dispatchLocked()
	p.mu.Unlock()
}
