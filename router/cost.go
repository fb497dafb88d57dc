package router

import (
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/internal/decay"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Placing a request by what its prefill will cost: the cache-aware policies give every
// candidate one number, the time to the request's first token there, and the lowest wins.
//
//	cost = fixed + (uncached + ahead) × time per token
//
// uncached is the prompt tokens the engine would compute for this request (those its prefix
// cache does not hold as the policy's view says, a block on a slower tier weighed by its
// reload); ahead is the work queued or running there before it, in the same tokens: this
// replica's own books (the uncached tokens of the requests it sent there whose prefill has
// not ended, less what the engine has computed of them since, one after another), the
// requests the engine reports beyond those (other replicas', from its scraped waiting and
// running counts, a waiting one at the pool's mean uncached tokens, a running decode at
// decode_cost_tokens), and decode_cost_tokens for each of this replica's requests decoding
// there. The time per token and the fixed part are a line fitted through the pool's prefills
// as the proxy sees them (each one's work against the time to its end), from
// prefill_tokens_per_second and prefill_overhead. Caching is worth exactly what it saves in
// that sum: a hot shared preamble held everywhere saves the same everywhere, and the load
// decides; a long private context held on one engine keeps its conversation there until the
// queue there outweighs it.
//
// Costs whose work (past the fixed part) is within tieShare of the lowest's, or within
// tieTokens of it, are ties: the engine a session is bound to first, then those with the
// least work ahead, within tieTokens (a hot prompt held on one engine spreads rather than
// queue there for a saving too small to tell); then the rendezvous order of the request's key
// (its session's, else its prompt's head), which every replica computes alike. Under
// precise_cache_aware, where every candidate's KV events are read, that order is taken among
// the spreadChoices first in it by the blocks each computed lately (kvcache.Engine.StoredLately,
// or what this replica sent it where more, its events not told yet): the first within
// spreadShare of the fewest. Conversations and
// prompt groups new to the pool so go where the least work went, and none gets a double share
// by the luck of a hash; replicas still place alike, reading the same events, and a group that
// went to an engine stays there by its blocks, which every replica sees. cache_aware sees only
// the text it routed: to a replica, a group another replica routed looks new, and spread so it
// would go elsewhere; it keeps the rendezvous order alone. With a temperature the pick is
// instead drawn with weights exp(-(cost - lowest) / temperature), so
// that replicas do not all herd onto one engine between two scrapes.

const (
	// tieShare: costs within this share of the lowest tie. Replicas' fitted lines differ a
	// little; without it they would break the ties of an idle pool each its own way.
	tieShare = 0.05
	// tieTokens: a difference of fewer prompt tokens is a tie too. A few tokens matched of a
	// prompt's head (a chat's opening bytes, a block) save nothing a user would notice, and
	// replicas whose views of the caches differ by so little must still place alike.
	tieTokens = 64
	// spreadShare: among the ties a model spreads, engines whose blocks computed lately are
	// within this share of the fewest's are alike, and the rendezvous order decides between
	// them: replicas whose reading of the events differs by the last moment's place alike.
	spreadShare = 0.1
	// spreadChoices: ties are spread among this many engines, the first in the rendezvous
	// order of the request's key, not the whole pool: as good a spread as all of them give
	// (the power of a few choices), at the cost of a few reads in a pool of a thousand.
	spreadChoices = 8
	// learnWeight is the weight of one observation in an engine's own rate (its metric) and
	// in the pool's mean uncached tokens.
	learnWeight = 0.1
	// minLearnTokens: a prefill of less work than this says more about the overhead and the
	// network than about the rate, and teaches nothing.
	minLearnTokens = 128
	// learnClamp bounds how far one observation may pull the rate, either way.
	learnClamp = 8
)

// costModel is one pool's cost settings and what it learns across engines.
type costModel struct {
	overhead     time.Duration
	secPerToken  float64 // prefill_tokens_per_second's inverse
	decodeTokens float64
	temperature  float64 // seconds; 0 picks the lowest
	// spread, for a policy that sees the engines' caches by their KV events, spreads ties by
	// the blocks each engine computed lately (choose).
	spread bool
	// meanUncached is the mean uncached tokens of the pool's picks (float64 bits), what a
	// request the engine reports and this replica did not send is taken to weigh.
	meanUncached atomic.Uint64
	// fit is the line through the pool's prefills: its time per token and fixed part.
	fit fit
	// late is the 90th percentile of how much later than predicted the pool's prefills
	// ended, in seconds (float64 bits; 0 for early): what a TTFT bound keeps in hand.
	late atomic.Uint64
}

// lateStep is how far one prefill moves the tracked 90th percentile of lateness.
const lateStep = 0.001

// noteLate tracks the 90th percentile of the predictions' lateness by stochastic
// approximation: a prefill later than it raises it by 9 steps, one not later lowers it by 1,
// which settles where one prefill in ten is later.
func (m *costModel) noteLate(late float64) {
	for {
		old := m.late.Load()
		q := math.Float64frombits(old)
		next := q - lateStep
		if late > q {
			next = q + 9*lateStep
		}
		if m.late.CompareAndSwap(old, math.Float64bits(max(next, 0))) {
			return
		}
	}
}

// lateness is the tracked 90th percentile of the predictions' lateness.
func (m *costModel) lateness() time.Duration {
	return time.Duration(math.Float64frombits(m.late.Load()) * float64(time.Second))
}

func newCostModel(cfg routerconfig.CacheAwareConfig, spread bool) *costModel {
	m := &costModel{
		overhead:     cfg.PrefillOverhead,
		secPerToken:  1 / cfg.PrefillTokensPerSecond,
		decodeTokens: float64(cfg.DecodeCostTokens),
		temperature:  cfg.Temperature.Seconds(),
		spread:       spread,
	}
	m.fit.slope0, m.fit.intercept0 = m.secPerToken, m.overhead.Seconds()
	return m
}

// Cost is what a pick predicted of the request on the backend it picked: the request's own
// uncached prompt tokens there, the work ahead of it (in tokens), and the predicted time to
// its prefill's end. The zero Cost is a pick no cost was computed for.
type Cost struct {
	Uncached  float64
	Ahead     float64
	Predicted time.Duration
	// held: the pick was not taken, its hint's admit refusing it (the TTFT bound); the
	// policy recorded nothing of it.
	held bool
}

// costSelector is implemented by the policies that pick by cost: the pool hands the pick's
// Cost to the lease, whose prefill's end then settles the books and teaches the rate.
type costSelector interface {
	SelectCost(cands []*Backend, h Hint) (*Backend, Cost)
	model() *costModel
}

// rate is the prefill time per token every engine of the pool is weighed at: the pool's
// fit of its engines' prefills, the configured rate before there are enough of them. One rate
// for the pool: an engine's own rate learned apart goes stale while the engine is not picked,
// and the engines that are picked learn faster ones, so that the first engines to serve
// would look faster than the others for ever and take everything. Each engine's own rate is
// learned for its metric (pdproxy_backend_prefill_tokens_per_second).
func (m *costModel) rate(*Backend) float64 {
	slope, _ := m.fit.line()
	return slope
}

// fixed is the fixed part of a prefill's time, as fitted, prefill_overhead before.
func (m *costModel) fixed() float64 {
	_, intercept := m.fit.line()
	return intercept
}

// fit is a least-squares line through a pool's prefills, time against work, each lesson
// weighing fitWeight (more while there are fewer than 1/fitWeight): its slope is the time per
// token, its intercept the fixed part. The line is worked out at each lesson and read without
// the lock: every candidate of every pick reads it.
type fit struct {
	mu               sync.Mutex
	n                float64
	mx, my, mxx, mxy float64
	// slope and intercept are the line as of the latest lesson (float64 bits; slope 0 while
	// there are fewer than fitLessons).
	slope, intercept atomic.Uint64
	// slope0, intercept0 are the configured line, set before the first lesson.
	slope0, intercept0 float64
}

const (
	fitWeight = 0.05
	// fitLessons: before so many lessons, the configured line.
	fitLessons = 8
)

func (f *fit) add(x, y float64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
	a := max(1/f.n, fitWeight)
	f.mx += a * (x - f.mx)
	f.my += a * (y - f.my)
	f.mxx += a * (x*x - f.mxx)
	f.mxy += a * (x*y - f.mxy)
	if f.n < fitLessons || f.mx <= 0 {
		return
	}
	// While the prefills' work is too alike to part the two (its spread under a tenth of its
	// mean), the configured intercept and the slope through the mean past it; the slope
	// within learnClamp² of the configured one, the intercept at least 0.
	clamp := func(s float64) float64 {
		return min(max(s, f.slope0/(learnClamp*learnClamp)), f.slope0*learnClamp*learnClamp)
	}
	slope, intercept := clamp((f.my-f.intercept0)/f.mx), f.intercept0
	if v := f.mxx - f.mx*f.mx; v >= 0.01*f.mx*f.mx {
		slope = clamp((f.mxy - f.mx*f.my) / v)
		intercept = max(f.my-slope*f.mx, 0)
	}
	f.slope.Store(math.Float64bits(slope))
	f.intercept.Store(math.Float64bits(intercept))
}

// line is the fitted slope and intercept, the configured ones before fitLessons lessons.
func (f *fit) line() (slope, intercept float64) {
	if s := math.Float64frombits(f.slope.Load()); s > 0 {
		return s, math.Float64frombits(f.intercept.Load())
	}
	return f.slope0, f.intercept0
}

// ahead is the work b has ahead of a new request at now, in prefill tokens.
func (m *costModel) ahead(b *Backend, now time.Time) float64 {
	remaining, pending := b.st.cost.books.remaining(now, m.rate(b))
	inflight := b.Inflight()
	work := remaining + m.decodeTokens*float64(max(inflight-pending, 0))
	if l := b.st.load.last.Load(); l != nil && now.Before(l.staleAt) {
		// What the engine reports beyond this replica's own: other replicas' requests.
		score, _, _ := b.loadScore(now)
		if extra := score - inflight; extra > 0 {
			waiting := float64(extra)
			if total := l.waiting + l.running; total > 0 {
				waiting = float64(extra) * float64(l.waiting) / float64(total)
			}
			running := float64(extra) - waiting
			mean := math.Float64frombits(m.meanUncached.Load())
			if b.Role == routerconfig.RolePrefill {
				// A prefiller's running requests are prefills, half done on average.
				work += waiting*mean + running*mean/2
			} else {
				work += waiting*mean + running*m.decodeTokens
			}
		}
	}
	return work
}

// seconds is the predicted time to the first token on b of a request of work tokens
// (its own uncached and those ahead).
func (m *costModel) seconds(b *Backend, work float64) float64 {
	return m.fixed() + work*m.rate(b)
}

// noteUncached folds a pick's uncached tokens into the pool's mean.
func (m *costModel) noteUncached(u float64) {
	for {
		old := m.meanUncached.Load()
		mean := math.Float64frombits(old)
		next := mean + learnWeight*(u-mean)
		if mean == 0 {
			next = u
		}
		if m.meanUncached.CompareAndSwap(old, math.Float64bits(next)) {
			return
		}
	}
}

// learn teaches b's rate one prefill: work tokens (its own and those ahead at its pick)
// that took observed.
func (m *costModel) learn(b *Backend, work float64, observed time.Duration) {
	if work < minLearnTokens {
		return
	}
	m.fit.add(work, observed.Seconds())
	// The engine's own rate, past the pool's fixed part: for its metric.
	fold(&b.st.cost.secPerToken, (observed.Seconds()-m.fixed())/work, m.rate(b))
}

// fold moves the rate at bits one lesson's weight toward sample (within learnClamp of it),
// from start when it has none yet.
func fold(bits *atomic.Uint64, sample, start float64) {
	for {
		old := bits.Load()
		cur := math.Float64frombits(old)
		if cur <= 0 {
			cur = start
		}
		clamped := min(max(sample, cur/learnClamp), cur*learnClamp)
		next := cur + learnWeight*(clamped-cur)
		if bits.CompareAndSwap(old, math.Float64bits(next)) {
			return
		}
	}
}

// choose is the index of the candidate to pick among costs: the lowest, or with preferred
// (-1 for none) among the near-equal ones, preferred; else among them those with the least
// work ahead (within tieTokens: what the pick adds to is then spread), and of those the
// spreadChoices first in the rendezvous order (the highest ranks): where the model spreads
// and recent (nil: none) says for each of them what it computed lately, the first of them
// within spreadShare of the fewest blocks; else the first. With a temperature, drawn by
// weight.
func (m *costModel) choose(costs, ahead []float64, recent func(i int) (blocks float64, ok bool), rank func(i int) float64, preferred int) int {
	lo := 0
	for i, c := range costs {
		if c < costs[lo] {
			lo = i
		}
	}
	if m.temperature > 0 && !math.IsInf(costs[lo], 1) {
		total := 0.0
		for _, c := range costs {
			total += math.Exp(-(c - costs[lo]) / m.temperature)
		}
		x := rand.Float64() * total
		for i, c := range costs {
			if x -= math.Exp(-(c - costs[lo]) / m.temperature); x <= 0 {
				return i
			}
		}
		return lo
	}
	limit := m.tieLimit(costs[lo])
	if preferred >= 0 && costs[preferred] <= limit {
		return preferred
	}
	least := math.Inf(1)
	for i, c := range costs {
		if c <= limit {
			least = min(least, ahead[i])
		}
	}
	// The highest ranks among the ties, highest first.
	var top [spreadChoices]ranked
	n := 0
	for i, c := range costs {
		if c > limit || ahead[i] > least+tieTokens {
			continue
		}
		r := ranked{i, rank(i)}
		if n == len(top) && r.rank <= top[n-1].rank {
			continue
		}
		k := min(n, len(top)-1)
		for ; k > 0 && top[k-1].rank < r.rank; k-- {
			top[k] = top[k-1]
		}
		top[k] = r
		n = min(n+1, len(top))
	}
	if !m.spread || recent == nil || n == 1 {
		return top[0].i
	}
	var blocks [spreadChoices]float64
	fewest := math.Inf(1)
	for k := range n {
		v, ok := recent(top[k].i)
		if !ok {
			return top[0].i
		}
		blocks[k], fewest = v, min(fewest, v)
	}
	for k := range n {
		if blocks[k] <= fewest*(1+spreadShare) {
			return top[k].i
		}
	}
	return top[0].i
}

// ranked is a candidate's index and its rank in the rendezvous order.
type ranked struct {
	i    int
	rank float64
}

// tieLimit is the highest cost that ties with lowest: within tieShare of its work (the part
// past the overhead), or tieTokens, whichever is more.
func (m *costModel) tieLimit(lowest float64) float64 {
	return lowest + max(tieShare*(lowest-m.fixed()), tieTokens*m.rate(nil))
}

// hintTokens is how many tokens h's prompt has: its tokens where the proxy has them, else
// its text at bytesPerToken.
func hintTokens(h Hint) float64 {
	if len(h.Tokens) > 0 {
		return float64(len(h.Tokens))
	}
	return float64(len(h.Text)) / bytesPerToken
}

// costState is what the cost policies keep of one engine: this replica's books of the
// requests picked by cost whose prefill has not ended there; the engine's prefill time per
// token as its lessons show it (its metric: picks weigh the pool's) and the latest pick's
// prediction in seconds (both float64 bits, 0 until the first); and, where the pool spreads
// its ties, the uncached tokens this replica sent it lately (storedLately).
type costState struct {
	books                      books
	secPerToken, predictedTTFT atomic.Uint64
	sent                       decay.Count
}

// books are one backend's entries of requests whose prefill has not ended, in the order
// they were booked.
type books struct {
	// n is len(entries), read without the lock: most engines of a large pool have no entry
	// at a pick, and every candidate's books are read.
	n       atomic.Int64
	mu      sync.Mutex
	entries []*booked
	tokens  int64
}

// remaining is the work the entries leave at now, in tokens, had the engine computed them
// one after another from the first's booking at secPerToken (as an engine's compute is
// shared: a prefill that began a while ago has done part of its work), and how many entries
// there are. An entry the engine should have done by now but whose prefill has not ended
// (waiting for a slot, or the engine slower than learned) counts for nothing: the lesson of
// its end corrects the rate.
func (bs *books) remaining(now time.Time, secPerToken float64) (tokens float64, entries int64) {
	if bs.n.Load() == 0 {
		return 0, 0
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	var free time.Time // when the entries before the one at hand are done
	for _, e := range bs.entries {
		start := e.at
		if free.After(start) {
			start = free
		}
		free = start.Add(time.Duration(float64(e.tokens) * secPerToken * float64(time.Second)))
		if free.After(now) {
			if now.After(start) {
				tokens += free.Sub(now).Seconds() / secPerToken
			} else {
				tokens += float64(e.tokens)
			}
		}
	}
	return tokens, int64(len(bs.entries))
}

func (bs *books) add(bk *booked) {
	bs.mu.Lock()
	bs.entries = append(bs.entries, bk)
	bs.tokens += bk.tokens
	bs.n.Store(int64(len(bs.entries)))
	bs.mu.Unlock()
}

func (bs *books) remove(bk *booked) {
	bs.mu.Lock()
	if i := slices.Index(bs.entries, bk); i >= 0 {
		bs.entries = slices.Delete(bs.entries, i, i+1)
		bs.tokens -= bk.tokens
		bs.n.Store(int64(len(bs.entries)))
	}
	bs.mu.Unlock()
}

// totals are the entries' uncached tokens and how many there are.
func (bs *books) totals() (tokens, entries int64) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	return bs.tokens, int64(len(bs.entries))
}

// booked is a lease's entry in its backend's books: the pick's cost, until its prefill ends.
type booked struct {
	m      *costModel
	cost   Cost
	at     time.Time
	tokens int64
	done   atomic.Bool
}

// book enters cost in b's books at now.
func book(m *costModel, b *Backend, cost Cost, now time.Time) *booked {
	bk := &booked{m: m, cost: cost, at: now, tokens: int64(math.Round(cost.Uncached))}
	b.st.cost.books.add(bk)
	if m.spread && cost.Uncached > 0 {
		b.st.cost.sent.Add(now, cost.Uncached)
	}
	b.st.cost.predictedTTFT.Store(math.Float64bits(cost.Predicted.Seconds()))
	return bk
}

// settle takes the entry out of b's books, once; with learn, the prefill ended at now and
// teaches b's rate and the prediction's error.
func (bk *booked) settle(r *Router, b *Backend, now time.Time, learn bool) {
	if bk == nil || !bk.done.CompareAndSwap(false, true) {
		return
	}
	b.st.cost.books.remove(bk)
	if !learn {
		return
	}
	observed := now.Sub(bk.at)
	bk.m.learn(b, bk.cost.Uncached+bk.cost.Ahead, observed)
	bk.m.noteLate((observed - bk.cost.Predicted).Seconds())
	r.metrics.predictionError.WithLabelValues(b.Name, string(b.Role)).Observe((observed - bk.cost.Predicted).Seconds())
}

// CostStatus is a backend's cost figures in GET /debug/backends, for a pool that picks by
// cost: what a new request would find there now.
type CostStatus struct {
	// AheadTokens is the work ahead of a new request, in prefill tokens.
	AheadTokens float64 `json:"ahead_tokens"`
	// PendingTokens and PendingRequests are this replica's requests sent there whose
	// prefill has not ended, and their uncached tokens.
	PendingTokens   int64 `json:"pending_tokens"`
	PendingRequests int64 `json:"pending_requests"`
	// PrefillTokensPerSecond is the engine's prefill rate, as learned.
	PrefillTokensPerSecond float64 `json:"prefill_tokens_per_second"`
	// PredictedTTFTSeconds is the prediction of the latest pick of the backend.
	PredictedTTFTSeconds float64 `json:"predicted_ttft_seconds"`
}

func (m *costModel) status(b *Backend, now time.Time) *CostStatus {
	tokens, entries := b.st.cost.books.totals()
	return &CostStatus{
		AheadTokens:            m.ahead(b, now),
		PendingTokens:          tokens,
		PendingRequests:        entries,
		PrefillTokensPerSecond: 1 / m.rate(b),
		PredictedTTFTSeconds:   math.Float64frombits(b.st.cost.predictedTTFT.Load()),
	}
}
