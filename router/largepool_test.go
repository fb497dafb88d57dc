package router

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// TestALargePoolPicksWhatReadingEveryCandidateWould runs the same picks through a large
// pool's view (selectLarge) and through the pick that reads every candidate, with the same
// index, the same routed text and the same loads, and wants the same engine every time:
// prompts held by a few engines, by engines whose events went stale, by nobody, text routed
// before, a pool out of balance, weighted engines. Requests stay on their engine for a while
// and end in batches; between such batches the clock moves a loadRefreshPeriod on, as a
// pool's requests would take, so that the view has read every load again.
func TestALargePoolPicksWhatReadingEveryCandidateWould(t *testing.T) {
	for _, tc := range []struct {
		name       string
		precise    bool
		balanceAbs int
		weighted   bool
	}{
		{name: "precise", precise: true},
		{name: "precise, out of balance often", precise: true, balanceAbs: 3},
		{name: "precise, weighted", precise: true, weighted: true},
		{name: "cache_aware", precise: false},
		{name: "cache_aware, weighted, out of balance often", precise: false, weighted: true, balanceAbs: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(7, uint64(len(tc.name))))
			const engines, prompts, promptBlocks = 150, 24, 32
			bs := testBackends(make([]int64, engines)...)
			if tc.weighted {
				for _, b := range bs {
					b.Weight = 1 + r.IntN(3)
				}
			}
			clock := time.Now()
			// Some engines store what they have free within seconds: there, a prompt's tokens
			// are at risk before its next turn (costmodel.AtRisk).
			for _, b := range bs {
				if r.IntN(3) == 0 {
					period := time.Duration(500+r.IntN(20_000)) * time.Millisecond
					b.st.load.turnover.Observe(clock.Add(-period), 0, 66_816, 66_816)
					b.st.load.turnover.Observe(clock, 70_000, 66_816, 66_816)
				}
			}
			var index *kvcache.Index
			if tc.precise {
				index = kvcache.NewIndex(0, kvBlock)
			}
			// Each prompt is held, in whole or in part, by up to 6 engines; one engine in 10
			// has gone silent since.
			heads := make([][]uint32, prompts)
			for d := range heads {
				heads[d] = promptTokens(100_000*(d+1), promptBlocks*kvBlock)
			}
			cfg := routerconfig.CacheAwareConfig{BalanceAbsThreshold: tc.balanceAbs}
			large := NewCacheAware(cfg, index, time.Minute)
			exact := NewCacheAware(cfg, index, time.Minute)
			exact.large = math.MaxInt
			large.now = func() time.Time { return clock }
			exact.now = large.now
			for d, head := range heads {
				for range r.IntN(7) {
					b := bs[r.IntN(engines)]
					blocks := 1 + r.IntN(promptBlocks)
					if index != nil {
						index.Apply(b.Name, &kvcache.Event{Kind: kvcache.BlockStored, Hashes: hashesOf(uint64(d<<12|r.IntN(4096)), blocks),
							Tokens: head[:blocks*kvBlock], BlockSize: kvBlock})
					}
					// And the text routed to it, some of it long ago.
					text := tokensText(head[:blocks*kvBlock])
					when := clock.Add(-time.Duration(r.IntN(10)) * time.Second)
					large.tree.InsertAt(text, b.Name, when)
					exact.tree.InsertAt(text, b.Name, when)
				}
			}
			if index != nil {
				for _, b := range bs {
					seen := clock
					if r.IntN(10) == 0 {
						seen = clock.Add(-2 * time.Minute)
					}
					index.Touch(b.Name, seen)
				}
			}

			type sent struct {
				b  *Backend
				bk *booked
			}
			var open []sent
			placed, held := 0, 0
			for pick := range 800 {
				var tokens []uint32
				if d := r.IntN(prompts + prompts/4); d < prompts {
					tokens = append(tokens, heads[d][:(1+r.IntN(promptBlocks))*kvBlock]...)
				}
				tokens = append(tokens, promptTokens(10_000_000+pick*1000, (1+r.IntN(8))*kvBlock)...)
				h := Hint{Tokens: tokens, Text: tokensText(tokens)}
				if !tc.precise {
					h.Tokens = nil
				}
				want, _ := exact.SelectCost(bs, h)
				got, cost := large.SelectCost(bs, h)
				if got != want {
					t.Fatalf("pick %d: the large pool's view picked %s, reading every candidate picks %s", pick, got.Name, want.Name)
				}
				if got.Inflight() == 0 {
					placed++
				} else {
					held++
				}
				// In flight there, its prefill in the books, as a lease has it.
				got.st.inflight.Add(1)
				open = append(open, sent{got, book(large.cm, got, cost, clock)})
				if r.IntN(8) == 0 {
					// A batch of requests ends, and time passes.
					r.Shuffle(len(open), func(i, j int) { open[i], open[j] = open[j], open[i] })
					n := r.IntN(len(open) + 1)
					for _, s := range open[:n] {
						s.bk.settle(nil, s.b, clock, false)
						s.b.st.inflight.Add(-1)
					}
					open = open[n:]
					clock = clock.Add(loadRefreshPeriod)
				}
			}
			if placed == 0 || held == 0 {
				t.Fatalf("the picks never exercised both an idle and a busy engine (%d, %d)", placed, held)
			}
		})
	}
}

// TestALargePoolReadsLoadsItDidNotSeeChange has another replica's requests (or a scrape) make
// the engine a prompt is placed on busy, unseen by the view: the pick reads it afresh and
// places the prompt on the next engine in its order instead, and a pool that went out of
// balance while the view looked away is seen so within loadRefreshPeriod.
func TestALargePoolReadsLoadsItDidNotSeeChange(t *testing.T) {
	bs := testBackends(make([]int64, 100)...)
	for _, b := range bs {
		b.st.inflight.Store(10) // bounds of ceil(1.25 × 1,001 / 100) = 13 each
	}
	clock := time.Now()
	p := NewCacheAware(routerconfig.CacheAwareConfig{}, nil, time.Minute)
	p.now = func() time.Time { return clock }
	h := Hint{Text: "a prompt nobody was sent"}
	home := p.Select(bs, h)
	p.tree.Forget(home.Name) // not where it was sent, only where it is placed
	home.st.inflight.Store(50)
	// The next pick's round of reads starts past home: only the pick's own read sees it.
	v := p.views[0]
	at, _ := v.names.At(home.Name)
	v.cursor = (at + 1) % len(bs)
	clock = clock.Add(time.Millisecond)
	if b := p.Select(bs, h); b == home {
		t.Fatalf("the prompt went to %s again, past its bound", b.Name)
	}

	// Every engine but one gets busy at once, unseen; a pick a period later sees the pool
	// out of balance and sends the next prompt to the idle one.
	idle := bs[37]
	for _, b := range bs {
		if b != idle {
			b.st.inflight.Store(200)
		}
	}
	clock = clock.Add(loadRefreshPeriod)
	if b := p.Select(bs, Hint{Text: "another prompt"}); b != idle {
		t.Fatalf("the pick went to %s (load %d), want the idle %s", b.Name, b.Inflight(), idle.Name)
	}
}

// TestALargePoolKeepsAViewOfEachCandidateSet picks alternately among a pool's engines and
// among those of a model only some serve: each set keeps its view from pick to pick, and a
// set beyond the views kept starts afresh.
func TestALargePoolKeepsAViewOfEachCandidateSet(t *testing.T) {
	all := testBackends(make([]int64, 200)...)
	some := all[:100]
	p := NewCacheAware(routerconfig.CacheAwareConfig{}, nil, time.Minute)
	p.Select(all, Hint{Text: "first"})
	p.Select(some, Hint{Text: "first"})
	first := slices.Clone(p.views)
	for i := range 20 {
		p.Select(all, Hint{Text: fmt.Sprintf("prompt %d", i)})
		p.Select(some, Hint{Text: fmt.Sprintf("prompt %d", i)})
	}
	if len(p.views) != 2 || !slices.Equal(p.views, first) {
		t.Fatalf("the two candidate sets have views %p, want the first picks' %p", p.views, first)
	}
	for i := range viewsKept {
		p.Select(all[i+1:i+101], Hint{Text: "x"})
	}
	if len(p.views) != viewsKept || slices.Contains(p.views, first[0]) || slices.Contains(p.views, first[1]) {
		t.Fatalf("%d views kept (%p), want the %d most recent", len(p.views), p.views, viewsKept)
	}
}

// BenchmarkLargePoolSelect is one pick of precise_cache_aware over pools of growing size,
// every engine's events fresh, the prompt held by 4 engines.
func BenchmarkLargePoolSelect(b *testing.B) {
	for _, n := range []int{100, 1000, 10000} {
		b.Run(fmt.Sprintf("engines=%d", n), func(b *testing.B) {
			bs := testBackends(make([]int64, n)...)
			index := kvcache.NewIndex(0, kvBlock)
			prompt := promptTokens(0, 4096)
			for i := range 4 {
				index.Apply(bs[i*7].Name, &kvcache.Event{Kind: kvcache.BlockStored, Hashes: hashesOf(uint64(i), 128), Tokens: prompt[:128*kvBlock], BlockSize: kvBlock})
			}
			for _, be := range bs {
				index.Touch(be.Name, time.Now())
			}
			p := NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Hour)
			h := Hint{Tokens: prompt, Text: tokensText(prompt)}
			b.ResetTimer()
			for b.Loop() {
				p.Select(bs, h)
			}
		})
	}
}
