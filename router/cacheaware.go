package router

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/costmodel"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// CacheAware sends a request where its prompt's prefix is cached, unless that would unbalance
// the pool. It is two policies:
//
//   - cache_aware scores each candidate by the share of Hint.Text that the pool's tree of
//     routed text (kvcache.Tree) says the engine was sent before: an approximation that
//     needs nothing from the engines;
//   - precise_cache_aware scores by the share of Hint.Tokens whose blocks the engine holds
//     as its KV events tell (kvcache.Index), or of the text routed to it since just before
//     its latest event (blocks being computed, not yet told), if larger. An engine whose
//     events are stale (none for kv_events.stale_after), or a request without tokens, is
//     scored as cache_aware would.
//
// The best score wins if it reaches cache_threshold. A prompt that no engine holds, or holds
// less of than that, is placed (place): by the rendezvous order of its head with bounded
// loads, which every proxy replica computes alike, so that replicas send a new prefix to one
// engine rather than each to its own. Whenever the pool is out of balance (the most loaded
// candidate more than balance_abs_threshold requests above the least and more than
// balance_rel_threshold times as many), the least loaded wins: a burst sharing one prefix
// fills its engine until the pool is out of balance, then spreads, and the engines it spreads
// to hold the prefix from then on. Ties go to the less loaded. The load is the one load
// picture (Backend.loadScore): what the engines report, scraped every scrape_interval, plus
// this replica's requests since. Every pick's text is recorded in the tree for the engine
// picked.
type CacheAware struct {
	cfg  routerconfig.CacheAwareConfig
	tree *kvcache.Tree
	// next rotates ties among the least loaded.
	next atomic.Uint64
	// keyTokens is prefix_tokens: a prompt is placed by its first keyTokens tokens, or 4 ×
	// keyTokens bytes of its text.
	keyTokens int
	// loadFactor is bounded_load_factor.
	loadFactor float64

	// cm is the cost every candidate is weighed by (cost.go).
	cm *costmodel.Model
	// placementsShared: the replicas share where the heads of prompts went
	// (routerconfig.Config.SharedPlacements), so cache_aware spreads its ties however many
	// replicas there are.
	placementsShared bool

	// index is the precise view; nil for cache_aware.
	index      *kvcache.Index
	staleAfter time.Duration
	// now is the clock staleness is judged by; nil means time.Now.
	now func() time.Time
	// ratio observes the picked engine's predicted share; nil observes nothing.
	ratio prometheus.Observer
	// tierTokens counts the picked engine's matched tokens by tier (gpu, cpu, disk, other);
	// nil counts nothing.
	tierTokens *[4]prometheus.Counter

	// names are the names of the candidates of the latest pick of a large pool, by
	// namesOf, for the tree: they are nearly always the same, and a map of a thousand
	// names made on every pick would cost more than the pick.
	namesMu  sync.Mutex
	namesOf  []*Backend
	lastName *kvcache.Names
	// large, when set, is how many candidates make a pool large instead of largePool.
	large int
	// views are what the picks of a large pool keep of its candidates (selectLarge), the
	// most recently used first, under namesMu.
	views []*poolView
}

// Interface guards.
var (
	_ Policy       = (*CacheAware)(nil)
	_ poolWatcher  = (*CacheAware)(nil)
	_ forgetter    = (*CacheAware)(nil)
	_ pickRecorder = (*CacheAware)(nil)
)

// forgetter is implemented by policies that keep state per engine, to drop it when an engine
// goes down: it may come back with an empty cache.
type forgetter interface {
	Forget(backend string)
}

// NewCacheAware returns a cache_aware policy; with index set, precise_cache_aware, which
// counts an engine's blocks while its last event is more recent than staleAfter. cfg's zero
// fields take their defaults, and so do prefix_tokens and bounded_load_factor.
func NewCacheAware(cfg routerconfig.CacheAwareConfig, index *kvcache.Index, staleAfter time.Duration) *CacheAware {
	cfg = cfg.WithDefaults()
	if staleAfter <= 0 {
		staleAfter = routerconfig.DefaultKVEventsStaleAfter
	}
	// The model spreads ties by the work each engine did lately where storedLately knows it
	// and may (cost.go).
	return &CacheAware{cfg: cfg, tree: kvcache.NewTree(cfg.MaxTreeBytes), index: index, staleAfter: staleAfter,
		keyTokens: routerconfig.DefaultPrefixTokens, loadFactor: routerconfig.DefaultBoundedLoadFactor,
		cm: costmodel.New(cfg.PrefillOverhead, cfg.PrefillTokensPerSecond, float64(cfg.DecodeCostTokens), cfg.Temperature)}
}

// SetPool forgets the engines no longer in the pool.
func (p *CacheAware) SetPool(all []*Backend) {
	names := make(map[string]bool, len(all))
	for _, b := range all {
		names[b.Name] = true
	}
	p.tree.Retain(func(e string) bool { return names[e] })
	p.namesMu.Lock()
	p.namesOf, p.lastName, p.views = nil, nil, nil // keeps no backend of the pool before alive
	p.namesMu.Unlock()
}

// Forget drops what the approximate view holds of backend. The precise view is the router's,
// shared by the pools.
func (p *CacheAware) Forget(backend string) { p.tree.Forget(backend) }

// Picked records a pick the pool made without Select (a session's): its text was sent to b.
func (p *CacheAware) Picked(b *Backend, h Hint) { p.picked(b, h, -1) }

// Select implements Policy.
func (p *CacheAware) Select(cands []*Backend, h Hint) *Backend {
	b, _ := p.SelectCost(cands, h)
	return b
}

func (p *CacheAware) model() *costmodel.Model { return p.cm }

// SelectCost picks the candidate where h's prefill costs least (cost.go) and says what it
// predicted there.
func (p *CacheAware) SelectCost(cands []*Backend, h Hint) (*Backend, Cost) {
	if len(cands) == 0 {
		return nil, Cost{}
	}
	now := p.clock()
	key, keyed := p.tieKey(h)
	if !keyed {
		// No prompt to weigh: the least loaded, as least_loaded picks.
		b := leastLoadedOf(cands, now, &p.next, false)
		return b, Cost{} // nothing to book: it weighs as any request decoding there
	}
	if len(cands) > p.largeFrom() {
		return p.selectLarge(cands, h, key, now)
	}
	var loadBuf [candidatesOnStack]loadView
	bd := newBounds(cands, now, p.loadFactor, loadBuf[:])
	tokens := hintTokens(h)
	if p.unbalanced(bd.loads) {
		b := leastLoadedOf(cands, now, &p.next, false)
		cost := p.costOn(b, tokens, now)
		if h.holds(cost) {
			return b, heldCost
		}
		p.cm.NoteUncached(tokens)
		p.picked(b, h, -1)
		return b, cost
	}
	scratch := p.match(h)
	defer scratch.release()
	found := scratch.matches()
	var shareBuf, costBuf, aheadBuf [candidatesOnStack]float64
	shares, routed := p.score(cands, h, now, found, shareBuf[:0])
	costs, ahead := costBuf[:0], aheadBuf[:0]
	if n := len(cands); n > candidatesOnStack {
		costs, ahead = make([]float64, 0, n), make([]float64, 0, n)
	}
	bound := -1
	for i, b := range cands {
		if h.Bound != "" && b.Name == h.Bound {
			bound = i
		}
	}
	if bound >= 0 {
		// The engine the session is bound to had its earlier turns, through whichever
		// replica: it holds at least what any engine is known to hold of the conversation,
		// and what the session's latest request sent it.
		shares[bound] = max(slices.Max(shares), boundShare(h))
	}
	gap := costmodel.Kept(costmodel.Gap(routed, now), len(cands), func(i int) time.Duration { return cands[i].st.load.turnover.Period() })
	for i, b := range cands {
		a := b.workAhead(p.cm, now)
		ahead = append(ahead, a)
		c := p.cm.Seconds(tokens*(1-shares[i]) + a + costmodel.AtRisk(tokens, b.st.load.turnover.Period(), gap))
		if bd.loads[i].full {
			c = math.Inf(1) // a prefiller whose KV pool is nearly full: a last resort
		}
		costs = append(costs, c)
	}
	rank := func(i int) float64 {
		return costmodel.RendezvousRank(key, cands[i].nameHash, cands[i].Weight, bd.evenWeights)
	}
	recent := func(i int) (float64, bool) { return p.storedLately(cands[i], h, now) }
	pick := p.cm.Choose(costs, ahead, recent, rank, bound)
	b := cands[pick]
	uncached := tokens * (1 - shares[pick])
	cost := Cost{Uncached: uncached, Ahead: ahead[pick], Predicted: secondsToDuration(p.cm.Seconds(uncached + ahead[pick]))}
	if h.holds(cost) {
		return b, heldCost
	}
	p.picked(b, h, shares[pick])
	p.countTiers(p.viewOf(found, b, now))
	p.cm.NoteUncached(uncached)
	return b, cost
}

// storedLately is the blocks b computed lately, as its KV events tell, or as the picks sent
// it (this replica's, or every replica's where h.Sent has them), whichever is more: events
// come a moment after a prefill ends. For cache_aware, which reads no events, it is the
// uncached tokens sent b lately, ok where the replicas share placements or where b's engine
// served no request but this replica's lately (Backend.sole). ok is false when b's events are
// not known to be read (neither dialed nor heard from, though this replica sent it work): a
// count for some engines only would send all new work to one whose events never arrive. One
// nobody heard from and this replica never sent anything (just joined a pool whose engines
// dial kv_events.listen) computed nothing.
func (p *CacheAware) storedLately(b *Backend, h Hint, now time.Time) (blocks float64, ok bool) {
	sent := max(b.st.cost.sent.Value(now), h.Sent[b.Name])
	if p.index == nil {
		return sent, p.placementsShared || b.sole(now)
	}
	e := b.kvEngineIn(p.index)
	if !b.eventsDialed() && e.LastEvent().IsZero() && b.st.started.Load() > 0 {
		return 0, false
	}
	return max(e.StoredLately(now), sent/float64(p.index.BlockSize())), true
}

// boundShare is the share of h's text that the session's latest request sent its bound
// engine (Hint.BoundText).
func boundShare(h Hint) float64 {
	if h.BoundText <= 0 || h.Text == "" {
		return 0
	}
	return float64(min(h.BoundText, len(h.Text))) / float64(len(h.Text))
}

// tieKey is what near-equal costs are broken by: the session's key for a request of a
// session (its turns then stay together however their text grows), else the prompt's head
// (placementKey); ok is false for a request with neither.
func (p *CacheAware) tieKey(h Hint) (key uint64, ok bool) {
	if h.Session != "" {
		return xxhash.Sum64String(h.Session), true
	}
	return placementKey(h, p.keyTokens*bytesPerToken, p.keyTokens)
}

// costOn is the cost of a request of tokens uncached tokens on b at now: a pick that did not
// weigh the caches (the pool out of balance) books the whole prompt. The pick that takes it
// notes its tokens (costmodel.Model.NoteUncached).
func (p *CacheAware) costOn(b *Backend, tokens float64, now time.Time) Cost {
	a := b.workAhead(p.cm, now)
	return Cost{Uncached: tokens, Ahead: a, Predicted: secondsToDuration(p.cm.Seconds(tokens + a))}
}

func secondsToDuration(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// viewOf is what found says of b, zero if nothing or if b's events are stale.
func (p *CacheAware) viewOf(found *kvcache.Matches, b *Backend, now time.Time) kvcache.View {
	if found == nil {
		return kvcache.View{}
	}
	v := found.Of(b.kvEngineIn(p.index))
	if v.Last.IsZero() || now.Sub(v.Last) >= p.staleAfter {
		return kvcache.View{}
	}
	return v
}

// countTiers counts v's matched tokens by tier.
func (p *CacheAware) countTiers(v kvcache.View) {
	if p.tierTokens == nil {
		return
	}
	for i, n := range [4]int{v.GPU, v.CPU, v.Disk, v.Other} {
		if n > 0 {
			p.tierTokens[i].Add(float64(n))
		}
	}
}

// unbalanced is SGLang's router's test: both the absolute and the relative gap between the
// most and the least loaded candidate are over their thresholds.
func (p *CacheAware) unbalanced(loads []loadView) bool {
	lo, hi := loads[0].load, loads[0].load
	for _, v := range loads[1:] {
		lo, hi = min(lo, v.load), max(hi, v.load)
	}
	return p.cfg.OutOfBalance(lo, hi)
}

// pendingGrace is how long text routed to an engine counts for it besides its KV events: the
// blocks of a prompt are published once computed, so for a moment (its prefill) the engine
// holds what its events have not told yet. Without it, a burst sharing a new prefix would
// see it nowhere until the first prefill ends, and spread every request of it.
const pendingGrace = 2 * time.Second

// pendingFrom is from when text routed to engine e, whose latest KV event came at last,
// counts as blocks it is computing and has not told yet: pendingGrace before that event.
// Never for a hybrid model's engine (kvcache.Engine.Hybrid): what it reuses of a routed
// text depends on where a prompt ends, which the text cannot say, and only its events can.
func pendingFrom(e *kvcache.Engine, last time.Time) time.Time {
	if e.Hybrid() {
		return last.Add(100 * 365 * 24 * time.Hour)
	}
	return last.Add(-pendingGrace)
}

// creditsPlacements: b is credited with the heads placements name it for (Hint.Placed), as
// routed text counts: never a hybrid model's engine whose events are read (pendingFrom).
func (p *CacheAware) creditsPlacements(b *Backend) bool {
	return p.index == nil || !b.kvEngineIn(p.index).Hybrid()
}

// score appends each candidate's predicted share of h's prompt to out: for an engine whose
// KV events are fresh, the larger of the share of h.Tokens they say it holds, each block
// weighed by its tier (View.Weighted: a prompt on CPU scores below the same prompt on GPU
// and above nothing), and the share of h.Text routed to it since pendingGrace before its
// latest event; for another, the share of h.Text ever routed to it (that the tree still
// holds). found is what the index says of the request (p.match), nil without an index or
// tokens. It also returns when the text h continues was last routed (Tree.MatchSince).
func (p *CacheAware) score(cands []*Backend, h Hint, now time.Time, found *kvcache.Matches, out []float64) ([]float64, time.Time) {
	var textBuf [candidatesOnStack]int
	var nameBuf [candidatesOnStack]string
	var sinceBuf [candidatesOnStack]time.Time
	if n := len(cands); n > candidatesOnStack { // one allocation each, not a growth by doubling
		out = make([]float64, 0, n)
	}
	names, matched, since := nameBuf[:0], textBuf[:0], sinceBuf[:0]
	large := len(cands) > candidatesOnStack && h.Text != ""
	if large {
		matched, since = make([]int, 0, len(cands)), make([]time.Time, 0, len(cands))
	}
	for _, b := range cands {
		share, from := 0.0, time.Time{}
		if found != nil {
			v := found.Of(b.kvEngineIn(p.index))
			if !v.Last.IsZero() && now.Sub(v.Last) < p.staleAfter {
				share = v.Weighted / float64(len(h.Tokens))
				from = pendingFrom(b.kvEngineIn(p.index), v.Last)
			}
		}
		out = append(out, share)
		if h.Text != "" {
			if !large {
				names = append(names, b.Name)
			}
			matched = append(matched, 0)
			since = append(since, p.treeSince(b, from, now))
		}
	}
	if h.Text == "" {
		return out, time.Time{}
	}
	var routed time.Time
	if large {
		routed = p.tree.MatchNames(h.Text, p.namesFor(cands), since, matched)
	} else {
		routed = p.tree.MatchSince(h.Text, names, since, matched)
	}
	for i := range out {
		out[i] = max(out[i], float64(matched[i])/float64(len(h.Text)))
		if len(h.Placed) > 0 {
			out[i] = max(out[i], placedShare(h, cands[i].Name))
		}
	}
	return out, routed
}

// treeSince is from where text routed to b counts as cached there: from, for an engine whose
// KV events tell the rest; never longer ago than tree_ttl, past which the engine has likely
// evicted it, nor than the engine's turnover horizon (its pool has stored as many tokens as
// it has free since, by its own counts).
func (p *CacheAware) treeSince(b *Backend, from, now time.Time) time.Time {
	since := now.Add(-p.cfg.TreeTTL)
	if h := b.st.load.turnover.Horizon(); h.After(since) {
		since = h
	}
	if from.After(since) {
		return from
	}
	return since
}

// matchScratch is one pick's matcher and what the index answered it, reused from pick to
// pick: a 4,096-token prompt's keys and matches are a few kilobytes a pick otherwise.
type matchScratch struct {
	m     kvcache.Matcher
	found kvcache.Matches
}

var matchScratches = sync.Pool{New: func() any { return new(matchScratch) }}

// match asks the index, in one walk, what every engine holds of h's tokens under h's cache
// identity; nil without an index or tokens. The caller releases it.
func (p *CacheAware) match(h Hint) *matchScratch {
	if p.index == nil || len(h.Tokens) == 0 {
		return nil
	}
	s := matchScratches.Get().(*matchScratch)
	s.m.ResetFor(h.Tokens, h.cacheIdentity())
	p.index.MatchAll(&s.m, &s.found)
	return s
}

func (s *matchScratch) matches() *kvcache.Matches {
	if s == nil {
		return nil
	}
	return &s.found
}

func (s *matchScratch) release() {
	if s != nil {
		s.m.Reset(nil)
		matchScratches.Put(s)
	}
}

// namesFor returns the names of cands, those of the pick before when the candidates are
// the same.
func (p *CacheAware) namesFor(cands []*Backend) *kvcache.Names {
	p.namesMu.Lock()
	defer p.namesMu.Unlock()
	if p.lastName != nil && slices.Equal(p.namesOf, cands) {
		return p.lastName
	}
	list := make([]string, len(cands))
	for i, b := range cands {
		list[i] = b.Name
	}
	p.namesOf = append(p.namesOf[:0], cands...)
	p.lastName = kvcache.NewNames(list)
	return p.lastName
}

func (p *CacheAware) largeFrom() int {
	if p.large > 0 {
		return p.large
	}
	return largePool
}

func (p *CacheAware) clock() time.Time {
	if p.now != nil {
		return p.now()
	}
	return time.Now()
}

// picked records the pick's text for b and observes its share (negative: not scored, as
// when the pool was out of balance).
func (p *CacheAware) picked(b *Backend, h Hint, share float64) {
	if b == nil {
		return
	}
	p.tree.InsertAt(h.Text, b.Name, p.clock())
	if p.ratio != nil && share >= 0 {
		p.ratio.Observe(share)
	}
}

// PrefixCacheStatus is what the proxy believes a backend's prefix cache holds, in GET
// /debug/backends: shown for the backends of a pool whose policy is cache_aware or
// precise_cache_aware.
type PrefixCacheStatus struct {
	// TreeBytes is how many bytes of text routed to the backend the approximate view holds.
	TreeBytes int `json:"tree_bytes"`
	// Blocks is how many KV blocks the backend holds as its KV events told; absent when the
	// proxy has none of its events.
	Blocks *int `json:"blocks,omitempty"`
	// BlocksByMedium splits Blocks by the tier of their medium, as kv_events.tier_weights
	// names them: "gpu", "cpu", "disk", a tier of its own, or "other" for media of none
	// (which count as not held); tiers without blocks are left out.
	BlocksByMedium map[string]int `json:"blocks_by_medium,omitempty"`
	// BlockSize is the block size of the backend's latest stored blocks.
	BlockSize int `json:"block_size,omitempty"`
	// LastEventAgeSeconds is how long ago the backend's latest KV event came.
	LastEventAgeSeconds *float64 `json:"last_event_age_seconds,omitempty"`
	// Stale is true when the backend's events are too old to count (kv_events.stale_after):
	// it is scored by the approximate view.
	Stale bool `json:"stale,omitempty"`
}

// prefixCacheStatus is b's PrefixCacheStatus under policy p at now.
func (p *CacheAware) prefixCacheStatus(b *Backend, now time.Time) *PrefixCacheStatus {
	s := &PrefixCacheStatus{TreeBytes: p.tree.EngineBytes(b.Name)}
	if p.index == nil {
		return s
	}
	st, ok := p.index.Stats(b.Name)
	if !ok {
		s.Stale = true
		return s
	}
	s.Blocks, s.BlockSize, s.BlocksByMedium = &st.Blocks, st.BlockSize, st.BlocksByTier
	if !st.Last.IsZero() {
		age := now.Sub(st.Last)
		secs := age.Seconds()
		s.LastEventAgeSeconds = &secs
		s.Stale = age >= p.staleAfter
	} else {
		s.Stale = true
	}
	return s
}
