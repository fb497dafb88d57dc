package router

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"gopkg.in/yaml.v3"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// filler makes prompts long enough that the JSON they all start with is a small share of each.
var filler = strings.Repeat("and then the question goes on for a while. ", 10)

// conversation is the i-th of many prompts that share no head: a chat's messages as a client
// sends them.
func conversation(i int) string {
	return fmt.Sprintf(`[{"role":"user","content":"%d: %s"}]`, i, filler)
}

// replicas builds n routers from the same config, as proxy replicas behind one Service are,
// each running (scrapes, KV events) until the test ends when run is set.
func replicas(t *testing.T, n int, cfg func() routerconfig.Config, run bool) []*Router {
	t.Helper()
	var out []*Router
	for range n {
		r, err := New(cfg(), zaptest.NewLogger(t), nil)
		if err != nil {
			t.Fatal(err)
		}
		if run {
			runRouter(t, r)
		}
		t.Cleanup(r.CloseIdleConnections)
		out = append(out, r)
	}
	return out
}

// enginesCfg is backends named d0.. over engines that report no load.
func enginesCfg(t *testing.T, n int) []routerconfig.BackendConfig {
	t.Helper()
	var out []routerconfig.BackendConfig
	for i := range n {
		e := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0))
		out = append(out, routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i), URL: e.URL, Role: routerconfig.RoleDecode})
	}
	return out
}

// pickOnce acquires for h and releases at once: where h went, and how its session's pick went.
func pickOnce(t *testing.T, r *Router, h Hint) (string, SessionChoice) {
	t.Helper()
	l := mustAcquire(t, r, routerconfig.RoleDecode, h)
	defer l.Release(Result{Status: 200})
	return l.Backend().Name, l.Session()
}

func TestReplicasPlaceAPromptNoEngineCachesOnTheSameEngine(t *testing.T) {
	const prompts = 1000
	tests := []struct {
		name   string
		policy string
		hint   func(i int) Hint
	}{
		{"cache_aware", routerconfig.PolicyCacheAware, func(i int) Hint { return Hint{Text: conversation(i)} }},
		{"precise_cache_aware, by text and tokens", routerconfig.PolicyPreciseCacheAware, func(i int) Hint {
			return Hint{Text: conversation(i), Tokens: promptTokens(i*1000, 3*kvBlock)}
		}},
		{"precise_cache_aware, by tokens alone", routerconfig.PolicyPreciseCacheAware, func(i int) Hint {
			return Hint{Tokens: promptTokens(i*1000, 3*kvBlock)}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			backends := enginesCfg(t, 4)
			rs := replicas(t, 3, func() routerconfig.Config {
				return routerconfig.Config{Backends: backends, DecodePolicy: tt.policy, ScrapeInterval: 50 * time.Millisecond,
					Health: routerconfig.HealthConfig{Interval: -1}, KVEvents: routerconfig.KVEventsConfig{Listen: "tcp://127.0.0.1:0"}}
			}, true)
			// Each replica sees the prompts in its own order, so that what each has routed
			// before differs, as it does when a Service spreads clients.
			orders := [][]int{make([]int, prompts), make([]int, prompts), make([]int, prompts)}
			for i := range prompts {
				orders[0][i], orders[1][i], orders[2][i] = i, prompts-1-i, i
			}
			rand.New(rand.NewPCG(1, 2)).Shuffle(prompts, func(i, j int) { orders[2][i], orders[2][j] = orders[2][j], orders[2][i] })
			where := make([][]string, len(rs))
			for k, r := range rs {
				where[k] = make([]string, prompts)
				for _, i := range orders[k] {
					where[k][i], _ = pickOnce(t, r, tt.hint(i))
				}
			}
			perEngine := map[string]int{}
			for i := range prompts {
				if where[0][i] != where[1][i] || where[0][i] != where[2][i] {
					t.Fatalf("prompt %d went to %s, %s and %s from the three replicas, want one engine", i, where[0][i], where[1][i], where[2][i])
				}
				perEngine[where[0][i]]++
			}
			for _, b := range backends {
				if n := perEngine[b.Name]; n < prompts/4/2 {
					t.Errorf("%s got %d of %d prompts (%v): placement does not spread", b.Name, n, prompts, perEngine)
				}
			}
		})
	}
}

// placements is where each of n prompts goes from a fresh replica over backends, each picked
// alone.
func placements(t *testing.T, backends []routerconfig.BackendConfig, n int) []string {
	t.Helper()
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backends, DecodePolicy: routerconfig.PolicyCacheAware})
	out := make([]string, n)
	for i := range out {
		out[i], _ = pickOnce(t, r, Hint{Text: conversation(i)})
	}
	return out
}

func TestPlacementMovesOnlyTheKeysItMust(t *testing.T) {
	const prompts = 1000
	four := backendsCfg(routerconfig.RoleDecode, "d", 4, 0)
	before := placements(t, four, prompts)

	t.Run("an engine leaving moves only the keys it had", func(t *testing.T) {
		three := append(append([]routerconfig.BackendConfig(nil), four[:2]...), four[3])
		after := placements(t, three, prompts)
		moved := 0
		for i := range prompts {
			switch {
			case before[i] == "d2":
				moved++
			case after[i] != before[i]:
				t.Errorf("prompt %d moved from %s to %s when d2 left", i, before[i], after[i])
			}
		}
		if moved == 0 {
			t.Fatal("d2 had none of the prompts")
		}
	})
	t.Run("an engine joining takes about a fifth of the keys, all from the others", func(t *testing.T) {
		five := append(append([]routerconfig.BackendConfig(nil), four...), backendsCfg(routerconfig.RoleDecode, "e", 1, 0)...)
		after := placements(t, five, prompts)
		moved := 0
		for i := range prompts {
			if after[i] != before[i] {
				moved++
				if after[i] != "e0" {
					t.Errorf("prompt %d moved from %s to %s when e0 joined, want to e0 or not at all", i, before[i], after[i])
				}
			}
		}
		if moved < prompts/5-70 || moved > prompts/5+70 {
			t.Errorf("%d of %d prompts moved when a fifth engine joined, want about %d", moved, prompts, prompts/5)
		}
	})
}

func TestAFloodSharingAHeadSpreadsByTheWorkQueuedOnEachEngine(t *testing.T) {
	// Many requests sharing a 1 KiB head (the key) with long tails of their own: what the head
	// saves is soon outweighed by the tails queued where it is held, and the flood spreads.
	const engines, flood = 4, 40
	head := strings.Repeat("a system prompt every request shares. ", 30)[:4*routerconfig.DefaultPrefixTokens]
	text := func(i int) string { return head + strings.Repeat(fmt.Sprintf("tail %d of its own. ", i), 200) }
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", engines, 0), DecodePolicy: routerconfig.PolicyCacheAware})
	home, _ := pickOnce(t, r, Hint{Text: text(-1)})

	var held []*Lease
	defer func() {
		for _, l := range held {
			l.Release(Result{Status: 200})
		}
	}()
	for i := range flood {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: text(i)})
		held = append(held, l)
		if i == 0 && l.Backend().Name != home {
			t.Errorf("the first of the flood went to %s, want %s, where the idle pool places its key", l.Backend().Name, home)
		}
	}
	for _, b := range r.Backends() {
		// Every prefill of the flood is still pending: each engine's queue is its share.
		if b.Inflight > 2*flood/engines || b.Inflight < flood/engines/2 {
			t.Errorf("%s has %d of a flood of %d on %d engines in flight, want within half and twice the mean", b.Name, b.Inflight, flood, engines)
		}
	}
}

func TestASessionGoesToOneEngineFromEveryReplica(t *testing.T) {
	for _, policy := range []string{routerconfig.PolicyLeastInflight, routerconfig.PolicyCacheAware, routerconfig.PolicyRoundRobin} {
		t.Run(policy, func(t *testing.T) {
			backends := enginesCfg(t, 4)
			rs := replicas(t, 3, func() routerconfig.Config {
				return routerconfig.Config{Backends: backends, DecodePolicy: policy, ScrapeInterval: 50 * time.Millisecond, Health: routerconfig.HealthConfig{Interval: -1}}
			}, true)
			perEngine := map[string]int{}
			for s := range 100 {
				session := fmt.Sprintf("session-%d", s)
				var first string
				// Its turns reach the replicas in turn, each turn's text longer.
				for turn := range 6 {
					r := rs[turn%len(rs)]
					got, choice := pickOnce(t, r, Hint{Session: session, Text: conversation(s) + strings.Repeat(" next turn", turn)})
					if choice != SessionPlaced {
						t.Fatalf("session %s turn %d: choice %q, want %q (no binding)", session, turn, choice, SessionPlaced)
					}
					if turn == 0 {
						first = got
						perEngine[got]++
					} else if got != first {
						t.Fatalf("session %s turn %d went to %s through replica %d, want %s, where its first turn went", session, turn, got, turn%len(rs), first)
					}
				}
				// A binding from shared state wins on every replica while its engine can take it.
				bound := backends[(s+1)%len(backends)].Name
				for k, r := range rs {
					if got, choice := pickOnce(t, r, Hint{Session: session, Bound: bound, Text: conversation(s)}); got != bound || choice != SessionKept {
						t.Errorf("session %s bound to %s went to %s (%q) through replica %d, want %s (kept)", session, bound, got, choice, k, bound)
					}
				}
			}
			if len(perEngine) != len(backends) {
				t.Errorf("100 sessions went to %v: sessions do not spread", perEngine)
			}
		})
	}
}

func TestASessionYieldsItsEngineWhenItCannotTakeIt(t *testing.T) {
	const session = "a-session"
	t.Run("marked down by its health checks, on every replica alike", func(t *testing.T) {
		es := []*engine{newEngine(t), newEngine(t), newEngine(t), newEngine(t)}
		rs := replicas(t, 3, func() routerconfig.Config {
			return healthCfg(routerconfig.HealthConfig{Interval: 20 * time.Millisecond, UnhealthyThreshold: 1}, es...)
		}, true)
		bound, _ := pickOnce(t, rs[0], Hint{Session: session})
		victim := es[bound[1]-'0']
		victim.failing.Store(true)
		for _, r := range rs {
			testutil.Eventually(t, testutil.Timeout, func() bool { return !healthy(r, bound) }, "%s marked down", bound)
		}
		var moved []string
		for _, r := range rs {
			got, choice := pickOnce(t, r, Hint{Session: session, Bound: bound})
			if got == bound || choice != SessionYieldedUnhealthy {
				t.Errorf("the session bound to %s, down, went to %s (%q), want another engine (%q)", bound, got, choice, SessionYieldedUnhealthy)
			}
			moved = append(moved, got)
		}
		if moved[0] != moved[1] || moved[0] != moved[2] {
			t.Errorf("the replicas moved the session to %v, want one engine", moved)
		}
		victim.failing.Store(false)
		for _, r := range rs {
			testutil.Eventually(t, testutil.Timeout, func() bool { return healthy(r, bound) }, "%s up again", bound)
			if got, choice := pickOnce(t, r, Hint{Session: session, Bound: bound}); got != bound || choice != SessionKept {
				t.Errorf("the session bound to %s, up again, went to %s (%q), want it kept", bound, got, choice)
			}
		}
	})

	tests := []struct {
		name string
		// maxInflight is the bound engine's; zero means the default.
		maxInflight int
		// hold makes the bound engine unable to take the session on r, and says how.
		hold func(t *testing.T, r *Router, bound string) (h Hint, want SessionChoice)
	}{
		{"over its bounded-load bound", 0, func(t *testing.T, r *Router, bound string) (Hint, SessionChoice) {
			// 4 on it, none elsewhere: its load with one more, 5, is over ceil(1.25 × 5 / 4) = 2.
			for range 4 {
				hold(t, r, bound)
			}
			return Hint{}, SessionYieldedLoad
		}},
		{"at its max_inflight", 2, func(t *testing.T, r *Router, bound string) (Hint, SessionChoice) {
			// Two on it, its max_inflight, and three on each other engine: within its bound,
			// ceil(1.25 × 12 / 4) = 4, but full.
			for _, b := range r.backends() {
				n := 3
				if b.Name == bound {
					n = 2
				}
				for range n {
					hold(t, r, b.Name)
				}
			}
			return Hint{}, SessionYieldedLoad
		}},
		{"excluded by a retry", 0, func(t *testing.T, r *Router, bound string) (Hint, SessionChoice) {
			return Hint{Exclude: []string{bound}}, SessionYieldedUnhealthy
		}},
		{"ejected after failures", 0, func(t *testing.T, r *Router, bound string) (Hint, SessionChoice) {
			for range routerconfig.DefaultConsecutiveFailures {
				mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: others(r, bound)}).Release(Result{Status: 503})
			}
			return Hint{}, SessionYieldedUnhealthy
		}},
		{"not serving the model asked for", 0, func(t *testing.T, r *Router, bound string) (Hint, SessionChoice) {
			return Hint{Model: "other-model"}, SessionYieldedUnhealthy
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 4, 0)}
			for i := range cfg.Backends {
				cfg.Backends[i].Models = []string{"m"}
			}
			cfg.Backends[0].MaxInflight = tt.maxInflight
			cfg.Backends[3].Models = []string{"m", "other-model"}
			r, _, _ := newTestRouter(t, cfg)
			bound := "d0"
			h, want := tt.hold(t, r, bound)
			h.Session, h.Bound = session, bound
			got, choice := pickOnce(t, r, h)
			if got == bound || choice != want {
				t.Errorf("the session bound to %s went to %s (%q), want another engine (%q)", bound, got, choice, want)
			}
		})
	}

	t.Run("bound to an engine no longer in the config", func(t *testing.T) {
		r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 4, 0)})
		placed, _ := pickOnce(t, r, Hint{Session: session})
		got, choice := pickOnce(t, r, Hint{Session: session, Bound: "gone"})
		if got != placed || choice != SessionYieldedUnhealthy {
			t.Errorf("the session bound to a gone engine went to %s (%q), want %s, where it is placed (%q)", got, choice, placed, SessionYieldedUnhealthy)
		}
	})
}

// hold keeps one request in flight on the backend called name until the test ends.
func hold(t *testing.T, r *Router, name string) {
	t.Helper()
	l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: others(r, name)})
	t.Cleanup(func() { l.Release(Result{Status: 200}) })
}

func TestARequestWithoutASessionSaysNoSessionChoice(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0)})
	if _, choice := pickOnce(t, r, Hint{Bound: "d0"}); choice != "" {
		t.Errorf("a request of no session got the session choice %q, want none", choice)
	}
}

func TestTheLoadIsTheEnginesReportPlusOnlyWhatThisReplicaSentSince(t *testing.T) {
	for _, policy := range []string{routerconfig.PolicyCacheAware, routerconfig.PolicyLeastLoaded} {
		t.Run(policy, func(t *testing.T) {
			e := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0))
			idle := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0))
			r, err := New(routerconfig.Config{
				Backends:     []routerconfig.BackendConfig{{Name: "e", URL: e.URL, Role: routerconfig.RoleDecode}, {Name: "idle", URL: idle.URL, Role: routerconfig.RoleDecode}},
				DecodePolicy: policy,
				// One scrape, at Run's start, and none while the test counts.
				ScrapeInterval: time.Hour,
				Health:         routerconfig.HealthConfig{Interval: -1},
			}, zaptest.NewLogger(t), nil)
			if err != nil {
				t.Fatal(err)
			}
			// Two of this replica's requests run on e, with three of other replicas': e reports
			// five, which already holds this replica's two.
			hold(t, r, "e")
			hold(t, r, "e")
			e.set(http.StatusOK, testutil.VLLMMetrics(1, 4, 0.2))
			runRouter(t, r)
			waitLoad(t, r, "e", 4)
			const k = 3
			for range k {
				hold(t, r, "e")
			}
			if s := status(t, r, "e"); s.Load == nil || s.Load.Score != 5+k {
				t.Errorf("e's load after %d more requests = %+v, want the report's 5 + %d = %d, not the report plus all %d in flight",
					k, s.Load, k, 5+k, s.Inflight)
			}
		})
	}
}

func TestRequestsSentWhileAScrapeIsAnsweredAreNotCountedTwice(t *testing.T) {
	// The engine's answer is of the moment it answers: requests this replica sent while the
	// scrape was on its way are in it, and must not be added on top.
	// arrived keeps the first scrape's arrival for the test to see whenever it looks.
	arrived, answer := make(chan struct{}, 1), make(chan struct{})
	e := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			return
		}
		select {
		case arrived <- struct{}{}:
		default:
		}
		<-answer
		fmt.Fprint(w, testutil.VLLMMetrics(0, 3, 0.1))
	}))
	defer e.Close()
	// Released however the test ends, so that closing the engine does not wait on a scrape
	// held for ever.
	var once sync.Once
	release := func() { once.Do(func() { close(answer) }) }
	defer release()
	r, err := New(routerconfig.Config{
		Backends:     []routerconfig.BackendConfig{{Name: "e", URL: e.URL, Role: routerconfig.RoleDecode}},
		DecodePolicy: routerconfig.PolicyCacheAware, ScrapeInterval: time.Hour, Health: routerconfig.HealthConfig{Interval: -1},
	}, zaptest.NewLogger(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	runRouter(t, r)
	testutil.Recv(t, testutil.Timeout, arrived, "the first scrape")
	for range 3 {
		hold(t, r, "e")
	}
	release()
	waitLoad(t, r, "e", 3)
	if s := status(t, r, "e"); s.Load.Score != 3 {
		t.Errorf("e's load = %d, want 3: the engine's answer holds the 3 requests sent while it was asked", s.Load.Score)
	}
}

func TestPlacementWeighsTheLoadOtherReplicasPutOnAnEngine(t *testing.T) {
	// Replica A has sent nothing; the engines' reports show what others sent. The engine
	// every replica would place A's prompts on, busy with others' requests, is over its bound.
	backends := enginesCfg(t, 2)
	cfg := func() routerconfig.Config {
		return routerconfig.Config{Backends: backends, DecodePolicy: routerconfig.PolicyCacheAware, ScrapeInterval: 50 * time.Millisecond, Health: routerconfig.HealthConfig{Interval: -1}}
	}
	probe := replicas(t, 1, cfg, false)[0]
	perEngine := map[string][]int{}
	for i := range 40 {
		got, _ := pickOnce(t, probe, Hint{Text: conversation(i)})
		perEngine[got] = append(perEngine[got], i)
	}
	if len(perEngine["d0"]) == 0 || len(perEngine["d1"]) == 0 {
		t.Fatalf("an idle pool placed 40 prompts %v: want both engines used", perEngine)
	}
	busy := newMetricsEngine(t, testutil.VLLMMetrics(2, 6, 0.5))
	backends[0].URL = busy.URL // d0 runs 8 of other replicas' requests
	a := replicas(t, 1, cfg, true)[0]
	waitLoad(t, a, "d0", 6)
	for _, i := range perEngine["d0"] {
		if got, _ := pickOnce(t, a, Hint{Text: conversation(i)}); got != "d1" {
			t.Errorf("prompt %d went to %s, want d1: d0's report, 8, is over the bound ceil(1.25 × 9 / 2) = 6", i, got)
		}
	}
}

func TestBoundedLoadFactorConfig(t *testing.T) {
	tests := []struct {
		name    string
		yaml    string
		want    float64
		wantErr string
	}{
		{name: "unset means 1.25", yaml: "decode_policy: cache_aware\n", want: 1.25},
		{name: "set in the file", yaml: "bounded_load_factor: 1.1\n", want: 1.1},
		{name: "1 is perfectly even", yaml: "bounded_load_factor: 1\n", want: 1},
		{name: "below 1 is refused, saying why", yaml: "bounded_load_factor: 0.9\n",
			wantErr: "bounded_load_factor: 0.9 is below 1: the bound is c × the average load, and below 1 no engine need be within it"},
		{name: "negative is refused", yaml: "bounded_load_factor: -2\n", wantErr: "bounded_load_factor: -2 is below 1"},
		{name: "infinite is refused", yaml: "bounded_load_factor: .inf\n", wantErr: "bounded_load_factor: +Inf is infinite"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c routerconfig.Config
			if err := yaml.Unmarshal([]byte(tt.yaml), &c); err != nil {
				t.Fatal(err)
			}
			c.Backends = []routerconfig.BackendConfig{{URL: "http://127.0.0.1:1", Role: routerconfig.RoleDecode}}
			_, err := New(c, zaptest.NewLogger(t), nil)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("New = %v, want an error saying %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := c.Validate(); err != nil || c.BoundedLoadFactor != tt.want {
				t.Errorf("bounded_load_factor = %v (%v), want %v", c.BoundedLoadFactor, err, tt.want)
			}
		})
	}
}

func TestPlacementAndSessionsPickWithoutAllocating(t *testing.T) {
	bs := testBackends(1, 2, 3, 4, 5, 6, 7, 8)
	now := time.Now()
	if n := testing.AllocsPerRun(100, func() { place(bs, 42, routerconfig.DefaultBoundedLoadFactor, now) }); n != 0 {
		t.Errorf("place allocates %v times per pick, want 0", n)
	}
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 8, 0)})
	h := Hint{Session: "a-session", Bound: "d3", Text: "a prompt"}
	p := r.pool(routerconfig.RoleDecode)
	if n := testing.AllocsPerRun(100, func() {
		p.mu.Lock()
		p.pickLocked(h)
		p.mu.Unlock()
	}); n != 0 {
		t.Errorf("a session's pick allocates %v times, want 0", n)
	}
}

func BenchmarkSessionAcquireRelease(b *testing.B) {
	r, err := New(routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 8, 1<<20), Health: routerconfig.HealthConfig{Interval: -1}}, nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			i++
			l, err := r.Acquire(ctx, routerconfig.RoleDecode, Hint{Session: fmt.Sprint("session ", i%64), Bound: "d3"})
			if err != nil {
				b.Error(err)
				return
			}
			l.Release(Result{Status: 200})
		}
	})
}
