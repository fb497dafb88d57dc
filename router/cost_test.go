package router

import (
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// preamble is an agent's system prompt and tool descriptions, about 6,000 tokens of text.
var preamble = strings.Repeat("tool read_file(path): returns the file's text. ", 500)

// agentTurn is session s's prompt: the shared preamble, then its own context of about
// private tokens.
func agentTurn(s, private int) string {
	return preamble + strings.Repeat(fmt.Sprintf("session %d's tool result. ", s), private/6)
}

func TestTheCostRule(t *testing.T) {
	type pick struct {
		text string
		// hold keeps the pick in flight, its prefill pending, as a request being served.
		hold bool
	}
	tests := []struct {
		name string
		// routed is what each engine was sent before: text, engine, how long ago.
		routed []struct {
			text, engine string
			ago          time.Duration
		}
		// decoding is how many requests decode on each engine.
		decoding []int64
		picks    []pick
		// check says what is wrong with where the picks went, "" when nothing is.
		check func(got []string) string
	}{
		{
			name: "a hot shared preamble spills by cost: a burst sharing it spreads over the engines",
			picks: func() []pick {
				var ps []pick
				for s := range 16 {
					ps = append(ps, pick{agentTurn(s, 50), true})
				}
				return ps
			}(),
			check: func(got []string) string {
				per := map[string]int{}
				for _, g := range got {
					per[g]++
				}
				for _, n := range per {
					if n > 2*len(got)/4 {
						return fmt.Sprintf("16 requests went %v: one engine over twice the mean", per)
					}
				}
				if len(per) < 4 {
					return fmt.Sprintf("16 requests went %v: not every engine took some", per)
				}
				return ""
			},
		},
		{
			name: "a long private context stays on its engine though it is busier",
			routed: []struct {
				text, engine string
				ago          time.Duration
			}{{agentTurn(1, 8000), "b2", time.Second}, {preamble, "b0", time.Second}, {preamble, "b1", time.Second}, {preamble, "b3", time.Second}},
			decoding: []int64{0, 0, 20, 0},
			picks:    []pick{{agentTurn(1, 8100), false}},
			check: func(got []string) string {
				if got[0] != "b2" {
					return fmt.Sprintf("the session's next turn went to %s, want b2, which holds its 8,000-token context: 20 decodes there weigh 320 tokens", got[0])
				}
				return ""
			},
		},
		{
			name: "a context routed longer ago than tree_ttl is not credited: the engine has likely evicted it",
			routed: []struct {
				text, engine string
				ago          time.Duration
			}{{agentTurn(1, 8000), "b2", 3 * time.Minute}},
			decoding: []int64{0, 0, 20, 0},
			picks:    []pick{{agentTurn(1, 8100), false}},
			check: func(got []string) string {
				if got[0] == "b2" {
					return "the session's next turn went to b2, the busiest, for a context routed there 3 minutes ago"
				}
				return ""
			},
		},
		{
			name: "the queue on an engine outweighs its context once it is longer than the context",
			routed: []struct {
				text, engine string
				ago          time.Duration
			}{{agentTurn(1, 2000), "b2", time.Second}, {preamble, "b0", time.Second}},
			decoding: []int64{0, 0, 400, 0},
			picks:    []pick{{agentTurn(1, 2100), false}},
			check: func(got []string) string {
				if got[0] != "b0" {
					return fmt.Sprintf("went to %s, want b0: b2's 400 decodes (6,400 tokens) outweigh the 2,000 it saves, and b0 holds the preamble", got[0])
				}
				return ""
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, _, clk := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "b", 4, 0), DecodePolicy: routerconfig.PolicyCacheAware,
				CacheAware: routerconfig.CacheAwareConfig{BalanceAbsThreshold: 1000}})
			p := r.pool(routerconfig.RoleDecode).policy.(*CacheAware)
			for _, rt := range tt.routed {
				p.tree.InsertAt(rt.text, rt.engine, clk.Now().Add(-rt.ago))
			}
			for i, n := range tt.decoding {
				backendByName(t, r, fmt.Sprintf("b%d", i)).st.inflight.Add(n)
			}
			var got []string
			var held []*Lease
			for _, pk := range tt.picks {
				l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: pk.text})
				got = append(got, l.Backend().Name)
				if pk.hold {
					held = append(held, l)
				} else {
					l.Release(Result{Status: 200})
				}
			}
			if msg := tt.check(got); msg != "" {
				t.Error(msg)
			}
			for _, l := range held {
				l.Release(Result{Status: 200})
			}
			for i, n := range tt.decoding {
				backendByName(t, r, fmt.Sprintf("b%d", i)).st.inflight.Add(-n)
			}
			assertAllIdle(t, r)
		})
	}
}

func TestReplicasAgreeWhereNearEqualCostsGo(t *testing.T) {
	// Two replicas whose views differ by a few tokens (one routed a prompt's opening bytes to
	// b1) and whose fits of the engines' prefills differ: for prompts no engine holds, each
	// still picks what the other picks.
	rs := make([]*Router, 2)
	for i := range rs {
		rs[i], _, _ = newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "b", 4, 0), DecodePolicy: routerconfig.PolicyCacheAware})
	}
	rs[1].pool(routerconfig.RoleDecode).policy.(*CacheAware).tree.Insert(`[{"role":"user","content":"question 1`, "b1")
	m := rs[1].pool(routerconfig.RoleDecode).policy.(*CacheAware).cm
	for i := range 20 {
		work := float64(500 + 100*i)
		m.Learn(work, secondsToDuration(0.005+work*30e-6))
	}
	for i := range 200 {
		h := Hint{Text: fmt.Sprintf(`[{"role":"user","content":"question %d: %s"}]`, i, strings.Repeat("words of its own ", 100))}
		a, _ := pickOnce(t, rs[0], h)
		b, _ := pickOnce(t, rs[1], h)
		if a != b {
			t.Fatalf("prompt %d went to %s through one replica and %s through the other", i, a, b)
		}
	}
}

func TestAPrefillTeachesTheEnginesRateAndThePredictionsError(t *testing.T) {
	r, reg, clk := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "b", 2, 0), DecodePolicy: routerconfig.PolicyCacheAware})
	text := strings.Repeat("a prompt of about a thousand tokens. ", 110)
	// The engine computes 2,500 tokens a second where the proxy starts from 10,000: each
	// prefill of about 1,000 tokens takes 10ms + 400ms.
	for i := range 40 {
		h := Hint{Text: fmt.Sprintf("request %d of its own: %s", i, text)} // no engine holds it
		l := mustAcquire(t, r, routerconfig.RoleDecode, h)
		clk.Advance(10*time.Millisecond + time.Duration(hintTokens(h)*400)*time.Microsecond)
		l.Prefilled()
		l.Release(Result{Status: 200})
	}
	rate := testutil.Value(t, reg, "pdproxy_backend_prefill_tokens_per_second", nil) / 2
	if rate < 2000 || rate > 3200 {
		t.Errorf("learned prefill rate %.0f tokens a second, want about 2,500", rate)
	}
	if n := testutil.Value(t, reg, "pdproxy_ttft_prediction_error_seconds", nil); n != 40 {
		t.Errorf("prediction errors observed %v, want 40", n)
	}
	if v, ok := testutil.Lookup(t, reg, "pdproxy_predicted_ttft_seconds", map[string]string{"backend": "b0"}); !ok || v < 0.3 || v > 0.6 {
		t.Errorf("predicted_ttft_seconds{b0} = %v (present %v), want about 0.41 once the rate is learned", v, ok)
	}
	assertAllIdle(t, r)
}

func TestAReleaseWithoutPrefillTakesTheWorkOffTheBooksAndTeachesNothing(t *testing.T) {
	r, reg, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "b", 1, 0), DecodePolicy: routerconfig.PolicyCacheAware})
	l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: strings.Repeat("x", 4000)})
	b := l.Backend()
	if got, _ := b.st.cost.books.Totals(); got != 1000 {
		t.Fatalf("pending tokens %d while the prefill runs, want 1,000", got)
	}
	l.Release(Result{Err: fmt.Errorf("connection reset")})
	l.Prefilled() // late: the lease is gone
	if tok, reqs := b.st.cost.books.Totals(); tok != 0 || reqs != 0 {
		t.Errorf("books hold %d tokens of %d requests after the release, want none", tok, reqs)
	}
	if _, ok := testutil.Lookup(t, reg, "pdproxy_backend_prefill_tokens_per_second", nil); ok {
		t.Error("a failed request taught the engine's rate")
	}
}

func TestASessionsBoundEngineIsCreditedWithWhatItsLatestRequestSentIt(t *testing.T) {
	// Another replica routed the session's earlier turns: this one's tree knows nothing of
	// them, and its bound engine is the busiest. What shared state says the latest request
	// sent it keeps the session there; without it, the session moves.
	text := agentTurn(1, 8000)
	for _, tc := range []struct {
		boundText int
		want      SessionChoice
	}{
		{len(text) - 400, SessionKept},
		{0, SessionYieldedLoad},
	} {
		r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "b", 4, 0), DecodePolicy: routerconfig.PolicyCacheAware})
		busy := backendByName(t, r, "b2")
		busy.st.inflight.Add(50) // 800 tokens of decodes: more than a tie, within balance
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: text, Session: "s1", Bound: "b2", BoundText: tc.boundText})
		if got := l.Session(); got != tc.want {
			t.Errorf("bound text %d bytes of %d: the pick went to %s (%q), want %q", tc.boundText, len(text), l.Backend().Name, got, tc.want)
		}
		l.Release(Result{Status: 200})
		busy.st.inflight.Add(-50)
		assertAllIdle(t, r)
	}
}

// cacheCounters is a vLLM /metrics body whose prefix cache has stored stored prompt tokens in
// a pool of 4,176 blocks of 16 (66,816 tokens), of which usage (0 to 1) is held by requests.
func cacheCounters(stored int, usage float64) string {
	return testutil.VLLMMetrics(0, 0, usage) + fmt.Sprintf(`# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} %d
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4176"} 1
`, stored)
}

// kvCountingPool is a cache_aware decode pool of n engines, b0 onwards, whose /metrics
// report their KV counters (cacheCounters), none stored yet.
func kvCountingPool(t *testing.T, n int) (*Router, *prometheus.Registry, *testutil.Clock, map[string]*metricsEngine) {
	var backends []routerconfig.BackendConfig
	engines := map[string]*metricsEngine{}
	for i := range n {
		name := fmt.Sprintf("b%d", i)
		engines[name] = newMetricsEngine(t, cacheCounters(0, 0))
		backends = append(backends, routerconfig.BackendConfig{Name: name, URL: engines[name].URL, Role: routerconfig.RoleDecode})
	}
	r, reg, clk := newTestRouter(t, routerconfig.Config{Backends: backends, DecodePolicy: routerconfig.PolicyCacheAware})
	return r, reg, clk, engines
}

// scrapeEvery scrapes every backend of r once.
func scrapeEvery(t *testing.T, r *Router) {
	for _, b := range r.backends() {
		r.scrape(t.Context(), b, time.Second)
	}
}

func TestAContextIsNotCreditedOnceItsEnginesPoolHasTurnedOver(t *testing.T) {
	// A session's 8,000-token context went to an engine, now the busiest. If that engine has
	// since stored as many other prompt tokens as its pool has free (by its own counters,
	// whoever sent them), the context is gone and the next turn goes elsewhere; with less
	// stored, it stays. An engine whose count went down has restarted, its pool empty.
	for _, tc := range []struct {
		storedSince int
		usage       float64
		stays       bool
	}{{30_000, 0, true}, {70_000, 0, false}, {30_000, 0.6, false}, {-7_900, 0, false}} {
		name := fmt.Sprintf("%d tokens stored since, %.0f%% of the pool held", tc.storedSince, 100*tc.usage)
		if tc.storedSince < 0 {
			name = "the engine restarted since: its count went down"
		}
		t.Run(name, func(t *testing.T) {
			r, reg, clk, engines := kvCountingPool(t, 4)
			scrapeAll := func() { scrapeEvery(t, r) }
			scrapeAll()
			clk.Advance(time.Second)
			l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: agentTurn(1, 8000)})
			home := l.Backend()
			clk.Advance(400 * time.Millisecond)
			l.Prefilled()
			l.Release(Result{Status: 200})
			engines[home.Name].set(http.StatusOK, cacheCounters(8000, 0)) // the context, stored
			scrapeAll()
			clk.Advance(time.Second)
			engines[home.Name].set(http.StatusOK, cacheCounters(8000+tc.storedSince, tc.usage))
			scrapeAll()
			home.st.inflight.Add(20) // decodes there: 320 tokens of work, well under the context
			defer home.st.inflight.Add(-20)
			got, _ := pickOnce(t, r, Hint{Text: agentTurn(1, 8100)})
			if stays := got == home.Name; stays != tc.stays {
				t.Errorf("the next turn went to %s, its context's engine %s; want it kept there %v, with %d tokens stored there since in a pool of 66,816, %.0f%% held",
					got, home.Name, tc.stays, tc.storedSince, 100*tc.usage)
			}
			// Operators see how long a context stays credited there: the second between the
			// scrape that counted the context and the one that counted what was free stored.
			v, shown := testutil.Lookup(t, reg, "pdproxy_backend_kv_turnover_seconds", map[string]string{"backend": home.Name})
			if turned := tc.storedSince > 0 && !tc.stays; shown != turned || (shown && v != 1) {
				t.Errorf("kv_turnover_seconds{%s} = %v (shown %v), want 1 shown only once what was free was stored", home.Name, v, shown)
			}
		})
	}
}

func TestAContextGoesWhereItWillLastTillTheNextTurn(t *testing.T) {
	// A session's context went to b0 2.1 s ago, and b0 has since stored its whole free pool
	// within a second (its counters): the context is gone, and is computed again wherever the
	// next turn goes. b1 stores as much in 100 s. b0 has less work ahead, which would decide
	// between two engines that compute alike; but on b0 this turn's context would be gone again
	// before the next turn, and it goes to b1, where it lasts. A prompt that continues nothing
	// routed (when it comes back is not known) goes where less work is ahead; so does the
	// turn where b1 too stores its free pool within seconds, as it would be lost anywhere.
	for _, tc := range []struct {
		name, text string
		b1Fast     bool
		want       string
	}{
		{"the session's next turn", agentTurn(1, 8100), false, "b1"},
		{"a prompt that continues nothing routed", strings.Repeat("an unrelated question. ", 1400), false, "b0"},
		{"the session's next turn, both engines turning over within seconds", agentTurn(1, 8100), true, "b0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, reg, clk, engines := kvCountingPool(t, 2)
			scrapeAll := func(b0, b1 int) {
				engines["b0"].set(http.StatusOK, cacheCounters(b0, 0))
				engines["b1"].set(http.StatusOK, cacheCounters(b1, 0))
				scrapeEvery(t, r)
			}
			scrapeAll(0, 0)
			clk.Advance(99 * time.Second)
			b1 := 0
			if tc.b1Fast {
				b1 = 1100
				scrapeAll(0, b1)
			}
			clk.Advance(900 * time.Millisecond)
			l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: agentTurn(1, 8000), Exclude: []string{"b1"}})
			l.Prefilled()
			l.Release(Result{Status: 200})
			clk.Advance(100 * time.Millisecond)
			scrapeAll(2_000, b1+70_000) // b1 stored a pool's worth in 100 s, or in 1
			clk.Advance(time.Second)
			scrapeAll(80_000, b1+70_000) // b0, the context and a pool's worth more in 1 s
			clk.Advance(time.Second)
			if v, _ := testutil.Lookup(t, reg, "pdproxy_backend_kv_turnover_seconds", map[string]string{"backend": "b0"}); v != 1 {
				t.Fatalf("b0's turnover is %v s, want the 1 s this test sets up", v)
			}
			busy := backendByName(t, r, "b1")
			busy.st.inflight.Add(20) // decodes there: 320 tokens of work ahead, b0 none
			defer busy.st.inflight.Add(-20)
			if got, _ := pickOnce(t, r, Hint{Text: tc.text}); got != tc.want {
				t.Errorf("went to %s, want %s", got, tc.want)
			}
		})
	}
}

// Other replicas' requests an engine reports weigh, where this replica has none pending
// there, the pool's mean uncached tokens as of the scrape, less what the engine has computed
// since: a report a scrape interval old does not count prefills the engine has done by now.
// Where it has some pending there, each weighs what its own weigh now on average, as they
// wait in the same queue. Requests decoding there weigh as long as the report stands.
func TestOtherReplicasRequestsWeighAsTheQueueTheyWaitIn(t *testing.T) {
	for _, role := range []routerconfig.Role{routerconfig.RolePrefill, routerconfig.RoleDecode} {
		t.Run(string(role), func(t *testing.T) {
			e := newMetricsEngine(t, testutil.VLLMMetrics(4, 2, 0.2)) // none of them this replica's
			cfg := routerconfig.Config{Backends: []routerconfig.BackendConfig{{Name: "e", URL: e.URL, Role: role}},
				PrefillPolicy: routerconfig.PolicyCacheAware, DecodePolicy: routerconfig.PolicyCacheAware, ScrapeInterval: time.Second}
			if role == routerconfig.RolePrefill {
				cfg.Backends = append(cfg.Backends, routerconfig.BackendConfig{Name: "d", URL: e.URL, Role: routerconfig.RoleDecode})
			}
			r, _, clk := newTestRouter(t, cfg)
			m := r.pool(role).policy.(costSelector).model()
			m.NoteUncached(1000) // the pool's picks computed 1,000 tokens each
			b := backendByName(t, r, "e")
			r.scrape(t.Context(), b, time.Second)
			// 4 waiting; 2 running: prefills half done, or decodes at 16.
			waiting, decoding := 4.0, 0.0
			if role == routerconfig.RolePrefill {
				waiting++
			} else {
				decoding = 2 * routerconfig.DefaultDecodeCostTokens
			}
			rate := 1 / m.Rate() // tokens a second
			for _, after := range []time.Duration{0, 100 * time.Millisecond, 300 * time.Millisecond, 2 * time.Second} {
				want := max(waiting*1000-after.Seconds()*rate, 0) + decoding
				if got := b.workAhead(m, clk.Now().Add(after)); math.Abs(got-want) > 1 {
					t.Errorf("%s after the scrape, none of this replica's pending there: the work ahead is %.0f tokens, want %.0f: %.0f of other replicas' prefill less what the engine computes at %.0f tokens/s, and %.0f of decodes",
						after, got, want, waiting*1000, rate, decoding)
				}
			}

			// This replica sends it one request of 3,000 uncached tokens, pending: each of the
			// others' weighs what it weighs, as it drains.
			l := mustAcquire(t, r, role, Hint{Text: strings.Repeat("x", 3000*bytesPerToken)})
			defer l.Release(Result{Status: 200})
			if l.Backend() != b {
				t.Fatalf("picked %s", l.Backend().Name)
			}
			e.set(200, testutil.VLLMMetrics(5, 0, 0.2)) // others' 4 and this replica's, waiting
			r.scrape(t.Context(), b, time.Second)
			for _, after := range []time.Duration{0, 100 * time.Millisecond} {
				own := 3000 - after.Seconds()*rate
				if got, want := b.workAhead(m, clk.Now().Add(after)), 5*own; math.Abs(got-want) > 1 {
					t.Errorf("%s after its booking, with this replica's own %.0f tokens pending: the work ahead is %.0f tokens, want %.0f: those and the others' 4 waiting at as much each",
						after, own, got, want)
				}
			}
		})
	}
}
