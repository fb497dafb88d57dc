package router

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/costmodel"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// A large pool (more than largePool candidates) is picked from without reading every candidate
// on every pick. What a pick must know of all of them, the loads (for the balance test and the
// least loaded), it reads from a view of the pool kept between picks: each pick brings
// loadRefreshBatch candidates' loads up to date in turn, and more when picks are far apart, so
// that every load in the view is at most about loadRefreshPeriod or len/loadRefreshBatch picks
// old. A candidate a pick may choose is read afresh before it is chosen, and counted one
// request busier once chosen. What it must know of the prompt, it reads only of the engines
// that hold much of it: those the index's walk finds, and those the tree of routed text has
// marked at least cache_threshold of the text deep. The rest of a pick is the rendezvous order
// of placement, a hash per candidate over arrays kept in the view.
const (
	largePool         = 64
	loadRefreshBatch  = 32
	loadRefreshPeriod = 100 * time.Millisecond
)

// poolView is what the picks of a large pool keep of its candidates.
type poolView struct {
	// cands, names, hash and weight are the candidates, their names, name hashes and
	// weights, fixed when the view is made.
	cands       []*Backend
	names       *kvcache.Names
	hash        []uint64
	weight      []int
	evenWeights bool

	mu sync.Mutex
	// loads and full are each candidate's load and whether it is a prefiller with its KV
	// pool nearly full, as last read.
	loads []int64
	full  []bool
	// cursor is the next candidate to read afresh; readAt when the view last read any.
	cursor int
	readAt time.Time
	// ahead is each candidate's work ahead of a new request, in prefill tokens (cost.go),
	// as last read, for m, the policy's cost model; period its engine's KV turnover period.
	ahead  []float64
	period []time.Duration
	m      *costmodel.Model
	// at is a pick's scratch: each candidate's place in shares, -1 if not there; costs the
	// candidates' costs.
	at     []int32
	shares []heldShare
	costs  []float64
}

// heldShare is what a pick found a candidate to hold of its prompt.
type heldShare struct {
	i           int
	index, tree float64
}

func newPoolView(cands []*Backend, now time.Time, m *costmodel.Model) *poolView {
	n := len(cands)
	v := &poolView{
		cands: slices.Clone(cands), hash: make([]uint64, n), weight: make([]int, n),
		loads: make([]int64, n), full: make([]bool, n), at: make([]int32, n), evenWeights: true,
		readAt: now, ahead: make([]float64, n), period: make([]time.Duration, n), m: m, costs: make([]float64, 0, n),
	}
	names := make([]string, n)
	for i, b := range cands {
		names[i], v.hash[i], v.weight[i] = b.Name, b.nameHash, max(b.Weight, 1)
		v.evenWeights = v.evenWeights && v.weight[i] == v.weight[0]
		v.at[i] = -1
		v.read(i, now)
	}
	v.names = kvcache.NewNames(names)
	return v
}

// viewsKept is how many views of a policy's candidate sets are kept: a pool serving several
// models, or a retry leaving out the engine that failed, picks among other candidates than
// the pool's usual ones.
const viewsKept = 4

// viewFor returns the view of cands, the one of the picks before when the candidates are the
// same.
func (p *CacheAware) viewFor(cands []*Backend, now time.Time) *poolView {
	p.namesMu.Lock()
	defer p.namesMu.Unlock()
	for i, v := range p.views {
		if slices.Equal(v.cands, cands) {
			copy(p.views[1:i+1], p.views[:i]) // the most recent first
			p.views[0] = v
			return v
		}
	}
	v := newPoolView(cands, now, p.cm)
	if len(p.views) < viewsKept {
		p.views = append(p.views, nil)
	}
	copy(p.views[1:], p.views)
	p.views[0] = v
	return v
}

// read brings candidate i's load up to date.
func (v *poolView) read(i int, now time.Time) {
	load, full, _ := v.cands[i].loadScore(now)
	v.loads[i], v.full[i] = load, full
	v.ahead[i], v.period[i] = v.cands[i].workAhead(v.m, now), v.cands[i].st.load.turnover.Period()
}

// refresh reads loadRefreshBatch candidates afresh, and as many more as the time since the
// last read asks for the whole view to be read every loadRefreshPeriod.
func (v *poolView) refresh(now time.Time) {
	n := len(v.cands)
	count := loadRefreshBatch
	if gap := now.Sub(v.readAt); gap > 0 {
		count += int(float64(n) * float64(gap) / float64(loadRefreshPeriod))
	}
	count = min(count, n)
	for range count {
		v.read(v.cursor, now)
		if v.cursor++; v.cursor == n {
			v.cursor = 0
		}
	}
	v.readAt = now
}

// took counts candidate i one request busier: the one just sent to it, of uncached tokens.
func (v *poolView) took(i int, uncached float64) {
	v.loads[i]++
	v.ahead[i] += uncached
}

// unbalanced is CacheAware.unbalanced over the view's loads.
func (v *poolView) unbalanced(cfg routerconfig.CacheAwareConfig) bool {
	lo, hi := v.loads[0], v.loads[0]
	for _, l := range v.loads[1:] {
		lo, hi = min(lo, l), max(hi, l)
	}
	return cfg.OutOfBalance(lo, hi)
}

// better reports whether candidate i is less loaded than j, as leastLoadedOf ranks them.
func (v *poolView) better(i, j int) bool {
	if v.full[i] != v.full[j] {
		return !v.full[i]
	}
	if v.loads[i] != v.loads[j] {
		return v.loads[i] < v.loads[j]
	}
	return v.weight[i] > v.weight[j]
}

// leastLoaded is the least loaded candidate, ties rotating by next; read afresh, it must
// still be the least loaded, or the next is looked for.
func (v *poolView) leastLoaded(next *atomic.Uint64, now time.Time) int {
	for try := 0; ; try++ {
		pick := bestOf(len(v.cands), v.better, next)
		was := v.loads[pick]
		v.read(pick, now)
		if v.loads[pick] <= was || try == 2 {
			return pick
		}
	}
}

// selectLarge is SelectCost for a large pool: every candidate's cost from the view, the
// prompt's share read only of the engines that hold some of it.
func (p *CacheAware) selectLarge(cands []*Backend, h Hint, key uint64, now time.Time) (*Backend, Cost) {
	v := p.viewFor(cands, now)
	scratch := p.match(h)
	defer scratch.release()
	found := scratch.matches()
	// The tree's marks, read before the view is locked: the tree has a lock of its own.
	type treeMark struct {
		i, depth int
		at       int64
	}
	var marks []treeMark
	var routed time.Time // when the text h continues was routed
	if h.Text != "" {
		routed = p.tree.MatchDeep(h.Text, 1, func(engine string, depth int, at int64) {
			if i, ok := v.names.At(engine); ok {
				marks = append(marks, treeMark{i, depth, at})
			}
		})
	}
	tokens := hintTokens(h)

	v.mu.Lock()
	defer v.mu.Unlock()
	v.refresh(now)
	if v.unbalanced(p.cfg) {
		i := v.leastLoaded(&p.next, now)
		b := cands[i]
		cost := p.costOn(b, tokens, now)
		if h.holds(cost) {
			return b, heldCost
		}
		p.cm.NoteUncached(tokens)
		v.took(i, cost.Uncached)
		p.picked(b, h, -1)
		return b, cost
	}

	// The engines holding some of the prompt, by the index and by the tree.
	shares := v.shares[:0]
	share := func(i int) *heldShare {
		if v.at[i] < 0 {
			v.at[i] = int32(len(shares))
			shares = append(shares, heldShare{i: i})
		}
		return &shares[v.at[i]]
	}
	if found != nil {
		found.Each(func(e *kvcache.Engine, view kvcache.View) {
			i, ok := v.names.At(e.Name())
			if !ok || cands[i].kvEngineIn(p.index) != e || view.Last.IsZero() || now.Sub(view.Last) >= p.staleAfter {
				return
			}
			share(i).index = view.Weighted / float64(len(h.Tokens))
		})
	}
	for _, m := range marks {
		// Text routed since just before an engine's latest event counts for an engine whose
		// events are fresh; for another, what tree_ttl and its KV turnover have not retired.
		if m.at < p.treeSince(cands[m.i], p.pendingSince(found, cands[m.i], now), now).UnixNano() {
			continue
		}
		s := share(m.i)
		s.tree = max(s.tree, float64(m.depth)/float64(len(h.Text)))
	}
	for _, pl := range h.Placed {
		if i, ok := v.names.At(pl.Engine); ok && p.creditsPlacements(cands[i]) {
			s := share(i)
			s.tree = max(s.tree, placedShare(h, pl.Engine))
		}
	}
	bound := -1
	if h.Bound != "" {
		if i, ok := v.names.At(h.Bound); ok {
			bound = i
		}
	}
	if bound >= 0 {
		// As in SelectCost: the session's engine holds at least what any engine is known to.
		best := 0.0
		for _, s := range shares {
			best = max(best, s.index, s.tree)
		}
		s := share(bound)
		s.tree = max(s.tree, best, boundShare(h))
	}
	gap := costmodel.Kept(costmodel.Gap(routed, now), len(cands), func(i int) time.Duration { return v.period[i] })
	costOf := func(i int, held float64) float64 {
		if v.full[i] {
			return math.Inf(1)
		}
		return p.cm.Seconds(tokens*(1-held) + v.ahead[i] + costmodel.AtRisk(tokens, v.period[i], gap))
	}
	costs := v.costs[:0]
	for i := range cands { // costOf inlined: a call a candidate costs a large pool's pick microseconds
		costs = append(costs, p.cm.Seconds(tokens+v.ahead[i]+costmodel.AtRisk(tokens, v.period[i], gap)))
		if v.full[i] {
			costs[i] = math.Inf(1)
		}
	}
	for _, s := range shares {
		v.at[s.i] = -1
		v.read(s.i, now)
		costs[s.i] = costOf(s.i, max(s.index, s.tree))
	}
	defer func() { v.shares, v.costs = shares[:0], costs[:0] }()
	rank := func(i int) float64 { return costmodel.RendezvousRank(key, v.hash[i], v.weight[i], v.evenWeights) }
	recent := func(i int) (float64, bool) { return p.storedLately(cands[i], h, now) }
	pick := p.cm.Choose(costs, v.ahead, recent, rank, bound)
	for try := 0; try < 2; try++ {
		// The pick, read afresh, must still be as cheap as the view said (other replicas'
		// requests or this one's other pools may have filled it meanwhile), or the next is
		// looked for.
		was := costs[pick]
		v.read(pick, now)
		if costs[pick] = costOf(pick, heldOf(shares, pick)); costs[pick] <= p.cm.TieLimit(was) {
			break
		}
		pick = p.cm.Choose(costs, v.ahead, recent, rank, bound)
	}
	b := cands[pick]
	sh := heldOf(shares, pick)
	uncached := tokens * (1 - sh)
	cost := Cost{Uncached: uncached, Ahead: v.ahead[pick], Predicted: secondsToDuration(p.cm.Seconds(uncached + v.ahead[pick]))}
	if h.holds(cost) {
		return b, heldCost
	}
	v.took(pick, uncached)
	p.cm.NoteUncached(uncached)
	p.picked(b, h, sh)
	p.countTiers(p.viewOf(found, b, now))
	return b, cost
}

// heldOf is the share of the prompt candidate i holds, among shares.
func heldOf(shares []heldShare, i int) float64 {
	for _, s := range shares {
		if s.i == i {
			return max(s.index, s.tree)
		}
	}
	return 0
}

// pendingSince is when text routed to b starts to count besides its KV events: pendingGrace
// before its latest event while they are fresh; zero (all of it) for an engine without fresh
// events, or for a pick the index did not answer (found nil: no index, or no tokens).
func (p *CacheAware) pendingSince(found *kvcache.Matches, b *Backend, now time.Time) time.Time {
	if found == nil {
		return time.Time{}
	}
	e := b.kvEngineIn(p.index)
	last := e.LastEvent()
	if last.IsZero() || now.Sub(last) >= p.staleAfter {
		return time.Time{}
	}
	return pendingFrom(e, last)
}
