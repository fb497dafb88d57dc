package router

import (
	"context"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// FlowShares carries what the fair queues of the replicas behind one shared state served,
// flow by flow, so that a tenant's share of the engines is global rather than each replica's:
// a tenant served on another replica waits that much longer on this one.
type FlowShares interface {
	// ShareFlows adds served (what this replica served since its last call, by field) to the
	// totals of window and answers the totals of the fields of want, over every replica.
	// A field is a role and a flow's key (flowField); window numbers the minute the totals
	// count, so that they start afresh each minute and what no replica serves goes away.
	ShareFlows(ctx context.Context, window int64, served map[string]float64, want []string) (map[string]float64, error)
}

const (
	// flowShareInterval is how often a replica sends what it served and reads the others':
	// the bound of how stale its view of another replica's service is.
	flowShareInterval = 100 * time.Millisecond
	// flowShareWindow is how long the totals count before they start afresh.
	flowShareWindow = time.Minute
	// maxSharedFlows bounds the flows a pool shares in one window; a flow beyond them (a
	// flood of tenants of their own) is fair on this replica alone.
	maxSharedFlows = 4096
)

// flowShare is what a pool's fair queue keeps of the shared totals. Guarded by pool.mu.
type flowShare struct {
	// window is the window own and remote count in.
	window int64
	// unsent is what this replica served since its last call, by flow key.
	unsent map[string]float64
	// own is what this replica served in the window, by flow key.
	own map[string]float64
}

// note adds charge, served to flow key here, to what is to be sent.
func (s *flowShare) note(key string, charge float64) {
	if s.unsent == nil || key == "" {
		return // not shared, or no flow control
	}
	if _, known := s.unsent[key]; known || len(s.own)+len(s.unsent) < maxSharedFlows {
		s.unsent[key] += charge
	}
}

// flowField is how role's flow key is named in the shared totals.
func flowField(role routerconfig.Role, key string) string { return string(role) + ":" + key }

// ShareFlows makes the router's fair queues share what they serve through fs, from the next
// Run on. Call it before Run.
func (r *Router) ShareFlows(fs FlowShares) {
	r.shares = fs
	for _, p := range []*pool{r.prefill, r.decode} {
		if p != nil {
			p.mu.Lock()
			p.waiters.share = flowShare{unsent: map[string]float64{}, own: map[string]float64{}}
			p.mu.Unlock()
		}
	}
}

// shareLoop sends and reads the shared totals every flowShareInterval until ctx ends.
func (r *Router) shareLoop(ctx context.Context) {
	t := time.NewTicker(flowShareInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.shareOnce(ctx)
		}
	}
}

// shareOnce sends what each pool served since the last round and adds what the other
// replicas served meanwhile to the virtual times of the flows waiting here.
func (r *Router) shareOnce(ctx context.Context) {
	window := r.now().UnixNano() / int64(flowShareWindow)
	served := map[string]float64{}
	var want []string
	pools := []*pool{r.prefill, r.decode}
	for _, p := range pools {
		if p == nil {
			continue
		}
		p.mu.Lock()
		s := &p.waiters.share
		if s.window != window {
			s.window = window
			clear(s.own)
		}
		for k, v := range s.unsent {
			s.own[k] += v
			served[flowField(p.role, k)] = v
		}
		clear(s.unsent)
		for _, f := range p.waiters.active {
			if f.Key != "" {
				want = append(want, flowField(p.role, f.Key))
			}
		}
		p.mu.Unlock()
	}
	if len(served) == 0 && len(want) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, flowShareInterval)
	totals, err := r.shares.ShareFlows(ctx, window, served, want)
	cancel()
	if err != nil {
		return // the shared state counts its own failures; each replica is fair alone meanwhile
	}
	for _, p := range pools {
		if p == nil {
			continue
		}
		p.mu.Lock()
		p.waiters.addRemote(p.role, window, totals)
		p.dispatchLocked()
		p.mu.Unlock()
	}
}

// addRemote adds to each waiting flow's virtual time what the other replicas served it since
// the queue last read window's totals while the flow waited here. A flow that begins to wait
// takes the totals as they stand as its start: what other replicas served it before, when it
// did not compete here, is no debt here, as time spent idle is no credit. Guarded by
// pool.mu.
func (q *fairQueue) addRemote(role routerconfig.Role, window int64, totals map[string]float64) {
	s := &q.share
	if s.window != window {
		return
	}
	for _, f := range q.active {
		total, ok := totals[flowField(role, f.Key)]
		if !ok {
			continue
		}
		remote := total - s.own[f.Key]
		if d := remote - f.remoteSeen; f.based && d > 0 {
			f.vt += d / f.weight()
		}
		// A new window's totals start again below the last reading: they are its start.
		f.remoteSeen, f.based = remote, true
	}
}
