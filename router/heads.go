package router

import (
	"encoding/hex"
	"slices"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/pdproxy/pdproxy/router/costmodel"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Replicas of cache_aware each see only the text they routed: a prompt group one replica sent
// to an engine looks new to the next, which would place it anew, elsewhere; under
// precise_cache_aware so does one the engine has not yet told of by its KV events, a moment
// after its prefill ends. With shared state they tell each other where the heads of prompts
// went: the proxy reads, before a pick, which engine each head of the request's text was last
// sent to by any replica (Router.Heads, then Hint.Placed), and writes after it where they went
// now. An engine named for a head is credited with holding that head, as the tree credits
// what this replica routed, for as long as routed text counts (Heads); the cost decides as
// for any share. The heads are the text's first 4 × prefix_tokens bytes (the placement
// key's), and 4 and 16 times that, as far as the text goes (a group's shared preamble), and
// the text up to each of the last few messages' ends of a conversation (its earlier turns,
// whichever replica routed them).

// headLevels is how many heads of fixed lengths a text has, each 4 times the one before.
const headLevels = 3

// Head is a leading part of a request's text whose placement replicas share: its length in
// bytes, and its key, a hash of those bytes and of the request's model and cache identity.
type Head struct {
	Bytes int
	Key   string
}

// Placement is where a head of the request's text was last sent by any replica: to Engine
// (a backend's name), whose cache is taken to hold its first Bytes bytes.
type Placement struct {
	Engine string
	Bytes  int
}

// Heads are the heads of h's text whose placements role's pool weighs (Hint.Placed), longest
// last, turnEnds (where in h.Text a conversation's last messages end: api.Request.TurnEnds)
// among them, and how long a placement counts, as routed text does: tree_ttl under
// cache_aware, pendingGrace under precise_cache_aware (its KV events tell every replica the
// rest). None unless the pool is on a cache-aware policy, or for a text shorter than its
// first head.
func (r *Router) Heads(role routerconfig.Role, h Hint, turnEnds []int) ([]Head, time.Duration) {
	ca, _ := r.sharing(role)
	switch {
	case ca == nil:
		return nil, 0
	case ca.index != nil:
		return ca.heads(h, turnEnds), pendingGrace
	}
	return ca.heads(h, turnEnds), ca.cfg.TreeTTL
}

// sharing is role's policy and backends where its replicas share placements; nil otherwise.
func (r *Router) sharing(role routerconfig.Role) (*CacheAware, []*Backend) {
	p := r.pool(role)
	if p == nil {
		return nil, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if ca, ok := p.policy.(*CacheAware); ok && p.caps.SharesPlacements {
		return ca, p.backends
	}
	return nil, nil
}

// SpreadEngines are the engines whose work every replica sent lately h's pick in role's pool
// may weigh (Hint.Sent) where it spreads ties so: the first costmodel.SpreadChoices in h's
// rank order, among which ties are spread. None for a pool that does not.
func (r *Router) SpreadEngines(role routerconfig.Role, h Hint) []string {
	ca, backends := r.sharing(role)
	if ca == nil || (ca.index == nil && !ca.placementsShared) {
		return nil
	}
	key, ok := ca.tieKey(h)
	if !ok {
		return nil
	}
	even := !slices.ContainsFunc(backends, func(b *Backend) bool { return b.Weight != backends[0].Weight })
	rank := func(i int) float64 {
		return costmodel.RendezvousRank(key, backends[i].nameHash, backends[i].Weight, even)
	}
	var top costmodel.Top
	for i := range backends {
		top.Offer(i, rank)
	}
	var names []string
	for _, i := range top.Indexes() {
		names = append(names, backends[i].Name)
	}
	return names
}

// heads are h's heads, each 4 times longer than the one before from the placement key's
// length, and its text up to each of turnEnds as long.
func (p *CacheAware) heads(h Hint, turnEnds []int) []Head {
	n := p.keyTokens * bytesPerToken
	if n <= 0 || len(h.Text) < n {
		return nil
	}
	cuts := make([]int, 0, headLevels+len(turnEnds))
	for k := range headLevels {
		cuts = append(cuts, n<<(2*k))
	}
	for _, e := range turnEnds {
		cuts = append(cuts, max(e, n))
	}
	slices.Sort(cuts)
	var d xxhash.Digest
	d.Reset()
	for _, part := range []string{h.Model, h.LoRA, h.CacheSalt} {
		_, _ = d.WriteString(part)
		_, _ = d.WriteString("\x00")
	}
	heads := make([]Head, 0, len(cuts))
	done := 0
	for _, n := range slices.Compact(cuts) {
		if n > len(h.Text) {
			break
		}
		_, _ = d.WriteString(h.Text[done:n])
		done = n
		var sum [8]byte
		heads = append(heads, Head{Bytes: n, Key: hex.EncodeToString(d.Sum(sum[:0]))})
	}
	return heads
}

// placedShare is the share of h's text that the replicas' placements say name holds.
func placedShare(h Hint, name string) float64 {
	share := 0.0
	for _, pl := range h.Placed {
		if pl.Engine == name && len(h.Text) > 0 {
			share = max(share, float64(min(pl.Bytes, len(h.Text)))/float64(len(h.Text)))
		}
	}
	return share
}
