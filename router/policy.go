package router

import (
	"hash/fnv"
	"math/rand/v2"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/pdproxy/pdproxy/router/costmodel"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Policy picks one backend among candidates. The router passes only candidates it may
// use (healthy, not ejected, not excluded, under their in-flight limit), at least one,
// and calls Select under its pool's lock. A policy must return one of cands, must not
// keep the slice (the router reuses it), and reads in-flight counts that other pools'
// releases may change at any moment, so it must tolerate them moving.
type Policy interface {
	Select(cands []*Backend, h Hint) *Backend
}

// poolWatcher is implemented by policies that precompute over the whole pool (the
// prefix ring), so that a backend leaving the candidates for a moment does not cost a
// rebuild.
type poolWatcher interface {
	SetPool(all []*Backend)
}

// Interface guards.
var (
	_ Policy      = (*LeastInflight)(nil)
	_ Policy      = (*RoundRobin)(nil)
	_ Policy      = (*PowerOfTwo)(nil)
	_ Policy      = (*PrefixAffinity)(nil)
	_ poolWatcher = (*PrefixAffinity)(nil)
)

// LeastInflight picks the backend with the fewest in-flight requests. Ties go to the
// higher weight, then rotate, so that an idle pool spreads load instead of piling onto
// the first backend.
type LeastInflight struct {
	next atomic.Uint64
}

// Select implements Policy. It makes three passes rather than collecting the ties in a
// slice so that the hot path does not allocate.
func (p *LeastInflight) Select(cands []*Backend, _ Hint) *Backend {
	if len(cands) == 0 {
		return nil
	}
	better := func(b *Backend, n int64, w int) bool {
		return b.Inflight() < n || (b.Inflight() == n && b.Weight > w)
	}
	bestN, bestW := cands[0].Inflight(), cands[0].Weight
	for _, b := range cands[1:] {
		if better(b, bestN, bestW) {
			bestN, bestW = b.Inflight(), b.Weight
		}
	}
	ties := 0
	for _, b := range cands {
		if b.Inflight() == bestN && b.Weight == bestW {
			ties++
		}
	}
	k := int((p.next.Add(1) - 1) % uint64(max(ties, 1)))
	for _, b := range cands {
		if b.Inflight() == bestN && b.Weight == bestW {
			if k == 0 {
				return b
			}
			k--
		}
	}
	// In-flight counts of other pools' leases moved between passes; any candidate
	// is a fine answer then.
	return cands[0]
}

// RoundRobin rotates through candidates in proportion to their weights (nginx's smooth
// weighted round robin, which interleaves rather than sending weight-many in a row).
type RoundRobin struct {
	mu      sync.Mutex
	current map[*backendState]int
}

// Select implements Policy.
func (p *RoundRobin) Select(cands []*Backend, _ Hint) *Backend {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.current == nil {
		p.current = make(map[*backendState]int)
	}
	// Forget backends gone from the candidates so the map stays as large as the pool.
	if len(p.current) > 2*len(cands) {
		clear(p.current)
	}
	var best *Backend
	total := 0
	for _, b := range cands {
		w := max(b.Weight, 1)
		total += w
		p.current[b.st] += w
		if best == nil || p.current[b.st] > p.current[best.st] {
			best = b
		}
	}
	if best != nil {
		p.current[best.st] -= total
	}
	return best
}

// PowerOfTwo samples two distinct candidates at random and keeps the one with fewer
// in-flight requests (the higher weight on a tie): nearly as good as least_inflight
// without every proxy replica herding onto the same least loaded backend.
type PowerOfTwo struct {
	// rand returns an int in [0, n); nil means math/rand/v2.IntN. Tests inject it.
	rand func(n int) int
}

// Select implements Policy.
func (p *PowerOfTwo) Select(cands []*Backend, _ Hint) *Backend {
	intN := p.rand
	if intN == nil {
		intN = rand.IntN
	}
	switch len(cands) {
	case 0:
		return nil
	case 1:
		return cands[0]
	}
	i := intN(len(cands))
	j := intN(len(cands) - 1)
	if j >= i {
		j++
	}
	a, b := cands[i], cands[j]
	if b.Inflight() < a.Inflight() || (b.Inflight() == a.Inflight() && b.Weight > a.Weight) {
		return b
	}
	return a
}

// Prefix affinity parameters.
const (
	// bytesPerToken turns PrefixTokens into bytes; see routerconfig.Config.PrefixTokens.
	bytesPerToken = 4
	// vnodesPerWeight virtual nodes per unit of weight keep the ring balanced within
	// a few percent for small pools.
	vnodesPerWeight = 100
)

// PrefixAffinity sends requests whose prompts start alike to the same backend, so an
// engine's prefix cache gets hits: consistent hashing with virtual nodes on the first
// PrefixTokens tokens (4 bytes each) of Hint.Prefix, with bounded load: a backend above
// bounded_load_factor × (average + 1) in flight passes its keys on to the next on the ring.
// Without a prefix it falls back to least_inflight.
type PrefixAffinity struct {
	maxBytes int
	// factor is bounded_load_factor.
	factor   float64
	fallback LeastInflight

	mu   sync.Mutex
	ring []vnode
	// members is the set the ring was built from.
	members map[*backendState]bool
}

type vnode struct {
	hash uint64
	st   *backendState
}

// NewPrefixAffinity returns a prefix_affinity policy hashing prefixTokens tokens.
func NewPrefixAffinity(prefixTokens int) *PrefixAffinity {
	if prefixTokens <= 0 {
		prefixTokens = routerconfig.DefaultPrefixTokens
	}
	return &PrefixAffinity{maxBytes: prefixTokens * bytesPerToken, factor: routerconfig.DefaultBoundedLoadFactor}
}

// SetPool builds the ring over every backend of the pool, healthy or not, so that a
// backend leaving the candidates only moves its own keys (to the next on the ring).
func (p *PrefixAffinity) SetPool(all []*Backend) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buildLocked(all)
}

func (p *PrefixAffinity) buildLocked(all []*Backend) {
	p.ring = p.ring[:0]
	p.members = make(map[*backendState]bool, len(all))
	for _, b := range all {
		p.members[b.st] = true
		for i := range max(b.Weight, 1) * vnodesPerWeight {
			// The name, not the URL, keys the ring so that a backend keeps its keys
			// when its address changes; all proxy replicas agree as the hash is fixed.
			p.ring = append(p.ring, vnode{hash: hashString(b.Name + "#" + strconv.Itoa(i)), st: b.st})
		}
	}
	sort.Slice(p.ring, func(i, j int) bool { return p.ring[i].hash < p.ring[j].hash })
}

// Select implements Policy.
func (p *PrefixAffinity) Select(cands []*Backend, h Hint) *Backend {
	if len(cands) == 0 {
		return nil
	}
	if h.Prefix == "" {
		return p.fallback.Select(cands, h)
	}
	prefix := h.Prefix
	if len(prefix) > p.maxBytes {
		prefix = prefix[:p.maxBytes]
	}
	key := hashString(prefix)

	byState := make(map[*backendState]*Backend, len(cands))
	var total int64
	for _, b := range cands {
		byState[b.st] = b
		total += b.Inflight()
	}
	limit := p.factor * (float64(total)/float64(len(cands)) + 1)

	p.mu.Lock()
	defer p.mu.Unlock()
	for _, b := range cands {
		if !p.members[b.st] {
			// Used without SetPool, or the pool changed under us: build over what we
			// know is there.
			p.buildLocked(cands)
			break
		}
	}
	start := sort.Search(len(p.ring), func(i int) bool { return p.ring[i].hash >= key })
	var home *Backend
	for k := range p.ring {
		v := p.ring[(start+k)%len(p.ring)]
		b, ok := byState[v.st]
		if !ok {
			continue
		}
		if home == nil {
			home = b
		}
		if float64(b.Inflight()) <= limit {
			return b
		}
	}
	// Unreachable in practice: the least loaded candidate is never above the average.
	return home
}

// hashString is FNV-1a finished with a 64-bit mixer, because FNV alone clusters the
// short, similar strings that virtual node names are.
func hashString(s string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(s))
	return costmodel.Mix64(h.Sum64())
}
