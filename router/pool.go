package router

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/router/costmodel"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// pool is the backends of one role, their policy and their wait queue.
type pool struct {
	role routerconfig.Role
	r    *Router

	mu         sync.Mutex
	backends   []*Backend
	policy     Policy
	policyName string
	// caps are what policy needs of the router, from its registry entry.
	caps         routerconfig.PolicyCaps
	prefixTokens int
	cache        cacheSettings
	// loadFactor is bounded_load_factor, for sessions' picks.
	loadFactor   float64
	queueSize    int
	queueTimeout time.Duration
	// ttftBound is Queue.TTFTBound, reservedSlots Queue.ReservedSlots; bounded says, without
	// the lock, whether ttftBound is set.
	ttftBound     time.Duration
	bounded       atomic.Bool
	reservedSlots int
	// flowSlots is what the flows hold of the slots, for the reserved slots (reserve.go).
	flowSlots flowSlots
	waiters   fairQueue
	scratch   []*Backend
}

// cacheSettings are what a cache-aware policy is built with: a change rebuilds it.
type cacheSettings struct {
	routerconfig.CacheAwareConfig
	staleAfter time.Duration
	loadFactor float64
}

// pickLocked selects a backend for h: for a session (h.Session) the pool's session choice,
// which comes before the policy's (the session's earlier turns are cached where it was
// placed), else the policy's. avail reports whether any backend could take h were it not
// full, which tells "wait" from "no backend"; choice is how a session's pick went, "" without
// a session.
func (p *pool) pickLocked(h Hint) (b *Backend, avail bool, choice SessionChoice, cost Cost) {
	now := p.r.now()
	cands := p.scratch[:0]
	bound, boundEligible := -1, false
	for _, b := range p.backends {
		if !b.available(now) || slices.Contains(h.Exclude, b.Name) || !b.Serves(h.Model) || h.Accept != nil && !h.Accept(b.Engine) {
			continue
		}
		avail = true
		isBound := h.Bound != "" && b.Name == h.Bound
		if isBound {
			boundEligible = true
		}
		if !b.full() || h.Overcommit {
			if isBound {
				bound = len(cands)
			}
			cands = append(cands, b)
		}
	}
	p.scratch = cands[:0]
	if len(cands) == 0 {
		return nil, avail, "", Cost{}
	}
	if r := p.reservedLocked(h, now); r > 0 && freeSlots(cands) <= r {
		// The slots left are kept for a tenant that is active and has nothing running.
		clear(cands)
		return nil, true, "", Cost{}
	}
	if cs, ok := p.policy.(costSelector); ok {
		// A session is placed by the same cost, its bound engine first among near-equals.
		if p.ttftBound > 0 && !h.Overcommit {
			waited := h.waited // a copy: the closure must not move h to the heap on every pick
			h.admit = func(c Cost) bool { return !p.overBound(c, waited) }
		}
		b, cost = cs.SelectCost(cands, h)
		if cost.held {
			// Even the cheapest candidate would make the request wait past the bound behind
			// work already there: the pool is saturated, and the request waits its turn.
			clear(cands)
			return nil, true, "", Cost{}
		}
		if b == nil || !slices.Contains(cands, b) {
			b, cost = cands[0], Cost{}
		}
		if h.Session != "" {
			choice = sessionChoice(b, h, bound, boundEligible)
		}
	} else if h.Session != "" {
		b, choice = p.sessionLocked(cands, h, bound, boundEligible)
		if rec, ok := p.policy.(pickRecorder); ok {
			rec.Picked(b, h)
		}
	} else {
		b = p.policy.Select(cands, h)
		if b == nil || !slices.Contains(cands, b) {
			b = cands[0] // a policy must pick a candidate; never let a bug pick a full one
		}
	}
	clear(cands) // do not keep backends alive through the scratch slice
	return b, true, choice, cost
}

// overBound reports whether a pick of cost, for a request that has waited so long, would bring
// its first token past the pool's TTFT bound: its wait in the queue, its predicted TTFT
// there, and what the pool's predictions run late by (the 90th percentile of their lateness)
// together. It is called under the pool's lock, the policy asking it (Hint.admit). A request
// that has not waited and whose own prefill alone takes longer than the bound is not held
// back on an idle engine: waiting would not make it faster. One that waited past the bound
// waits on to its queue timeout, and is refused then: admitted, it would be late.
func (p *pool) overBound(cost Cost, waited time.Duration) bool {
	var late time.Duration
	if m := p.costModelLocked(); m != nil {
		late = m.Lateness()
	}
	if cost.Predicted+waited+late <= p.ttftBound {
		return false
	}
	return cost.Ahead > 0 || waited > 0
}

// sessionChoice is how a pick of b for h's session went, where the policy picked by cost:
// bound is h.Bound's index among the candidates (-1 if not there); eligible says whether it
// could take the request but for being full.
func sessionChoice(b *Backend, h Hint, bound int, eligible bool) SessionChoice {
	switch {
	case h.Bound == "":
		return SessionPlaced
	case b.Name == h.Bound:
		return SessionKept
	case bound >= 0 || eligible:
		return SessionYieldedLoad
	}
	return SessionYieldedUnhealthy
}

// costModelLocked is the pool's cost model; nil when its policy does not pick by cost.
func (p *pool) costModelLocked() *costmodel.Model {
	if cs, ok := p.policy.(costSelector); ok {
		return cs.model()
	}
	return nil
}
