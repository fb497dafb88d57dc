package router

import (
	"fmt"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/decay"
	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// groupPrompt is the first prompt of prompt group g: a system prompt of its own (no engine
// holds it) and a question.
func groupPrompt(g int) (string, []uint32) {
	return fmt.Sprintf(`[{"role":"system","content":"group %d: %s"},{"role":"user","content":"a question"}]`, g, longSystem),
		promptTokens(g*100_000, 64*kvBlock)
}

// storeOn tells index that engine computed a prompt of blocks blocks at t, as its events do.
func storeOn(index *kvcache.Index, engine string, seed uint64, tokens []uint32, blocks int, t time.Time) {
	index.Apply(engine, &kvcache.Event{Kind: kvcache.BlockStored, Hashes: hashesOf(seed, blocks), Tokens: tokens[:blocks*kvBlock], BlockSize: kvBlock})
	index.Touch(engine, t)
}

// Prompt groups new to the pool, placed one after another, each computed where it went (its
// events say so before the next comes): under precise_cache_aware none gets two shares by the
// luck of a hash. Placed by the rendezvous order alone, as a policy's Select with nothing
// computed anywhere places them, these 12 groups fall 6/2/2/2 on 4 engines.
func TestNewPromptGroupsSpreadByTheWorkEachEngineDidLately(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	for _, tc := range []struct {
		policy string
		spread bool
	}{{routerconfig.PolicyPreciseCacheAware, true}, {routerconfig.PolicyCacheAware, false}} {
		t.Run(tc.policy, func(t *testing.T) {
			index := kvcache.NewIndex(0, kvBlock)
			bs := testBackends(0, 0, 0, 0)
			now := t0
			for _, b := range bs {
				index.Touch(b.Name, now) // every publisher alive, none holding anything
			}
			p := NewCacheAware(routerconfig.CacheAwareConfig{}, nil, time.Hour)
			if tc.spread {
				p = NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Hour)
			}
			p.now = func() time.Time { return now }
			per := map[string]int{}
			for g := range 12 {
				now = now.Add(50 * time.Millisecond)
				text, tokens := groupPrompt(g)
				b := p.Select(bs, Hint{Text: text, Tokens: tokens})
				per[b.Name]++
				storeOn(index, b.Name, uint64(g+1), tokens, 64, now.Add(10*time.Millisecond))
			}
			even := true
			for _, b := range bs {
				even = even && per[b.Name] == 3
			}
			if even != tc.spread {
				t.Fatalf("12 new groups went %v; want 3 on each engine: %v", per, tc.spread)
			}
		})
	}
}

// Ties are spread by the engines' events only where every candidate's are read: a count for
// some engines only would send new work to those without one. Then the rendezvous order
// decides, as it does without events. An engine whose events are read but that published
// nothing lately computed nothing.
func TestTiesAreSpreadOnlyWhereEveryEnginesEventsAreRead(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	text, tokens := groupPrompt(7)
	other := promptTokens(9_000_000, 64*kvBlock) // work that shares nothing with the prompt
	where := func(touch func(index *kvcache.Index, bs []*Backend)) string {
		index := kvcache.NewIndex(0, kvBlock)
		bs := testBackends(0, 0, 0, 0)
		touch(index, bs)
		p := NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Minute)
		p.now = func() time.Time { return t0.Add(time.Second) }
		return p.Select(bs, Hint{Text: text, Tokens: tokens}).Name
	}
	home := where(func(*kvcache.Index, []*Backend) {})
	// Every engine but home computed a lot lately: the prompt goes home, as by rendezvous.
	if got := where(func(index *kvcache.Index, bs []*Backend) {
		for i, b := range bs {
			if b.Name != home {
				storeOn(index, b.Name, uint64(100+i), other, 32, t0)
			} else {
				index.Touch(b.Name, t0)
			}
		}
	}); got != home {
		t.Errorf("with the others busier lately the prompt went to %s, want %s, which computed least", got, home)
	}
	// Home computed a lot lately, the others nothing: it goes elsewhere.
	busyHome := func(index *kvcache.Index, bs []*Backend) {
		for _, b := range bs {
			if b.Name == home {
				storeOn(index, b.Name, 1, other, 32, t0)
			} else {
				index.Touch(b.Name, t0)
			}
		}
	}
	if got := where(busyHome); got == home {
		t.Errorf("the prompt went to %s, which computed 32 blocks lately while the others computed none", got)
	}
	// Long silent publishers are read all the same: they computed nothing.
	if got := where(func(index *kvcache.Index, bs []*Backend) {
		for _, b := range bs {
			if b.Name == home {
				storeOn(index, b.Name, 1, other, 32, t0)
			} else {
				index.Touch(b.Name, t0.Add(-time.Hour))
			}
		}
	}); got == home {
		t.Errorf("the prompt went to %s, which computed 32 blocks lately while the others, silent for an hour, computed none", got)
	}
	// The same, but one other engine was sent work and never heard from, its events not
	// dialed: nothing says what it did, and the count is not used.
	silent := func(sentWork bool) func(index *kvcache.Index, bs []*Backend) {
		return func(index *kvcache.Index, bs []*Backend) {
			skipped := false
			for _, b := range bs {
				switch {
				case b.Name == home:
					storeOn(index, b.Name, 1, other, 32, t0)
				case !skipped:
					skipped = true
					if sentWork {
						b.st.started.Store(1)
					}
				default:
					index.Touch(b.Name, t0)
				}
			}
		}
	}
	if got := where(silent(true)); got != home {
		t.Errorf("with an engine's events not read the prompt went to %s, want %s by the rendezvous order", got, home)
	}
	// One never heard from and never sent anything (it just joined) computed nothing.
	if got := where(silent(false)); got == home {
		t.Errorf("the prompt went to %s, which computed 32 blocks lately, with an idle engine beside it", got)
	}
}

// Two replicas reading the same events place new prompts alike, whatever each routed before.
func TestReplicasReadingTheSameEventsSpreadAlike(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	index := kvcache.NewIndex(0, kvBlock)
	bs := testBackends(0, 0, 0, 0)
	for i, b := range bs {
		storeOn(index, b.Name, uint64(1000+i), promptTokens(1_000_000+i*10_000, 64*kvBlock), 8*(i+1), t0)
	}
	now := t0.Add(time.Second)
	rs := []*CacheAware{NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Minute), NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Minute)}
	for _, p := range rs {
		p.now = func() time.Time { return now }
	}
	// The first replica routed other prompts before; the second none.
	for g := 100; g < 110; g++ {
		text, tokens := groupPrompt(g)
		rs[0].Select(bs, Hint{Text: text, Tokens: tokens})
	}
	for g := range 40 {
		text, tokens := groupPrompt(g)
		h := Hint{Text: text, Tokens: tokens}
		if a, b := rs[0].Select(bs, h).Name, rs[1].Select(bs, h).Name; a != b {
			t.Fatalf("group %d went to %s through one replica and %s through the other", g, a, b)
		}
	}
}

func TestStoredLatelyHalvesEveryHalfLife(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	index := kvcache.NewIndex(0, kvBlock)
	tokens := promptTokens(0, 64*kvBlock)
	storeOn(index, "e", 1, tokens, 40, t0)
	storeOn(index, "e", 1, tokens, 40, t0) // the same blocks again: computed once
	e := index.Engine("e")
	if got := e.StoredLately(t0); got != 40 {
		t.Fatalf("stored lately %v at once, want 40", got)
	}
	if got := e.StoredLately(t0.Add(decay.HalfLife)); got < 19.99 || got > 20.01 {
		t.Errorf("stored lately %v after a half-life, want 20", got)
	}
}

// An engine's events come a moment after its prefill ends: groups placed before the events
// of the last one arrived still spread, by what this replica sent each engine.
func TestNewPromptGroupsSpreadBeforeTheirEventsArrive(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	index := kvcache.NewIndex(0, kvBlock)
	bs := testBackends(0, 0, 0, 0)
	now := t0
	for _, b := range bs {
		index.Touch(b.Name, now)
	}
	p := NewCacheAware(routerconfig.CacheAwareConfig{}, index, time.Hour)
	p.now = func() time.Time { return now }
	per := map[string]int{}
	var late []func()
	for g := range 12 {
		now = now.Add(50 * time.Millisecond)
		text, tokens := groupPrompt(g)
		b, cost := p.SelectCost(bs, Hint{Text: text, Tokens: tokens})
		book(p.cm, b, cost, now).settle(nil, b, now, false) // booked as the pool does, and done
		per[b.Name]++
		late = append(late, func() { storeOn(index, b.Name, uint64(g+1), tokens, 64, now.Add(time.Second)) })
	}
	for _, b := range bs {
		if per[b.Name] != 3 {
			t.Fatalf("12 new groups, their events not yet come, went %v; want 3 on each engine", per)
		}
	}
	// The events, once they come, count about the same blocks (the picks' counts have faded
	// for the moment between): the larger of the two counts a group once.
	for _, f := range late {
		f()
	}
	later := now.Add(time.Second)
	for _, b := range bs {
		events, sent := index.Engine(b.Name).StoredLately(later), b.st.cost.sent.Value(later)/kvBlock
		if events < sent || events > sent*1.05 {
			t.Errorf("%s: its events count %.1f blocks, this replica sent it %.1f", b.Name, events, sent)
		}
	}
}
