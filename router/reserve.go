package router

import "time"

const (
	// tenantActiveWindow is how recently a flow must have asked for a slot to count as active
	// for the reserved slots (routerconfig.QueueConfig.ReservedSlots).
	tenantActiveWindow = time.Second
	// maxTrackedFlows bounds the flows a pool remembers for its reserved slots; one beyond
	// them is not remembered as active (it still gets its turn in the queue).
	maxTrackedFlows = 4096
	// idleScanEvery is how long a scan that found no idle flow stands, unless a flow goes
	// idle or is first seen meanwhile: under a flood of many busy tenants, picks do not scan
	// them all each time.
	idleScanEvery = 10 * time.Millisecond
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
	// idle is the active idle flow the latest scan found, checked first by the next picks;
	// "" for none. noneUntil is when a scan that found none runs again at the latest.
	idle      string
	noneUntil time.Time
}

// arrived records that flow key asked for a slot at now.
func (s *flowSlots) arrived(key string, now time.Time) {
	if key == "" {
		return
	}
	if s.seen == nil {
		s.seen = make(map[string]time.Time)
	}
	_, ok := s.seen[key]
	if ok || len(s.seen) < maxTrackedFlows {
		s.seen[key] = now
	}
	if !ok {
		s.noneUntil = time.Time{} // a flow first seen may be the idle one
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
		s.noneUntil = time.Time{} // it went idle
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
	fs := &p.flowSlots
	if p.reservedSlots <= 0 || key == "" || h.Overcommit || fs.inflight[key] == 0 {
		return 0
	}
	if k := fs.idle; k != "" {
		if k != key && p.idleLocked(k, now) {
			return p.reservedSlots
		}
		fs.idle = ""
	}
	if now.Before(fs.noneUntil) {
		return 0
	}
	for k, at := range fs.seen {
		switch {
		case now.Sub(at) > tenantActiveWindow:
			delete(fs.seen, k)
		case k != key && p.idleLocked(k, now):
			fs.idle = k
			return p.reservedSlots
		}
	}
	fs.noneUntil = now.Add(idleScanEvery)
	return 0
}

// idleLocked reports whether flow k is active (seen within tenantActiveWindow) with nothing
// in flight and nothing waiting.
func (p *pool) idleLocked(k string, now time.Time) bool {
	at, seen := p.flowSlots.seen[k]
	return seen && now.Sub(at) <= tenantActiveWindow && p.flowSlots.inflight[k] == 0 && p.waiters.depth(k) == 0
}

// freeSlots is how many more requests cands may take under their max_inflight.
func freeSlots(cands []*Backend) int {
	n := 0
	for _, b := range cands {
		n += max(b.MaxInflight-int(b.st.inflight.Load()), 0)
	}
	return n
}
