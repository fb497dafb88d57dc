package router

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// cacheAwareReplica is one proxy replica's router over four decoders on cache_aware, with its
// own clock; shared says the replicas share placements.
func cacheAwareReplica(t *testing.T, shared bool) *Router {
	t.Helper()
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 4, 0),
		DecodePolicy: routerconfig.PolicyCacheAware, SharedPlacements: shared})
	return r
}

// groupTurn is a request of prompt group g from user u: the group's system prompt, and a
// question of the user's own.
func groupTurn(g, u int) string {
	return fmt.Sprintf(`[{"role":"system","content":"group %d: %s"},{"role":"user","content":"question %d of user %d"}]`, g, longSystem, u, u)
}

// decoderFor is where r sends h, the lease given back at once.
func decoderFor(t *testing.T, r *Router, h Hint) string {
	t.Helper()
	l := mustAcquire(t, r, routerconfig.RoleDecode, h)
	defer l.Release(Result{})
	return l.Backend().Name
}

// Prompt groups new to a pool on cache_aware, placed one after another: where the replicas
// share placements, each spreads them by the uncached tokens it sent each engine lately, so
// none gets two shares by the luck of a hash. Where they share nothing, the rendezvous order
// alone places them, as every replica would (these 12 then fall 6/2/2/2).
func TestCacheAwareSpreadsNewGroupsWhereReplicasSharePlacements(t *testing.T) {
	for _, shared := range []bool{true, false} {
		r := cacheAwareReplica(t, shared)
		per := map[string]int{}
		for g := range 12 {
			per[decoderFor(t, r, Hint{Text: groupTurn(g, 0)})]++
		}
		even := true
		for i := range 4 {
			even = even && per[fmt.Sprintf("d%d", i)] == 3
		}
		if even != shared {
			t.Errorf("placements shared: %v; 12 new groups went %v; want 3 on each of 4 engines: %v", shared, per, shared)
		}
	}
}

// Two replicas of cache_aware see only the text each routed: the groups replica A placed look
// new to replica B, which, reaching them in another order, spreads them its own way. With
// the placements A's picks left in shared state (Router.Heads, Hint.Placed), B sends every
// group's next request where A sent the group.
func TestAReplicaSendsAGroupWhereTheSharedPlacementsSayItWent(t *testing.T) {
	a, b, alone := cacheAwareReplica(t, true), cacheAwareReplica(t, true), cacheAwareReplica(t, true)
	shared := map[string]string{} // head key -> engine: what Redis would hold
	went := make([]string, 12)
	for g := range 12 {
		h := Hint{Text: groupTurn(g, 0)}
		went[g] = decoderFor(t, a, h)
		heads, ttl := a.Heads(routerconfig.RoleDecode, h, nil)
		if len(heads) != 2 || ttl != routerconfig.DefaultTreeTTL {
			t.Fatalf("a %d-byte text has heads %v for %v; want 2 (1 KiB, 4 KiB) for tree_ttl", len(h.Text), heads, ttl)
		}
		for _, hd := range heads {
			shared[hd.Key] = went[g]
		}
	}
	moved := 0
	for g := 11; g >= 0; g-- {
		h := Hint{Text: groupTurn(g, 1)}
		if decoderFor(t, alone, h) != went[g] {
			moved++
		}
		heads, _ := b.Heads(routerconfig.RoleDecode, h, nil)
		for _, hd := range heads {
			if e, ok := shared[hd.Key]; ok {
				h.Placed = append(h.Placed, Placement{Engine: e, Bytes: hd.Bytes})
			}
		}
		if len(h.Placed) != 2 {
			t.Fatalf("group %d's next request found %d of its heads placed, want both", g, len(h.Placed))
		}
		if got := decoderFor(t, b, h); got != went[g] {
			t.Errorf("group %d: replica A sent it to %s, replica B with A's placements to %s", g, went[g], got)
		}
	}
	if moved == 0 {
		t.Errorf("a replica without the placements sent all 12 groups where A did: the placements were not what kept them")
	}
}

// Only a pool that weighs the text it routed (the cache-aware policies) shares placements:
// under cache_aware for tree_ttl, under precise_cache_aware until the engines' events would
// tell (pendingGrace). A head's key is the text's first bytes under the request's model and
// cache identity, so that a prompt cached for one model or salt is never credited for
// another.
func TestHeadsAreTheCacheAwarePoliciesAndKeyedByModelAndIdentity(t *testing.T) {
	for _, tc := range []struct {
		policy string
		heads  int
		ttl    time.Duration
	}{
		{routerconfig.PolicyCacheAware, 2, routerconfig.DefaultTreeTTL},
		{routerconfig.PolicyPreciseCacheAware, 2, pendingGrace},
		{routerconfig.PolicyLeastInflight, 0, 0},
		{routerconfig.PolicyPrefixAffinity, 0, 0},
	} {
		cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0), DecodePolicy: tc.policy}
		if tc.policy == routerconfig.PolicyPreciseCacheAware {
			cfg.KVEvents.Listen = "tcp://127.0.0.1:0"
		}
		r, _, _ := newTestRouter(t, cfg)
		if heads, ttl := r.Heads(routerconfig.RoleDecode, Hint{Text: groupTurn(0, 0)}, nil); len(heads) != tc.heads || ttl != tc.ttl {
			t.Errorf("%s: heads %v for %v, want %d for %v", tc.policy, heads, ttl, tc.heads, tc.ttl)
		}
	}
	r := cacheAwareReplica(t, true)
	keys := func(h Hint) []string {
		heads, _ := r.Heads(routerconfig.RoleDecode, h, nil)
		var ks []string
		for _, hd := range heads {
			ks = append(ks, fmt.Sprintf("%d:%s", hd.Bytes, hd.Key))
		}
		return ks
	}
	text := strings.Repeat("a shared preamble. ", 1200) // 22,800 bytes: three heads
	base := keys(Hint{Text: text, Model: "m"})
	if len(base) != 3 || !strings.HasPrefix(base[0], "1024:") || !strings.HasPrefix(base[1], "4096:") || !strings.HasPrefix(base[2], "16384:") {
		t.Fatalf("heads of a %d-byte text = %v; want 1 KiB, 4 KiB and 16 KiB", len(text), base)
	}
	if got := keys(Hint{Text: text + " and a question", Model: "m"}); strings.Join(got, " ") != strings.Join(base, " ") {
		t.Errorf("a text that starts alike has heads %v, want %v", got, base)
	}
	for _, h := range []Hint{{Text: text, Model: "n"}, {Text: text, Model: "m", CacheSalt: "s"}, {Text: text, Model: "m", LoRA: "adapter"}} {
		for i, k := range keys(h) {
			if k == base[i] {
				t.Errorf("model %q, salt %q, LoRA %q: head %d is keyed as the plain model's", h.Model, h.CacheSalt, h.LoRA, i)
			}
		}
	}
	if got := keys(Hint{Text: text[:1000], Model: "m"}); got != nil {
		t.Errorf("a text shorter than its first head has heads %v, want none", got)
	}
}

// A placement credits its engine with its head, and no more than the text: the engine named
// is taken to hold that share of the prompt.
func TestAPlacementCreditsItsEngineWithItsHead(t *testing.T) {
	h := Hint{Text: strings.Repeat("x", 4000), Placed: []Placement{{Engine: "d1", Bytes: 1024}, {Engine: "d1", Bytes: 4096}, {Engine: "d2", Bytes: 1024}}}
	for _, tc := range []struct {
		engine string
		want   float64
	}{{"d1", 1}, {"d2", 1024.0 / 4000}, {"d3", 0}} {
		if got := placedShare(h, tc.engine); got != tc.want {
			t.Errorf("placedShare(%s) = %v, want %v", tc.engine, got, tc.want)
		}
	}
}

// Under precise_cache_aware an engine tells every replica what it computed by its KV events,
// a moment after the prefill ends. Until then a group one replica placed looks new to the
// next, which spreads it by what it sent each engine itself, elsewhere. With the placements
// A's picks left in shared state, B sends each group's next request where A sent it before
// any event came; an engine's events, once read, speak for themselves.
func TestAPreciseReplicaSendsAGroupWhereThePlacementsSayBeforeItsEventsCome(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	index := kvcache.NewIndex(0, kvBlock)
	now := t0
	for _, b := range testBackends(0, 0, 0, 0) {
		index.Touch(b.Name, now) // every publisher alive, none holding anything
	}
	// A replica is its policy and its own backends (what it sent each), over the one index
	// every replica reads.
	replica := func() (*CacheAware, []*Backend) {
		p := NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Hour)
		p.now = func() time.Time { return now }
		return p, testBackends(0, 0, 0, 0)
	}
	a, aBackends := replica()
	went := make([]string, 12)
	for g := range went {
		now = now.Add(50 * time.Millisecond)
		text, tokens := groupPrompt(g)
		b, cost := a.SelectCost(aBackends, Hint{Text: text, Tokens: tokens})
		book(a.cm, b, cost, now).settle(nil, b, now, false)
		went[g] = b.Name
	}
	b, bBackends := replica()
	alone, aloneBackends := replica()
	moved, movedAlone := 0, 0
	for g := len(went) - 1; g >= 0; g-- {
		now = now.Add(50 * time.Millisecond)
		text, tokens := groupPrompt(g)
		h := Hint{Text: text, Tokens: tokens}
		if alone.Select(aloneBackends, h).Name != went[g] {
			movedAlone++
		}
		for _, hd := range a.heads(h, nil) {
			h.Placed = append(h.Placed, Placement{Engine: went[g], Bytes: hd.Bytes})
		}
		if b.Select(bBackends, h).Name != went[g] {
			moved++
		}
	}
	if moved != 0 {
		t.Errorf("with the placements, %d of 12 groups went elsewhere than where replica A sent them", moved)
	}
	if movedAlone == 0 {
		t.Errorf("without the placements every group went where replica A sent it: the test shows nothing")
	}
	// The events came: the engine A placed a group on holds it, and a replica that routed
	// none of it finds it there without a placement.
	for g, e := range went {
		_, tokens := groupPrompt(g)
		storeOn(index, e, uint64(g+1), tokens, 64, now)
	}
	now = now.Add(time.Second)
	c, cBackends := replica()
	for g := range went {
		text, tokens := groupPrompt(g)
		if got := c.Select(cBackends, Hint{Text: text, Tokens: tokens}).Name; got != went[g] {
			t.Errorf("group %d, its events read, went to %s, not %s which holds it", g, got, went[g])
		}
	}
}

// A placement never credits a hybrid model's engine under precise_cache_aware: what it
// reuses of a text depends on where a prompt ends, which only its events can say.
func TestAPlacementDoesNotCreditAHybridEngine(t *testing.T) {
	index := kvcache.NewIndex(0, kvBlock)
	bs := testBackends(0, 0)
	p := NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Hour)
	if !p.creditsPlacements(bs[0]) {
		t.Fatalf("a plain engine is not credited with its placements")
	}
	index.Apply(bs[0].Name, &kvcache.Event{Kind: kvcache.BlockStored, Hashes: hashesOf(1, 1), Tokens: promptTokens(0, kvBlock),
		BlockSize: kvBlock, Group: 1, Attention: kvcache.AttentionSlidingWindow, Window: 4 * kvBlock})
	if !index.Engine(bs[0].Name).Hybrid() {
		t.Fatalf("an engine publishing a sliding-window group is not taken as hybrid")
	}
	if p.creditsPlacements(bs[0]) {
		t.Errorf("a hybrid engine is credited with a placement")
	}
	if !NewCacheAware(routerconfig.CacheAwareConfig{}, nil, time.Hour).creditsPlacements(bs[0]) {
		t.Errorf("under cache_aware, which reads no events, a placement credits no engine")
	}
}

// Replicas that share placements spread the prompts no engine holds by what every replica
// sent each engine lately (Hint.Sent, read from the shared state), not only by what this
// one sent: a replica that sent nothing yet still sends a new group where the others sent
// the least. SpreadEngines names the engines a pick may spread over, the first in the
// request's rank order, and only where the pool spreads so.
func TestNewGroupsSpreadByWhatEveryReplicaSent(t *testing.T) {
	r := cacheAwareReplica(t, true)
	h := Hint{Text: groupTurn(0, 0)}
	engines := r.SpreadEngines(routerconfig.RoleDecode, h)
	if len(engines) != 4 {
		t.Fatalf("spread engines %v; want the pool's 4", engines)
	}
	home := decoderFor(t, r, h)
	if home != engines[0] {
		t.Errorf("an idle pool placed the group on %s, not the first of its rank order %v", home, engines)
	}
	// The other replicas sent every engine but the last in the order a group's worth.
	h.Sent = map[string]float64{}
	for _, e := range engines[:3] {
		h.Sent[e] = 1000
	}
	fresh := cacheAwareReplica(t, true)
	if got := decoderFor(t, fresh, h); got != engines[3] {
		t.Errorf("with the other replicas' work on %v the group went to %s, want %s", engines[:3], got, engines[3])
	}
	for _, tc := range []struct {
		name string
		r    *Router
	}{{"cache_aware without shared placements", cacheAwareReplica(t, false)}, {"least_inflight", func() *Router {
		r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 4, 0)})
		return r
	}()}} {
		if got := tc.r.SpreadEngines(routerconfig.RoleDecode, h); got != nil {
			t.Errorf("%s: spread engines %v, want none", tc.name, got)
		}
	}
	big, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 20, 0),
		DecodePolicy: routerconfig.PolicyCacheAware, SharedPlacements: true})
	if got := big.SpreadEngines(routerconfig.RoleDecode, h); len(got) != 8 || got[0] != decoderFor(t, big, Hint{Text: h.Text}) {
		t.Errorf("a pool of 20: spread engines %v; want the 8 first in the rank order, the idle pool's pick first", got)
	}
}

// conversationTurn is turn (1 or 2) of conversation c, all sharing a long system prompt, each
// with 2 KB of context of its own, and where its messages end in the text.
func conversationTurn(c, turn int) (h Hint, turnEnds []int) {
	parts := []string{`[{"role":"system","content":"` + longSystem + `"}`,
		fmt.Sprintf(`,{"role":"user","content":"conversation %d: %s"}`, c, strings.Repeat(fmt.Sprintf("its own context %d. ", c), 100))}
	if turn == 2 {
		parts = append(parts, `,{"role":"assistant","content":"an answer"}`, `,{"role":"user","content":"and then?"}`)
	}
	for _, p := range parts {
		h.Text += p
		turnEnds = append(turnEnds, len(h.Text))
	}
	h.Text += "]"
	return h, turnEnds
}

// Conversations that share a long system prompt look alike to a replica that routed none of
// them: the heads of fixed lengths name only the shared prompt. Their texts up to each
// message's end are heads too, so that a conversation's next turn, through another replica,
// goes where its previous turn went (here, as another replica's placements say, conversation
// c's first turn to engine c mod 4).
func TestAConversationsNextTurnGoesWhereItsPreviousWentThroughAnotherReplica(t *testing.T) {
	for _, turns := range []bool{true, false} {
		a, b := cacheAwareReplica(t, true), cacheAwareReplica(t, true)
		shared := map[string]string{} // head key -> engine: what Redis would hold
		for c := range 12 {
			h, ends := conversationTurn(c, 1)
			if !turns {
				ends = nil
			}
			heads, _ := a.Heads(routerconfig.RoleDecode, h, ends)
			for _, hd := range heads {
				shared[hd.Key] = fmt.Sprintf("d%d", c%4)
			}
		}
		moved := 0
		for c := 11; c >= 0; c-- {
			h, ends := conversationTurn(c, 2)
			if !turns {
				ends = nil
			}
			heads, _ := b.Heads(routerconfig.RoleDecode, h, ends)
			for _, hd := range heads {
				if e, ok := shared[hd.Key]; ok {
					h.Placed = append(h.Placed, Placement{Engine: e, Bytes: hd.Bytes})
				}
			}
			if decoderFor(t, b, h) != fmt.Sprintf("d%d", c%4) {
				moved++
			}
		}
		if turns && moved != 0 {
			t.Errorf("%d of 12 conversations' second turns went elsewhere than their first", moved)
		}
		if !turns && moved == 0 {
			t.Errorf("without the turns' heads every conversation stayed: the test shows nothing")
		}
	}
}
