package router

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/internal/decay"
	"github.com/pdproxy/pdproxy/router/costmodel"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Placing a request by what its prefill will cost: the cache-aware policies give every
// candidate the cost of the costmodel package, the time to the request's first token there,
// and the lowest wins. What its terms are here:
//
// uncached is the prompt tokens the engine would compute for this request (those its prefix
// cache does not hold as the policy's view says, a block on a slower tier weighed by its
// reload); ahead is the work queued or running there before it, in the same tokens: this
// replica's own books (the uncached tokens of the requests it sent there whose prefill has not
// ended, less what the engine has computed of them since, one after another),
// decode_cost_tokens for each of this replica's requests decoding there, and the requests the
// engine reports beyond those (other replicas', from its scraped waiting and running counts):
// a waiting one weighs what this replica's own pending requests there weigh now on average, as
// they wait in the same queue, or where it has none there the pool's mean uncached tokens less
// what the engine has computed since the scrape; a running decode, decode_cost_tokens. The
// pool's line starts from prefill_tokens_per_second and prefill_overhead, and learns from each
// prefill as the proxy sees it, to its end (Lease.Prefilled). Beside the time, a pick weighs
// the prompt's tokens the engine would evict before the conversation's next turn
// (costmodel.AtRisk, Kept); the prediction leaves them out.
//
// Among ties, the engine a session is bound to is preferred, and the rank order is the
// rendezvous order of the request's key (its session's, else its prompt's head), which every
// replica computes alike. Under precise_cache_aware, where every candidate's KV events are
// read, the model spreads the ties by the blocks each computed lately
// (kvcache.Engine.StoredLately, or what this replica sent it where more, its events not told
// yet). Conversations and prompt groups new to the pool so go where the least work went;
// replicas still place alike, reading the same events, and a group that went to an engine
// stays there by its blocks, which every replica sees. cache_aware sees only the text it
// routed: to a replica, a group another replica routed looks new. It spreads its ties, by the
// uncached tokens this replica sent each engine lately, only where the replicas share where
// the heads of prompts went (heads.go) or where no other replica sends the engines work
// (Backend.sole); else it keeps the rendezvous order. A temperature draws the pick by weight.

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
	model() *costmodel.Model
}

// workAhead is the work b has ahead of a new request at now under m, in prefill tokens.
func (b *Backend) workAhead(m *costmodel.Model, now time.Time) float64 {
	remaining, pending := b.st.cost.books.Remaining(now, m.Rate())
	inflight := b.Inflight()
	work := remaining + m.DecodeTokens()*float64(max(inflight-pending, 0))
	if l := b.st.load.last.Load(); l != nil && now.Before(l.staleAt) {
		// What the engine reports beyond this replica's own: other replicas' requests.
		score, _, _ := b.loadScore(now)
		if extra := score - inflight; extra > 0 {
			waiting := float64(extra)
			if total := l.Waiting + l.Running; total > 0 {
				waiting = float64(extra) * float64(l.Waiting) / float64(total)
			}
			running := float64(extra) - waiting
			each := m.MeanUncached()
			if pending > 0 {
				each = remaining / float64(pending)
			}
			prefill := waiting * each
			if b.Role == routerconfig.RolePrefill {
				// A prefiller's running requests are prefills, half done on average.
				prefill += running * each / 2
			} else {
				work += running * m.DecodeTokens()
			}
			if pending == 0 {
				prefill = max(prefill-now.Sub(l.at).Seconds()/m.Rate(), 0)
			}
			work += prefill
		}
	}
	return work
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
// prediction in seconds (float64 bits, 0 until the first); and, where the pool spreads its
// ties, the uncached tokens this replica sent it lately (storedLately).
type costState struct {
	books         costmodel.Books
	rate          costmodel.EngineRate
	predictedTTFT atomic.Uint64
	sent          decay.Count
}

// booked is a lease's entry in its backend's books: the pick's cost, until its prefill ends.
type booked struct {
	entry costmodel.Entry
	m     *costmodel.Model
	cost  Cost
	done  atomic.Bool
}

// book enters cost in b's books at now.
func book(m *costmodel.Model, b *Backend, cost Cost, now time.Time) *booked {
	bk := &booked{entry: costmodel.Entry{At: now, Tokens: int64(math.Round(cost.Uncached))}, m: m, cost: cost}
	b.st.cost.books.Add(&bk.entry)
	if cost.Uncached > 0 {
		b.st.cost.sent.Add(now, cost.Uncached)
	}
	b.st.cost.predictedTTFT.Store(math.Float64bits(cost.Predicted.Seconds()))
	return bk
}

// settle takes the entry out of b's books, once; with learn, the prefill ended at now and
// teaches the pool's line, b's own rate and the prediction's error.
func (bk *booked) settle(r *Router, b *Backend, now time.Time, learn bool) {
	if bk == nil || !bk.done.CompareAndSwap(false, true) {
		return
	}
	b.st.cost.books.Remove(&bk.entry)
	if !learn {
		return
	}
	observed := now.Sub(bk.entry.At)
	if work := bk.cost.Uncached + bk.cost.Ahead; bk.m.Learn(work, observed) {
		// The engine's own rate, past the pool's fixed part: for its metric.
		b.st.cost.rate.Fold((observed.Seconds()-bk.m.Fixed())/work, bk.m.Rate())
	}
	bk.m.NoteLate(observed - bk.cost.Predicted)
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

// costStatus is b's CostStatus at now under m.
func (b *Backend) costStatus(m *costmodel.Model, now time.Time) *CostStatus {
	tokens, entries := b.st.cost.books.Totals()
	return &CostStatus{
		AheadTokens:            b.workAhead(m, now),
		PendingTokens:          tokens,
		PendingRequests:        entries,
		PrefillTokensPerSecond: 1 / m.Rate(),
		PredictedTTFTSeconds:   math.Float64frombits(b.st.cost.predictedTTFT.Load()),
	}
}
