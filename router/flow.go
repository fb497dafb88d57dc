package router

import (
	"container/list"
	"slices"
	"time"
)

// Flow is the tenant a request waits for, when it waits: the queue of a pool serves its
// flows by weight, each flow's own requests earliest deadline first (Hint.Slack), so that a
// tenant that floods the queue delays only itself.
type Flow struct {
	// Key tells flows apart: requests of one Key share a queue and a share of the pool's
	// slots. An opaque value (the proxy passes a hash or a configured name); it reaches no
	// log or label. Empty is one flow of its own, of weight 1: with no request naming a
	// flow, the queue is the single earliest-deadline-first queue it always was, and a full
	// queue answers ErrQueueFull.
	Key string
	// Label names the flow's tenant in pdproxy_flow_queue_depth and
	// pdproxy_flow_queue_wait_seconds: a closed set from the proxy's config. Empty means
	// the flow is not shown.
	Label string
	// Weight is the flow's share of the slots that free up while its requests wait, against
	// the other flows with requests waiting: a flow of weight 3 is served three requests
	// for every one of a flow of weight 1. Zero means 1.
	Weight float64
	// MaxQueue bounds the flow's requests waiting in one pool: one more is refused with
	// ErrTenantQueueFull. Zero means none but the queue's size.
	MaxQueue int
}

func (f Flow) weight() float64 {
	if f.Weight > 0 {
		return f.Weight
	}
	return 1
}

// waiter is one request waiting in a pool's queue (fairQueue) for a backend.
type waiter struct {
	h    Hint
	ch   chan waitResult // buffered 1: the dispatcher never blocks
	elem *list.Element   // in flow's list; nil once out of the queue
	flow *flowQueue
	// deadline is when the waiter arrived plus its Hint's Slack: its order within its flow.
	deadline time.Time
	// since is when it began to wait, on the wall clock: the TTFT bound counts its wait.
	since time.Time
}

// waitResult is what a waiter is handed when it leaves the queue: a lease, or why none.
type waitResult struct {
	lease *Lease
	err   error
}

// fairQueue is a pool's wait queue: one earliest-deadline-first list per flow, the flows
// served by start-time fair queuing. Each flow's virtual time is where its next service
// starts; a service advances it by its charge over the flow's weight, the charge being the
// prompt tokens the request computes where it goes (charge), so that a tenant of long
// uncached prompts gets fewer requests through than one of short or cached ones, for the same
// engine time. The next waiter served is the first servable one of the flow whose virtual time
// is least. A flow that was idle starts at the queue's virtual time, so no flow banks credit
// while it sends nothing. Guarded by pool.mu.
type fairQueue struct {
	flows map[string]*flowQueue
	// active are the flows with waiters, in the order they last became active: the ties'
	// order.
	active []*flowQueue
	n      int
	// vclock is the virtual time of the latest service's start.
	vclock float64
	// order is scratch for dispatch.
	order []*flowQueue
	// share is what the queue shares with other replicas' (flowshare.go); its zero value
	// shares nothing.
	share flowShare
}

type flowQueue struct {
	Flow
	waiters list.List // of *waiter, earliest deadline first
	// vt is the virtual time at which the flow's next service starts.
	vt float64
	// remoteSeen is what the other replicas had served the flow in the share window when
	// this queue last read it (flowshare.go); based says it has read it since the flow began
	// to wait here.
	remoteSeen float64
	based      bool
}

// charge is what serving h at cost takes from its flow's turn: the prompt tokens it computes
// there as the cost model sees them, or, where the pool does not place by cost, its prompt's
// tokens (hintTokens); at least 1.
func charge(cost Cost, h Hint) float64 {
	if cost != (Cost{}) {
		return max(cost.Uncached, 1)
	}
	return max(hintTokens(h), 1)
}

// Len is how many requests wait.
func (q *fairQueue) Len() int { return q.n }

// depth is how many requests of flow key wait.
func (q *fairQueue) depth(key string) int {
	if f := q.flows[key]; f != nil {
		return f.waiters.Len()
	}
	return 0
}

// push queues w in its flow after every waiter of the flow whose deadline is not later than
// its own: the earliest deadline first within a tenant, first come, first served among equal
// deadlines. The scan starts at the back, where a waiter of the most common class usually
// belongs.
func (q *fairQueue) push(w *waiter) {
	f := q.flows[w.h.Flow.Key]
	if f == nil {
		if q.flows == nil {
			q.flows = make(map[string]*flowQueue)
		}
		f = &flowQueue{vt: q.vclock}
		q.flows[w.h.Flow.Key] = f
		q.active = append(q.active, f)
	}
	f.Flow = w.h.Flow // the latest request's weight and bounds: a reload may change them
	w.flow = f
	q.n++
	for e := f.waiters.Back(); e != nil; e = e.Prev() {
		if !e.Value.(*waiter).deadline.After(w.deadline) {
			w.elem = f.waiters.InsertAfter(w, e)
			return
		}
	}
	w.elem = f.waiters.PushFront(w)
}

// remove takes w, still queued, out of the queue; its flow goes when it has no waiter left.
func (q *fairQueue) remove(w *waiter) {
	f := w.flow
	f.waiters.Remove(w.elem)
	w.elem = nil
	q.n--
	if f.waiters.Len() == 0 {
		delete(q.flows, f.Key)
		if i := slices.Index(q.active, f); i >= 0 {
			q.active = slices.Delete(q.active, i, i+1)
		}
	}
}

// served takes w out of the queue as its flow's next service, of charge (charge).
func (q *fairQueue) served(w *waiter, charge float64) {
	f := w.flow
	start := max(f.vt, q.vclock)
	q.vclock = start
	f.vt = start + charge/f.weight()
	q.share.note(f.Key, charge)
	q.remove(w)
}

// byTurn lists the active flows in the order they are to be served: least virtual time
// first, ties in the order they became active. The slice is scratch, valid until the
// next call.
func (q *fairQueue) byTurn() []*flowQueue {
	q.order = append(q.order[:0], q.active...)
	slices.SortStableFunc(q.order, func(a, b *flowQueue) int {
		switch an, bn := a.vt, b.vt; {
		case an < bn:
			return -1
		case an > bn:
			return 1
		}
		return 0
	})
	return q.order
}

// admitLocked decides whether h may wait in the queue of size places. Without flows (an
// empty Flow.Key) a full queue answers ErrQueueFull as it always did. With them, a flow at
// its MaxQueue is refused (ErrTenantQueueFull). In a full queue, the newest waiter of the flow
// with the most waiting per weight makes room when that flow would still have more than h's
// with h (it is told ErrTenantQueueFull); else h's flow, when it already waits and would go
// over its weighted share of the places, is refused (ErrTenantQueueFull); else the pool is
// saturated (ErrPoolSaturated). A quiet tenant is never refused for a queue that a noisy
// one filled.
func (q *fairQueue) admitLocked(h Hint, size int) error {
	key := h.Flow.Key
	mine := q.depth(key)
	if h.Flow.MaxQueue > 0 && mine >= h.Flow.MaxQueue {
		return ErrTenantQueueFull
	}
	if q.n < size {
		return nil
	}
	if key == "" || size <= 0 {
		return ErrQueueFull
	}
	total := 0.0
	var victim *flowQueue
	for _, f := range q.active {
		total += f.weight()
		if f.Key != key && (victim == nil || perWeight(f.waiters.Len(), f.weight()) > perWeight(victim.waiters.Len(), victim.weight())) {
			victim = f
		}
	}
	if q.flows[key] == nil {
		total += h.Flow.weight()
	}
	if victim != nil && perWeight(victim.waiters.Len(), victim.weight()) > perWeight(mine+1, h.Flow.weight()) {
		w := victim.waiters.Back().Value.(*waiter) // the latest deadline: the one that waited least
		q.remove(w)
		w.ch <- waitResult{err: ErrTenantQueueFull}
		return nil
	}
	if mine > 0 && float64(mine+1) > float64(size)*h.Flow.weight()/total {
		return ErrTenantQueueFull
	}
	return ErrPoolSaturated
}

func perWeight(n int, w float64) float64 { return float64(n) / w }
