package bench

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sharedstate"
	"github.com/pdproxy/pdproxy/sim"
)

// agentWorkload is agent sessions: every session's prompt starts with one preamble (the
// system prompt and the tools' descriptions) that all sessions share, then the session's
// task; each turn adds the agent's tool call and the tool's result, and the next turn's
// prompt is the whole session so far. Every word is three letters, one token of the sim's
// tokenizer, so that the sizes below are tokens. Everything comes from a seed.
type agentWorkload struct {
	sessions, turns int
	preamble        string
	tasks           []string   // per session
	results         [][]string // [session][turn]: the tool result the turn adds
}

// agentShape sizes an agentWorkload.
type agentShape struct {
	sessions, turns            int
	preambleTokens, taskTokens int
	resultMin, resultMax       int // a tool result's tokens, drawn uniformly
	seed                       uint64
}

func newAgentWorkload(s agentShape) *agentWorkload {
	rng := rand.New(rand.NewPCG(s.seed, 0x2545f4914f6cdd1d))
	words := func(n int) string {
		var b strings.Builder
		for i := range n {
			if i > 0 {
				b.WriteByte(' ')
			}
			for range 3 {
				b.WriteByte(byte('a' + rng.IntN(26)))
			}
		}
		return b.String()
	}
	w := &agentWorkload{sessions: s.sessions, turns: s.turns, preamble: words(s.preambleTokens)}
	for range s.sessions {
		w.tasks = append(w.tasks, words(s.taskTokens))
		var rs []string
		for range s.turns {
			rs = append(rs, words(s.resultMin+rng.IntN(s.resultMax-s.resultMin+1)))
		}
		w.results = append(w.results, rs)
	}
	return w
}

// messages is turn t of session s: the preamble, the task, then per earlier turn and this
// one the agent's tool call and the tool's result.
func (w *agentWorkload) messages(s, t int) []sim.ChatMessage {
	m := []sim.ChatMessage{{Role: "system", Content: w.preamble}, {Role: "user", Content: w.tasks[s]}}
	for i := 0; i <= t; i++ {
		m = append(m, sim.ChatMessage{Role: "assistant", Content: fmt.Sprintf("call tool %d", i)},
			sim.ChatMessage{Role: "user", Content: w.results[s][i]})
	}
	return m
}

// streamBody is the streamed chat request of turn t of session s: a short answer.
func (w *agentWorkload) streamBody(s, t int) []byte {
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	var ms []msg
	for _, m := range w.messages(s, t) {
		ms = append(ms, msg{m.Role, m.Content})
	}
	b, _ := json.Marshal(map[string]any{"model": "sim", "messages": ms, "max_tokens": 4, "ignore_eos": true, "stream": true})
	return b
}

// contextBlocks is the full blocks of every session's last turn, the preamble's counted
// once (what a cache holding every session at its end holds), and the blocks of the
// longest request.
func (w *agentWorkload) contextBlocks(blockSize int) (all, longest int) {
	pre := len(sim.TokenizeChat([]sim.ChatMessage{{Role: "system", Content: w.preamble}}, false)) / blockSize
	all = pre
	for s := range w.sessions {
		n := len(sim.TokenizeChat(w.messages(s, w.turns-1), true))
		all += n/blockSize - pre
		longest = max(longest, (n+blockSize-1)/blockSize)
	}
	return all, longest
}

// tierContender is one way of routing the agent sessions.
type tierContender struct {
	policy string
	// weights are kv_events.tier_weights; nil: the defaults (gpu 1, cpu 0.75, disk 0.25).
	weights map[string]float64
	label   string
}

// tierContenders are precise_cache_aware with the default tier weights, the same tier-blind
// two ways (every tier weighted 1: a block on CPU counts as one on GPU; and CPU weighted 0: a
// block on CPU counts as none, as an index that reads only the GPU's events would have it),
// and least_inflight.
func tierContenders() []tierContender {
	return []tierContender{
		{policy: routerconfig.PolicyPreciseCacheAware, label: "precise_cache_aware, tier weights gpu 1, cpu 0.75, disk 0.25 (defaults)"},
		{policy: routerconfig.PolicyPreciseCacheAware, weights: map[string]float64{"gpu": 1, "cpu": 1, "disk": 1},
			label: "precise_cache_aware tier-blind: gpu, cpu, disk all weighted 1"},
		{policy: routerconfig.PolicyPreciseCacheAware, weights: map[string]float64{"gpu": 1, "cpu": 0, "disk": 0},
			label: "precise_cache_aware on the GPU alone: cpu and disk weighted 0 (an index blind to offloaded copies)"},
		{policy: routerconfig.PolicyLeastInflight, label: "least_inflight"},
	}
}

// tierParams sizes TestAgentTiers: the tiny run (every `go test`) shows that each contender
// runs and yields its figures; PDPROXY_BENCH_TIERS=full is the measurement.
type tierParams struct {
	name    string
	shape   agentShape
	engines int
	rounds  int
	// balanceAbs, when set, is cache_aware.balance_abs_threshold of the precise contenders
	// (0: the router's default, 64, which the sessions of one engine do not reach).
	balanceAbs int
}

func tierParamsOf(t *testing.T) tierParams {
	p := tierParams{name: "tiny", engines: 2, rounds: 1,
		shape: agentShape{sessions: 4, turns: 3, preambleTokens: 300, taskTokens: 20, resultMin: 20, resultMax: 100, seed: 7}}
	if os.Getenv("PDPROXY_BENCH_TIERS") == "full" {
		p = tierParams{name: "full", engines: 4, rounds: 3,
			shape: agentShape{sessions: 32, turns: 20, preambleTokens: 6000, taskTokens: 50, resultMin: 200, resultMax: 2000, seed: 7}}
	}
	for env, dst := range map[string]*int{"PDPROXY_BENCH_TIERS_SESSIONS": &p.shape.sessions, "PDPROXY_BENCH_TIERS_TURNS": &p.shape.turns,
		"PDPROXY_BENCH_TIERS_ROUNDS": &p.rounds, "PDPROXY_BENCH_TIERS_ENGINES": &p.engines, "PDPROXY_BENCH_TIERS_BALANCE_ABS": &p.balanceAbs} {
		if v := os.Getenv(env); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 {
				t.Fatalf("%s=%q: want a positive integer", env, v)
			}
			*dst = n
		}
	}
	return p
}

// tierRun is what one contender did with the workload in one round.
type tierRun struct {
	prompt, computed, reloaded, gpuHits int // prompt tokens, all engines
	perEngine                           []int
	ttft                                []time.Duration // sorted
}

// TestAgentTiers measures where each contender sends agent sessions (agentWorkload: 20 turns,
// a 6,000-token preamble shared by all, each turn adding a tool result of 200 to 2,000 tokens)
// on simulated vLLM engines served decode-only, whose GPU caches hold about a quarter of the
// sessions' contexts and whose CPU tiers (vLLM's OffloadingConnector) hold all of them: a
// block the GPU evicts moves to CPU, and a prompt's blocks found there are reloaded at an
// eighth of their recompute. Every engine publishes its KV events (media GPU and CPU) and the
// proxy dials them. Each session is an agent: its next turn is sent when the previous answer
// ended; all sessions run at once. Each contender runs on fresh engines every round, the
// contenders' order rotating round by round; TTFT is the client's time to the first byte of
// the streamed body.
//
// The figures per contender (medians over rounds): prompt tokens computed, reloaded from
// CPU and hit on GPU (the engines' own counts), TTFT p50 and p99, and the most and least
// requests an engine got. The goal they are read against: tier-aware computes at least 30%
// fewer prompt tokens than tier-blind at the same spread.
//
// PDPROXY_BENCH_TIERS=full is the measurement (32 sessions x 20 turns on 4 engines, 3
// rounds); PDPROXY_BENCH_TIERS_SESSIONS, _TURNS, _ENGINES and _ROUNDS override;
// PDPROXY_BENCH_TIERS_OUT=FILE also writes the table to FILE. It asserts only what a user
// would notice: every request answered and streamed to its end, served once, and every
// prompt token counted once as computed, reloaded or hit.
func TestAgentTiers(t *testing.T) {
	const blockSize = 16
	p := tierParamsOf(t)
	if p.shape.resultMax < p.shape.resultMin {
		t.Fatalf("tool results of %d to %d tokens", p.shape.resultMin, p.shape.resultMax)
	}
	w := newAgentWorkload(p.shape)
	all, longest := w.contextBlocks(blockSize)
	cfg := sim.DefaultConfig()
	// A prefill computes 16 tokens of a block at 5µs each; reloading the block from CPU costs
	// an eighth of that (PCIe against compute on a GPU).
	cfg.PrefillTime, cfg.PrefillPerToken, cfg.ITL, cfg.BlockSize = time.Millisecond, 5*time.Microsecond, time.Millisecond, blockSize
	cfg.CPUReloadPerBlock = 10 * time.Microsecond
	cfg.KVHeartbeatInterval = 0
	// Each engine's GPU holds a quarter of its share of the contexts, and never less than the
	// longest request with room to spare; its CPU tier holds every context.
	cfg.KVBlocks = max(all/(4*p.engines), longest*5/4)
	cfg.CPUOffloadBlocks = all
	cfg.KVEventsEndpoint, cfg.KVEventsReplayEndpoint = "tcp://*:0", "tcp://*:0"

	contenders := tierContenders()
	runs := make([][]tierRun, len(contenders))
	for round := range p.rounds {
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			for j := range contenders {
				i := (j + round) % len(contenders)
				t.Run(contenders[i].label, func(t *testing.T) {
					runs[i] = append(runs[i], runTierContender(t, w, contenders[i], cfg, p.engines, p.balanceAbs))
				})
			}
		})
	}

	var b strings.Builder
	fmt.Fprintf(&b, "agent tiers (%s run), %s, %d CPUs, %s: %d sessions x %d turns, %d requests, seed %d; preamble %d tokens, tool results %d-%d tokens; "+
		"%d engines decode-only (sim, vllm protocol), each %d GPU KV blocks of %d tokens (a quarter of its share of the contexts' %d blocks, at least 5/4 of the longest request's %d) and a CPU tier of %d blocks; "+
		"prefill %s + %s/computed token, reload %s/block; cache_aware.balance_abs_threshold %s; medians of %d rounds\n\n",
		p.name, time.Now().UTC().Format(time.RFC3339), runtime.NumCPU(), runtime.Version(), w.sessions, w.turns, w.sessions*w.turns, p.shape.seed,
		p.shape.preambleTokens, p.shape.resultMin, p.shape.resultMax, p.engines, cfg.KVBlocks, blockSize, all, longest, cfg.CPUOffloadBlocks,
		cfg.PrefillTime, cfg.PrefillPerToken, cfg.CPUReloadPerBlock, balanceLabel(p.balanceAbs), p.rounds)
	fmt.Fprintf(&b, "| contender | prompt tokens computed | of all prompt tokens | reloaded from CPU | hit on GPU | TTFT p50 | TTFT p99 | requests per engine max/min |\n")
	fmt.Fprintf(&b, "|---|---|---|---|---|---|---|---|\n")
	for i, c := range contenders {
		rs := runs[i]
		if len(rs) == 0 {
			continue
		}
		med := func(f func(tierRun) float64) float64 { return medianOf(rs, f) }
		fmt.Fprintf(&b, "| %s | %.0f | %.3f | %.0f | %.0f | %.2f ms | %.2f ms | %s |\n", c.label,
			med(func(r tierRun) float64 { return float64(r.computed) }),
			med(func(r tierRun) float64 { return ratio(r.computed, r.prompt) }),
			med(func(r tierRun) float64 { return float64(r.reloaded) }),
			med(func(r tierRun) float64 { return float64(r.gpuHits) }),
			med(func(r tierRun) float64 { return msf(q(r.ttft, 0.5)) }),
			med(func(r tierRun) float64 { return msf(q(r.ttft, 0.99)) }),
			spreadOf(toRoutingRuns(rs), func(r routingRun) []int { return r.decodePerEngine }))
	}
	if len(runs[0]) > 0 && len(runs[1]) > 0 {
		aware := median(floats(runs[0], func(r tierRun) float64 { return float64(r.computed) }))
		blind := median(floats(runs[1], func(r tierRun) float64 { return float64(r.computed) }))
		if blind > 0 {
			fmt.Fprintf(&b, "\ntier-aware computes %.1f%% fewer prompt tokens than tier-blind (goal: at least 30%% at the same spread)\n", 100*(1-aware/blind))
		}
	}
	t.Log("\n" + b.String())
	if out := os.Getenv("PDPROXY_BENCH_TIERS_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
			t.Errorf("write %s: %v", out, err)
		}
	}
}

func balanceLabel(n int) string {
	if n == 0 {
		return "64 (the default)"
	}
	return strconv.Itoa(n)
}

func floats(rs []tierRun, f func(tierRun) float64) []float64 {
	var xs []float64
	for _, r := range rs {
		xs = append(xs, f(r))
	}
	return xs
}

// toRoutingRuns carries the per-engine counts over, for spreadOf.
func toRoutingRuns(rs []tierRun) []routingRun {
	var out []routingRun
	for _, r := range rs {
		out = append(out, routingRun{decodePerEngine: r.perEngine})
	}
	return out
}

// runTierContender starts fresh engines and c's proxy in front of them, runs every session
// at once, each turn after the previous one's answer, and returns what the engines counted.
func runTierContender(t *testing.T, w *agentWorkload, c tierContender, cfg sim.Config, engines, balanceAbs int) tierRun {
	decoders := startSims(t, engines, cfg)
	pcfg := decodeOnlyProxy(t, c.policy, decoders)
	pcfg.Router.KVEvents.TierWeights = c.weights
	pcfg.Router.CacheAware.BalanceAbsThreshold = balanceAbs
	url := startMain(t, pcfg).URL()

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: w.sessions}, Timeout: 5 * time.Minute}
	defer client.CloseIdleConnections()
	var (
		mu   sync.Mutex
		ttft []time.Duration
		wg   sync.WaitGroup
	)
	for s := range w.sessions {
		wg.Go(func() {
			for turn := range w.turns {
				d, err := streamTurn(client, url, w.streamBody(s, turn))
				if err != nil {
					t.Errorf("session %d turn %d: %v", s, turn, err)
					return
				}
				mu.Lock()
				ttft = append(ttft, d)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	slices.Sort(ttft)

	run := tierRun{ttft: ttft}
	for _, d := range decoders {
		st := d.e.Stats()
		run.prompt += st.PrefixCacheQueriesTotal
		run.computed += st.PromptTokensComputedTotal
		run.reloaded += st.ExternalPrefixCacheHitsTotal
		run.gpuHits += st.PrefixCacheHitsTotal
		run.perEngine = append(run.perEngine, st.RequestsTotal)
		checkEngine(t, "engine", st)
	}
	if n := sum(run.perEngine); n != w.sessions*w.turns {
		t.Errorf("the engines served %d requests, want %d", n, w.sessions*w.turns)
	}
	if got := run.computed + run.reloaded + run.gpuHits; got != run.prompt {
		t.Errorf("%d prompt tokens computed + %d reloaded + %d hit on GPU = %d, want every prompt token counted once: %d",
			run.computed, run.reloaded, run.gpuHits, got, run.prompt)
	}
	return run
}

// decodeOnlyProxy is the config of a proxy in this process that serves decoders decode-only
// under policy, dialing each one's KV events and replay endpoints.
// startReplicas starts n proxies (at least one) of the config cfg makes, each its own, behind
// one Redis they share (a run of its own) where shared is set, and answers them and a target
// that sends each request to the next in turn, as a client behind a Service does.
func startReplicas(t testing.TB, n int, shared bool, cfg func() app.Config) (mains []*app.Main, next func() string) {
	t.Helper()
	redis := ""
	if shared {
		redis = redistest.Start(t).Addr()
	}
	var urls []string
	for range max(n, 1) {
		c := cfg()
		if redis != "" {
			c.SharedState = sharedstate.Config{Redis: sharedstate.RedisConfig{Addr: redis}}
		}
		m := startMain(t, c)
		mains, urls = append(mains, m), append(urls, m.URL())
	}
	var turn atomic.Uint64
	return mains, func() string { return urls[(turn.Add(1)-1)%uint64(len(urls))] }
}

func decodeOnlyProxy(t testing.TB, policy string, decoders []*simEngine) app.Config {
	t.Helper()
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 5 * time.Second}
	cfg.Router.DecodePolicy = policy
	for _, d := range decoders {
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{URL: d.srv.URL, Role: routerconfig.RoleDecode, Engine: engine.KindVLLM,
			KVEventsEndpoint: kvDial(t, d.e.KVEventsAddr()), KVEventsReplayEndpoint: kvDial(t, d.e.KVEventsReplayAddr())})
	}
	return cfg
}
