package router

import (
	"container/list"
	"time"
)

type waiter struct {
	h    Hint
	ch   chan waitResult // buffered 1: the dispatcher never blocks
	elem *list.Element
	// deadline is when the waiter arrived plus its Hint's Slack: the queue's order.
	deadline time.Time
}

// enqueueLocked puts w after every waiter whose deadline is not later than its own: the
// earliest deadline first, and first come, first served among equal deadlines. A waiter is
// overtaken only by those that arrive before its deadline, so no class starves. The scan
// starts at the back, where a waiter of the most common class usually belongs.
func (p *pool) enqueueLocked(w *waiter) {
	for e := p.waiters.Back(); e != nil; e = e.Prev() {
		if !e.Value.(*waiter).deadline.After(w.deadline) {
			w.elem = p.waiters.InsertAfter(w, e)
			return
		}
	}
	w.elem = p.waiters.PushFront(w)
}

type waitResult struct {
	lease *Lease
	err   error
}

// dispatchLocked hands free slots to waiters in queue order (earliest deadline first). A waiter that excludes the
// free backends does not block the ones behind it.
func (p *pool) dispatchLocked() {
	for e := p.waiters.Front(); e != nil; {
		next := e.Next()
		w := e.Value.(*waiter)
		b, avail, choice, cost := p.pickLocked(w.h)
		switch {
		case b != nil:
			p.waiters.Remove(e)
			w.elem = nil
			w.ch <- waitResult{lease: p.leaseLocked(b, choice, cost)}
		case !avail:
			// Every backend it could use went down while it waited: waiting longer
			// would only turn a clear 503 into a slow one.
			p.waiters.Remove(e)
			w.elem = nil
			w.ch <- waitResult{err: ErrNoBackend}
		case len(w.h.Exclude) == 0 && w.h.Model == "":
			// Everything is full; nobody behind can be served either. A waiter restricted
			// to some backends (by exclusion or model) says nothing about the others.
			return
		}
		e = next
	}
}

// leave takes w out of the queue after its ctx ended or its time ran out. If a
// dispatcher already served it, the result is waiting in w.ch: a lease is given back
// unused, and an error stands.
func (p *pool) leave(w *waiter, err error) waitResult {
	p.mu.Lock()
	if w.elem != nil { // still queued: w.elem is cleared under p.mu when served
		p.waiters.Remove(w.elem)
		w.elem = nil
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
