package router

import (
	"fmt"
	"strings"
	"testing"

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
		heads, ttl := a.Heads(routerconfig.RoleDecode, h)
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
		heads, _ := b.Heads(routerconfig.RoleDecode, h)
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

// Only a pool that sees the caches by the text it routed (cache_aware) shares placements. A
// head's key is the text's first bytes under the request's model and cache identity, so that
// a prompt cached for one model or salt is never credited for another.
func TestHeadsAreCacheAwaresAndKeyedByModelAndIdentity(t *testing.T) {
	for _, policy := range []string{routerconfig.PolicyPreciseCacheAware, routerconfig.PolicyLeastInflight, routerconfig.PolicyPrefixAffinity} {
		cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0), DecodePolicy: policy}
		if policy == routerconfig.PolicyPreciseCacheAware {
			cfg.KVEvents.Listen = "tcp://127.0.0.1:0"
		}
		r, _, _ := newTestRouter(t, cfg)
		if heads, _ := r.Heads(routerconfig.RoleDecode, Hint{Text: groupTurn(0, 0)}); heads != nil {
			t.Errorf("%s: heads %v, want none", policy, heads)
		}
	}
	r := cacheAwareReplica(t, true)
	keys := func(h Hint) []string {
		heads, _ := r.Heads(routerconfig.RoleDecode, h)
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
