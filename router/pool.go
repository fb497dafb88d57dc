package router

import (
	"container/list"
	"slices"
	"sync"
	"time"
)

// pool is the backends of one role, their policy and their wait queue.
type pool struct {
	role Role
	r    *Router

	mu         sync.Mutex
	backends   []*Backend
	policy     Policy
	policyName string
	// caps are what policy needs of the router, from its registry entry.
	caps         policyCaps
	prefixTokens int
	cache        cacheSettings
	queueSize    int
	queueTimeout time.Duration
	waiters      list.List // of *waiter, earliest deadline first
	scratch      []*Backend
}

// cacheSettings are what a cache-aware policy is built with: a change rebuilds it.
type cacheSettings struct {
	CacheAwareConfig
	staleAfter time.Duration
}

// pickLocked selects a backend for h. avail reports whether any backend could take h
// were it not full, which tells "wait" from "no backend".
func (p *pool) pickLocked(h Hint) (b *Backend, avail bool) {
	now := p.r.now()
	cands := p.scratch[:0]
	for _, b := range p.backends {
		if !b.available(now) || slices.Contains(h.Exclude, b.Name) || !b.Serves(h.Model) || h.Accept != nil && !h.Accept(b.Engine) {
			continue
		}
		avail = true
		if !b.full() || h.Overcommit {
			cands = append(cands, b)
		}
	}
	p.scratch = cands[:0]
	if len(cands) == 0 {
		return nil, avail
	}
	b = p.policy.Select(cands, h)
	if b == nil || !slices.Contains(cands, b) {
		b = cands[0] // a policy must pick a candidate; never let a bug pick a full one
	}
	clear(cands) // do not keep backends alive through the scratch slice
	return b, true
}
