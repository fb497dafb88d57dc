package router

import "time"

const (
	// tenantActiveWindow is how recently a flow must have asked for a slot to count as active
	// for the reserved slots (QueueConfig.ReservedSlots).
	tenantActiveWindow = time.Second
	// maxTrackedFlows bounds the flows a pool remembers for its reserved slots; one beyond
	// them is not remembered as active (it still gets its turn in the queue).
	maxTrackedFlows = 4096
)

// flowSlots is what a pool knows of its flows' use of its slots, for the reserved slots: a
// flow that floods takes every slot that frees, so that a quiet flow's next request would
// wait for one though it has nothing running; a few slots kept free while such a flow is
// active let it start at once. Guarded by pool.mu.
type flowSlots struct {
	// inflight counts each flow's leases; a flow with none has no entry.
	inflight map[string]int
	// seen is when each flow last asked for a slot.
	seen map[string]time.Time
}

// arrived records that flow key asked for a slot at now.
func (s *flowSlots) arrived(key string, now time.Time) {
	if key == "" {
		return
	}
	if s.seen == nil {
		s.seen = make(map[string]time.Time)
	}
	if _, ok := s.seen[key]; ok || len(s.seen) < maxTrackedFlows {
		s.seen[key] = now
	}
}

// took and gave count a lease of flow key.
func (s *flowSlots) took(key string) {
	if key == "" {
		return
	}
	if s.inflight == nil {
		s.inflight = make(map[string]int)
	}
	s.inflight[key]++
}

func (s *flowSlots) gave(key string) {
	if key == "" {
		return
	}
	if s.inflight[key] <= 1 {
		delete(s.inflight, key)
		return
	}
	s.inflight[key]--
}

// reservedLocked is how many free slots a pick for h must leave free: the pool's reserved
// slots while h's flow already has a request in flight and another flow, active within
// tenantActiveWindow, has none in flight and none waiting; else 0. A flow with nothing in
// flight is never held back by them: it is what they are kept for. Flows gone quiet for
// longer are forgotten on the way.
func (p *pool) reservedLocked(h Hint, now time.Time) int {
	key := h.Flow.Key
	if p.reservedSlots <= 0 || key == "" || h.Overcommit || p.flowSlots.inflight[key] == 0 {
		return 0
	}
	for k, at := range p.flowSlots.seen {
		switch {
		case now.Sub(at) > tenantActiveWindow:
			delete(p.flowSlots.seen, k)
		case k != key && p.flowSlots.inflight[k] == 0 && p.waiters.depth(k) == 0:
			return p.reservedSlots
		}
	}
	return 0
}

// freeSlots is how many more requests cands may take under their max_inflight.
func freeSlots(cands []*Backend) int {
	n := 0
	for _, b := range cands {
		n += max(b.MaxInflight-int(b.st.inflight.Load()), 0)
	}
	return n
}
