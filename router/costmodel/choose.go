package costmodel

import (
	"math"
	"math/rand/v2"
)

const (
	// tieShare: costs within this share of the lowest tie. Replicas' fitted lines differ a
	// little; without it they would break the ties of an idle pool each its own way.
	tieShare = 0.05
	// tieTokens: a difference of fewer prompt tokens is a tie too. A few tokens matched of a
	// prompt's head (a chat's opening bytes, a block) save nothing a user would notice, and
	// replicas whose views of the caches differ by so little must still place alike.
	tieTokens = 64
	// spreadShare: among the ties spread, engines whose blocks computed lately are
	// within this share of the fewest's are alike, and the rank order decides between them:
	// replicas whose counts differ by the last moment's place alike.
	spreadShare = 0.1
	// SpreadChoices: ties are spread among this many engines, the first in the rank order,
	// not the whole pool: as good a spread as all of them give (the power of a few choices),
	// at the cost of a few reads in a pool of a thousand.
	SpreadChoices = 8
)

// Choose is the index of the candidate to pick among costs (in seconds, Seconds), each with
// the work ahead of it in tokens: the lowest, or with preferred (-1 for none) among the
// near-equal ones (TieLimit), preferred; else among them those with the least work ahead
// (within tieTokens: what the pick adds to is then spread), and of those the SpreadChoices
// first in the rank order (the highest ranks): where recent (nil: none) says for each of them
// how many blocks it computed lately, the first of them within spreadShare of the fewest;
// else the first. recent's ok false for any of them leaves the rank order alone. With a
// temperature, drawn by weight.
func (m *Model) Choose(costs, ahead []float64, recent func(i int) (blocks float64, ok bool), rank func(i int) float64, preferred int) int {
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
	limit := m.TieLimit(costs[lo])
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
	var top Top
	for i, c := range costs {
		if c <= limit && ahead[i] <= least+tieTokens {
			top.Offer(i, rank)
		}
	}
	n := top.n
	if recent == nil || n == 1 {
		return top.top[0].i
	}
	var blocks [SpreadChoices]float64
	fewest := math.Inf(1)
	for k := range n {
		v, ok := recent(top.top[k].i)
		if !ok {
			return top.top[0].i
		}
		blocks[k], fewest = v, min(fewest, v)
	}
	for k := range n {
		if blocks[k] <= fewest*(1+spreadShare) {
			return top.top[k].i
		}
	}
	return top.top[0].i
}

// ranked is a candidate's index and its rank.
type ranked struct {
	i    int
	rank float64
}

// Top keeps the SpreadChoices candidates of the highest ranks offered, highest first.
type Top struct {
	top [SpreadChoices]ranked
	n   int
}

// Offer offers candidate i, ranked by rank(i).
func (t *Top) Offer(i int, rank func(i int) float64) {
	r := ranked{i, rank(i)}
	if t.n == len(t.top) && r.rank <= t.top[t.n-1].rank {
		return
	}
	k := min(t.n, len(t.top)-1)
	for ; k > 0 && t.top[k-1].rank < r.rank; k-- {
		t.top[k] = t.top[k-1]
	}
	t.top[k] = r
	t.n = min(t.n+1, len(t.top))
}

// Indexes are the candidates kept, highest rank first.
func (t *Top) Indexes() []int {
	out := make([]int, t.n)
	for k := range t.n {
		out[k] = t.top[k].i
	}
	return out
}

// TieLimit is the highest cost, in seconds, that ties with lowest: within tieShare of its
// work (the part past the fixed part), or tieTokens, whichever is more.
func (m *Model) TieLimit(lowest float64) float64 {
	return lowest + max(tieShare*(lowest-m.Fixed()), tieTokens*m.Rate())
}
