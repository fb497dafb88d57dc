package router

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/costmodel"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// longSystem is a system prompt of about 2,000 tokens (8 KB of text): what a cache saves
// of it outweighs a few requests' load.
var longSystem = strings.Repeat("You are a careful assistant who answers in French. ", 160)

func TestCacheAwareSelect(t *testing.T) {
	turn1 := `[{"role":"system","content":"` + longSystem + `"},{"role":"user","content":"What is the capital of Spain?"}`
	turn2 := turn1 + `,{"role":"assistant","content":"Madrid."},{"role":"user","content":"And of Italy?"}]`
	tests := []struct {
		name     string
		inflight []int64
		routed   [][2]string // text, backend: what the tree was told before
		text     string
		want     string
		// placed: want is where text's key goes (the first of its rendezvous order), after
		// busyHome requests are put in flight there.
		placed   bool
		busyHome int64
	}{
		{name: "a session's next turn lands on the engine that served its previous turn though it is busier",
			inflight: []int64{3, 0, 0}, routed: [][2]string{{turn1, "b0"}}, text: turn2, want: "b0"},
		{name: "the longest match wins",
			inflight: []int64{0, 0, 0}, routed: [][2]string{{turn1[:400], "b1"}, {turn1, "b2"}}, text: turn2, want: "b2"},
		{name: "equal matches go to the fewer in flight",
			inflight: []int64{12, 0, 2}, routed: [][2]string{{turn1, "b0"}, {turn1, "b2"}}, text: turn2, want: "b2"},
		{name: "a match of a few tokens is no match: the prompt is placed by its head, as every replica places it",
			inflight: []int64{0, 0, 0}, routed: [][2]string{{"[{\"role\":\"system\"", "b0"}}, text: turn2, placed: true},
		{name: "the engine a placement would take is passed over once its work ahead costs more than a tie",
			inflight: []int64{0, 0, 0}, routed: [][2]string{{"[{\"role\":\"system\"", "b0"}}, text: turn2, placed: true, busyHome: 8},
		{name: "a pool out of balance goes to the least in flight even with a full match",
			inflight: []int64{100, 20, 10}, routed: [][2]string{{turn1, "b0"}}, text: turn2, want: "b2"},
		{name: "a gap over the absolute threshold but under the relative one leaves it to the cost: the match saves more",
			inflight: []int64{200, 150, 150}, routed: [][2]string{{turn1, "b0"}}, text: turn2, want: "b0"},
		{name: "a busy engine's match is worth less than an idle engine's recompute",
			inflight: []int64{40, 0, 0}, routed: [][2]string{{turn1[:1000], "b0"}}, text: turn2, placed: true},
		{name: "a request without text goes to the least loaded",
			inflight: []int64{2, 1, 3}, routed: [][2]string{{turn1, "b0"}}, text: "", want: "b1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bs := testBackends(tt.inflight...)
			p := NewCacheAware(routerconfig.CacheAwareConfig{}, nil, 0)
			for _, r := range tt.routed {
				p.tree.Insert(r[0], r[1])
			}
			if tt.placed {
				// The first in the key's rendezvous order among the engines not busy.
				key, _ := placementKey(Hint{Text: tt.text}, routerconfig.DefaultPrefixTokens*bytesPerToken, routerconfig.DefaultPrefixTokens)
				order := rendezvousOrder(bs, key)
				if tt.busyHome > 0 {
					bs[order[0]].st.inflight.Store(tt.busyHome)
				}
				for _, i := range order {
					if bs[i].Inflight() == 0 {
						tt.want = bs[i].Name
						break
					}
				}
			}
			if got := p.Select(bs, Hint{Text: tt.text}).Name; got != tt.want {
				t.Errorf("picked %s, want %s", got, tt.want)
			}
		})
	}
}

// rendezvousOrder is the indices of bs in key's rendezvous order.
func rendezvousOrder(bs []*Backend, key uint64) []int {
	order := make([]int, len(bs))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		return cmp.Compare(costmodel.RendezvousRank(key, bs[b].nameHash, bs[b].Weight, true), costmodel.RendezvousRank(key, bs[a].nameHash, bs[a].Weight, true))
	})
	return order
}

func TestCacheAwareRecordsWhereEachRequestWent(t *testing.T) {
	bs := testBackends(0, 0, 0)
	p := NewCacheAware(routerconfig.CacheAwareConfig{}, nil, 0)
	first := p.Select(bs, Hint{Text: longSystem + "then the user's first question"})
	first.st.inflight.Add(12) // busier now, by more than a tie
	if got := p.Select(bs, Hint{Text: longSystem + "then the user's first question, answered"}); got != first {
		t.Errorf("the follow-up went to %s, want %s, where the first went", got.Name, first.Name)
	}
	p.Forget(first.Name)
	if got := p.Select(bs, Hint{Text: longSystem + "then the user's first question, answered"}); got == first {
		t.Errorf("after forgetting %s the follow-up still went there, though it is the busiest", first.Name)
	}
}

func TestCacheAwareBurstOfOneHotPrefixSpreads(t *testing.T) {
	const engines, burst = 4, 400
	r, reg, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", engines, 10_000), DecodePolicy: routerconfig.PolicyCacheAware})
	hot := strings.Repeat("the same long system prompt for every request; ", 40)
	var leases []*Lease
	for i := range burst {
		leases = append(leases, mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: hot + fmt.Sprint("question ", i)}))
	}
	lo, hi := int64(burst), int64(0)
	for _, b := range r.Backends() {
		lo, hi = min(lo, b.Inflight), max(hi, b.Inflight)
	}
	if lo == 0 {
		t.Errorf("an engine got none of a burst of %d: the hot prefix did not spread", burst)
	}
	if hi-lo > routerconfig.DefaultBalanceAbsThreshold+1 {
		t.Errorf("in flight ranges from %d to %d across engines: more apart than balance_abs_threshold %d", lo, hi, routerconfig.DefaultBalanceAbsThreshold)
	}
	for _, l := range leases {
		l.Release(Result{Status: 200})
	}
	assertAllIdle(t, r)
	if n := testutil.Value(t, reg, "pdproxy_prefix_cache_match_ratio", map[string]string{"role": "decode", "policy": routerconfig.PolicyCacheAware}); n == 0 {
		t.Error("no pick was observed in pdproxy_prefix_cache_match_ratio")
	}
}

func BenchmarkCacheAwareSelect(b *testing.B) {
	for _, size := range []int{1 << 10, 16 << 10} {
		b.Run(fmt.Sprintf("text=%dKiB", size>>10), func(b *testing.B) {
			bs := testBackends(0, 0, 0, 0, 0, 0, 0, 0)
			p := NewCacheAware(routerconfig.CacheAwareConfig{}, nil, 0)
			base := strings.Repeat("x", size)
			texts := make([]string, 64)
			for i := range texts {
				texts[i] = fmt.Sprintf("session %d: %s", i, base)
				p.Select(bs, Hint{Text: texts[i]})
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				p.Select(bs, Hint{Text: texts[i%len(texts)]})
				i++
			}
		})
	}
}

func TestPreciseCountsTheTextRoutedSinceJustBeforeAnEnginesLatestEvent(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	text := `[{"role":"system","content":"a new system prompt nobody's events have told yet: ` + longSystem + `"}`
	tokens := make([]uint32, 2048)
	tests := []struct {
		name     string
		routedAt time.Time
		want     string
	}{
		{name: "text routed after the engine's latest event counts: its blocks are being computed", routedAt: t0.Add(time.Second), want: "b1"},
		{name: "text routed just before it counts: its blocks may not be told yet", routedAt: t0.Add(-time.Second), want: "b1"},
		{name: "text routed long before does not: the events tell what is left of it", routedAt: t0.Add(-time.Minute), want: "b0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			index := kvcache.NewIndex(0, 16)
			bs := testBackends(0, 10, 10)
			for _, b := range bs {
				index.Touch(b.Name, t0) // every publisher alive, none holding the prompt
			}
			p := NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Hour)
			p.now = func() time.Time { return t0.Add(2 * time.Second) }
			p.tree.InsertAt(text, "b1", tt.routedAt)
			if got := p.Select(bs, Hint{Text: text + `,{"role":"user","content":"hi"}]`, Tokens: tokens}).Name; got != tt.want {
				t.Errorf("picked %s, want %s", got, tt.want)
			}
		})
	}
}
