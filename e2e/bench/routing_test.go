package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
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

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sharedstate"
	"github.com/pdproxy/pdproxy/sim"
)

// routingContender is one way of routing the P/D fleet: a policy for both pools, conditional
// disaggregation or not, and how many proxy replicas share the engines; or, with direct, no
// proxy at all.
type routingContender struct {
	policy    string
	threshold int // pd_uncached_token_threshold; 0 always disaggregates
	replicas  int
	// shared gives the replicas a shared state (a Redis the run starts), as replicas are run.
	shared bool
	// balanceAbs, when set, is cache_aware.balance_abs_threshold.
	balanceAbs int
	// direct sends each group's requests straight to decoder group mod 4, decode-only: the
	// reference of what routing by prefix can reach on these decoders.
	direct bool
}

func (c routingContender) name() string {
	if c.direct {
		return "reference: group-affine, group mod 4 straight to the decoders, decode-only"
	}
	s := c.policy
	if c.replicas > 1 {
		s = fmt.Sprintf("%s, %d replicas", s, c.replicas)
		if c.shared {
			s += ", shared state"
		}
	}
	if c.balanceAbs != 0 {
		s = fmt.Sprintf("%s, balance_abs_threshold %d", s, c.balanceAbs)
	}
	if c.threshold > 0 {
		return fmt.Sprintf("%s, pd_uncached_token_threshold %d", s, c.threshold)
	}
	return s + ", always P/D"
}

// routingContenders are every policy with and without conditional disaggregation, two proxy
// replicas on precise_cache_aware, two settings of precise_cache_aware that the figures
// point at (a tighter balance, a higher threshold), and the group-affine reference.
func routingContenders(threshold int) []routingContender {
	var cs []routingContender
	for _, p := range []string{routerconfig.PolicyRoundRobin, routerconfig.PolicyLeastInflight, routerconfig.PolicyPrefixAffinity,
		routerconfig.PolicyLeastLoaded, routerconfig.PolicyCacheAware, routerconfig.PolicyPreciseCacheAware} {
		cs = append(cs, routingContender{policy: p, replicas: 1}, routingContender{policy: p, threshold: threshold, replicas: 1})
	}
	precise := routerconfig.PolicyPreciseCacheAware
	return append(cs,
		routingContender{policy: precise, replicas: 2}, routingContender{policy: precise, threshold: threshold, replicas: 2},
		routingContender{policy: precise, threshold: threshold, replicas: 1, balanceAbs: 1},
		routingContender{policy: precise, threshold: 4 * threshold, replicas: 1},
		routingContender{direct: true})
}

// replicaContenders are the cache-aware policies, always P/D and with the threshold, behind
// one, two and three replicas (PDPROXY_BENCH_ROUTING_ONLY=replicas), alone and, for a policy
// whose replicas share where prompts went (cache_aware), sharing state: what replicas lose of
// one replica's hit ratio and spread.
func replicaContenders(threshold int) []routingContender {
	var cs []routingContender
	for _, p := range []string{routerconfig.PolicyCacheAware, routerconfig.PolicyPreciseCacheAware} {
		for _, th := range []int{0, threshold} {
			for n := 1; n <= 3; n++ {
				cs = append(cs, routingContender{policy: p, threshold: th, replicas: n})
				if caps, _ := routerconfig.CapsOf(p); n > 1 && caps.SharesPlacements {
					cs = append(cs, routingContender{policy: p, threshold: th, replicas: n, shared: true})
				}
			}
		}
	}
	return cs
}

// routingParams sizes TestRoutingContenders: the tiny run (every `go test`) shows that each
// contender runs and yields its figures; PDPROXY_BENCH_ROUTING=full is the measurement.
type routingParams struct {
	name      string
	shape     workloadShape
	rounds    int
	rate      int // requests per second within a wave: the offered load, the same for all
	threshold int
}

func routingParamsOf(t *testing.T) routingParams {
	p := routingParams{name: "tiny", shape: workloadShape{groups: 3, users: 2, turns: 2, systemWords: 120, questionWords: 10, replyWords: 8, seed: 42},
		rounds: 1, rate: 400, threshold: 256}
	if os.Getenv("PDPROXY_BENCH_ROUTING") == "full" {
		p = routingParams{name: "full", shape: defaultShape, rounds: 5, rate: 100, threshold: 256}
	}
	for env, dst := range map[string]*int{"PDPROXY_BENCH_ROUTING_ROUNDS": &p.rounds, "PDPROXY_BENCH_ROUTING_RATE": &p.rate, "PDPROXY_BENCH_ROUTING_THRESHOLD": &p.threshold} {
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

// routingRun is what one contender did with the workload in one round.
type routingRun struct {
	requests                           int
	prefillHits, prefillQueries        int
	decodeHits, decodeQueries          int
	computed                           int // prompt tokens computed, all engines
	pulled                             int // KV blocks the decoders pulled
	prefillPerEngine, decodePerEngine  []int
	decodeOnlyCached, decodeOnlyOthers int
	ttft                               []time.Duration // sorted
}

// TestRoutingContenders measures where each routing policy sends the multi-turn chat
// workload (see chatWorkload) on a P/D fleet of simulated vLLM engines, 2 prefillers and 4
// decoders, each with a KV pool (its prefix cache) that holds a third of the groups' system
// prompts: every policy on both pools, with conditional disaggregation
// (pd_uncached_token_threshold) and without, and two proxy replicas on precise_cache_aware
// behind a client that alternates between them. Every engine publishes its KV events on a
// bound PUB socket with a replay endpoint, and every proxy dials them all, whatever its
// policy: conditional disaggregation reads the decoders' caches from them. Each contender
// runs on fresh engines (empty caches) every round; the contenders' order rotates round by
// round so that drift on a shared machine falls on all of them. Within a wave (one turn of
// every session) requests are sent at a fixed rate, the same offered load for every
// contender, streamed, and TTFT is the client's time to the first byte of the body.
//
// PDPROXY_BENCH_ROUTING=full is the measurement (the 12x4x3 workload, 5 rounds, 100 req/s);
// PDPROXY_BENCH_ROUTING_ROUNDS, _RATE and _THRESHOLD override; PDPROXY_BENCH_ROUTING_OUT=FILE
// also writes the table to FILE. It asserts only what a user would notice: every request
// answered and streamed to its end, each decoded once and prefilled at most once, nothing
// decode-only by cache without a threshold; the figures are printed.
func TestRoutingContenders(t *testing.T) {
	const blockSize = 16
	p := routingParamsOf(t)
	w := newChatWorkload(p.shape)
	oh, oq := w.oracle(blockSize)
	poolBlocks := max(w.systemBlocks(blockSize)/3, 2*w.maxBlocks(blockSize))
	cfg := sim.DefaultConfig()
	// A prefill costs more the less of it is cached, a pulled block costs a quarter of a
	// computed one (a prefill computes 16 tokens of a block at 5µs each): so that computing
	// a few uncached tokens on the decoder can beat a transfer.
	cfg.PrefillTime, cfg.PrefillPerToken, cfg.ITL, cfg.BlockSize = time.Millisecond, 5*time.Microsecond, time.Millisecond, blockSize
	cfg.KVTransferTime = 20 * time.Microsecond
	cfg.KVHeartbeatInterval = 0
	cfg.KVBlocks = poolBlocks
	cfg.KVEventsEndpoint, cfg.KVEventsReplayEndpoint = "tcp://*:0", "tcp://*:0"

	contenders := routingContenders(p.threshold)
	if os.Getenv("PDPROXY_BENCH_ROUTING_ONLY") == "replicas" {
		contenders = replicaContenders(p.threshold)
	}
	runs := make([][]routingRun, len(contenders))
	for round := range p.rounds {
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			for j := range contenders {
				i := (j + round) % len(contenders)
				c := contenders[i]
				// A subtest per contender, so that its engines and proxies stop before the next.
				t.Run(c.name(), func(t *testing.T) {
					runs[i] = append(runs[i], runContender(t, w, c, cfg, p.rate))
				})
			}
		})
	}

	var b strings.Builder
	fmt.Fprintf(&b, "routing contenders (%s run), %s, %d CPUs, %s: %d groups x %d users x %d turns, %d requests, seed %d, %d req/s within a wave; "+
		"2 prefillers + 4 decoders (sim, vllm protocol), %d KV blocks of %d tokens each (a third of the system prompts' %d), prefill %s + %s/uncached token, pull %s/block; "+
		"oracle hit ratio %.3f (%d of %d prompt tokens); medians of %d rounds\n\n",
		p.name, time.Now().UTC().Format(time.RFC3339), runtime.NumCPU(), runtime.Version(), w.groups, w.users, w.turns, w.groups*w.users*w.turns, p.shape.seed, p.rate,
		poolBlocks, blockSize, w.systemBlocks(blockSize), cfg.PrefillTime, cfg.PrefillPerToken, cfg.KVTransferTime,
		ratio(oh, oq), oh, oq, p.rounds)
	fmt.Fprintf(&b, "| contender | hit ratio prefillers | hit ratio decoders | tokens not computed (rounds' range), of the oracle | prefill tokens computed | KV blocks pulled | TTFT p50 | TTFT p99 | TTFT mean | requests per prefiller max/min | per decoder max/min | decode-only (cached) |\n")
	fmt.Fprintf(&b, "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for i, c := range contenders {
		rs := runs[i]
		if len(rs) == 0 {
			continue
		}
		med := func(f func(routingRun) float64) float64 { return medianOf(rs, f) }
		span := func(format string, f func(routingRun) float64) string { return spanOf(rs, format, f) }
		savedOf := func(r routingRun) float64 { return 1 - float64(r.computed)/float64(oq) }
		p99 := func(r routingRun) float64 { return msf(q(r.ttft, 0.99)) }
		avg := func(r routingRun) float64 { return msf(mean(r.ttft)) }
		saved := med(savedOf)
		prefillRatio := fmt.Sprintf("%.3f", med(func(r routingRun) float64 { return ratio(r.prefillHits, r.prefillQueries) }))
		if c.direct {
			prefillRatio = "none"
		}
		fmt.Fprintf(&b, "| %s | %s | %.3f | %.3f%s of oracle %.2f | %.0f | %.0f | %.2f ms | %.2f ms%s | %.2f ms%s | %s | %s | %.0f |\n", c.name(),
			prefillRatio,
			med(func(r routingRun) float64 { return ratio(r.decodeHits, r.decodeQueries) }),
			saved, span("%.3f", savedOf), saved/ratio(oh, oq),
			med(func(r routingRun) float64 { return float64(r.computed) }),
			med(func(r routingRun) float64 { return float64(r.pulled) }),
			med(func(r routingRun) float64 { return msf(q(r.ttft, 0.5)) }),
			med(p99), span("%.1f", p99),
			med(avg), span("%.1f", avg),
			spreadOf(rs, func(r routingRun) []int { return r.prefillPerEngine }),
			spreadOf(rs, func(r routingRun) []int { return r.decodePerEngine }),
			med(func(r routingRun) float64 { return float64(r.decodeOnlyCached) }))
	}
	t.Log("\n" + b.String())
	if out := os.Getenv("PDPROXY_BENCH_ROUTING_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
			t.Errorf("write %s: %v", out, err)
		}
	}
}

func ratio(h, q int) float64 {
	if q == 0 {
		return 0
	}
	return float64(h) / float64(q)
}

func msf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func mean(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	var s time.Duration
	for _, d := range ds {
		s += d
	}
	return s / time.Duration(len(ds))
}

// spreadOf is the median over rounds of the most and least requests an engine of a pool got,
// and of their ratio ("inf" when an engine got none).
func spreadOf(rs []routingRun, per func(routingRun) []int) string {
	var hi, lo, rat []float64
	for _, r := range rs {
		n := per(r)
		if len(n) == 0 {
			return "none"
		}
		a, z := slices.Max(n), slices.Min(n)
		hi, lo = append(hi, float64(a)), append(lo, float64(z))
		if z == 0 {
			rat = append(rat, float64(1<<30))
		} else {
			rat = append(rat, float64(a)/float64(z))
		}
	}
	x := median(rat)
	if x >= 1<<30 {
		return fmt.Sprintf("%.0f/%.0f (inf)", median(hi), median(lo))
	}
	return fmt.Sprintf("%.0f/%.0f (%.2f)", median(hi), median(lo), x)
}

// runContender starts fresh engines and c's proxies in front of them, sends the workload
// and returns what the engines and proxies counted.
func runContender(t *testing.T, w *chatWorkload, c routingContender, cfg sim.Config, rate int) routingRun {
	var prefill []*simEngine
	if !c.direct {
		prefill = startSims(t, 2, cfg)
	}
	decode := startSims(t, 4, cfg)
	var proxies []*app.Main
	var urls []string
	redis := ""
	if c.shared {
		redis = redistest.Start(t).Addr()
	}
	for range c.replicas {
		m := startRoutingProxy(t, c, prefill, decode, redis)
		proxies = append(proxies, m)
		urls = append(urls, m.URL())
	}
	var next atomic.Uint64
	target := func(turnRef) string { return urls[(next.Add(1)-1)%uint64(len(urls))] }
	if c.direct {
		target = func(r turnRef) string { return decode[r.group%len(decode)].srv.URL }
	}
	ttft := runStreamed(t, w, rate, target)

	run := routingRun{requests: w.groups * w.users * w.turns, ttft: ttft}
	for _, s := range prefill {
		st := s.e.Stats()
		run.prefillHits += st.PrefixCacheHitsTotal
		run.prefillQueries += st.PrefixCacheQueriesTotal
		run.computed += st.PromptTokensComputedTotal
		run.prefillPerEngine = append(run.prefillPerEngine, st.RequestsTotal)
		checkEngine(t, "prefiller", st)
	}
	decoderComputed := 0
	for _, s := range decode {
		st := s.e.Stats()
		run.decodeHits += st.PrefixCacheHitsTotal
		run.decodeQueries += st.PrefixCacheQueriesTotal
		run.computed += st.PromptTokensComputedTotal
		decoderComputed += st.PromptTokensComputedTotal
		run.pulled += st.KVBlocksPulledTotal
		run.decodePerEngine = append(run.decodePerEngine, st.RequestsTotal)
		checkEngine(t, "decoder", st)
	}
	for _, m := range proxies {
		cached, all := decodeOnly(t, m.Registry)
		run.decodeOnlyCached += cached
		run.decodeOnlyOthers += all - cached
	}
	if c.direct {
		return run
	}
	// Each request decoded once, and prefilled once unless it went decode-only.
	if n := sum(run.decodePerEngine); n != run.requests {
		t.Errorf("the decoders served %d requests, want %d", n, run.requests)
	}
	if n := sum(run.prefillPerEngine) + run.decodeOnlyCached + run.decodeOnlyOthers; n != run.requests {
		t.Errorf("%d prefills and %d decode-only requests, want %d in all", sum(run.prefillPerEngine), run.decodeOnlyCached+run.decodeOnlyOthers, run.requests)
	}
	if c.threshold == 0 && (run.decodeOnlyCached != 0 || decoderComputed != 0) {
		t.Errorf("without a threshold %d requests went decode-only by cache and the decoders computed %d prompt tokens", run.decodeOnlyCached, decoderComputed)
	}
	return run
}

func checkEngine(t *testing.T, role string, st sim.KVStats) {
	t.Helper()
	if st.DoubleFreeAttemptsTotal != 0 || st.EngineCrashesTotal != 0 {
		t.Errorf("%s: %d double frees, %d crashes", role, st.DoubleFreeAttemptsTotal, st.EngineCrashesTotal)
	}
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}

// decodeOnly reads pdproxy_decode_only_total from a proxy's registry: the cached reason, and
// all reasons.
func decodeOnly(t *testing.T, reg *prometheus.Registry) (cached, all int) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "pdproxy_decode_only_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			n := int(m.GetCounter().GetValue())
			all += n
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == "cached" {
					cached += n
				}
			}
		}
	}
	return cached, all
}

// kvDial is where a proxy on this host dials an engine's bound endpoint ("tcp://[::]:port").
func kvDial(t testing.TB, addr string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(strings.TrimPrefix(addr, "tcp://"))
	if err != nil {
		t.Fatalf("kv events address %q: %v", addr, err)
	}
	return "tcp://127.0.0.1:" + port
}

// startRoutingProxy runs a proxy in this process in front of the P/D fleet with c's policy
// on both pools, dialing every engine's KV events and replay endpoints.
func startRoutingProxy(t testing.TB, c routingContender, prefillers, decoders []*simEngine, redis string) *app.Main {
	t.Helper()
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 5 * time.Second}
	if redis != "" {
		cfg.SharedState = sharedstate.Config{Redis: sharedstate.RedisConfig{Addr: redis}}
	}
	cfg.Router.PrefillPolicy, cfg.Router.DecodePolicy = c.policy, c.policy
	cfg.Proxy.PDUncachedTokenThreshold = c.threshold
	cfg.Router.CacheAware.BalanceAbsThreshold = c.balanceAbs
	add := func(s *simEngine, role routerconfig.Role) {
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{URL: s.srv.URL, Role: role, Engine: engine.KindVLLM,
			KVEventsEndpoint: kvDial(t, s.e.KVEventsAddr()), KVEventsReplayEndpoint: kvDial(t, s.e.KVEventsReplayAddr())})
	}
	for _, p := range prefillers {
		add(p, routerconfig.RolePrefill)
	}
	for _, d := range decoders {
		add(d, routerconfig.RoleDecode)
	}
	return startMain(t, cfg)
}

// runStreamed sends the workload's waves one after the other, each wave's requests at rate
// per second (an open loop: a slow answer does not slow the sending), streamed, to the URL
// target gives, and returns the TTFTs, sorted: from sending to the first byte of the body.
// Any answer but a 200 streamed to its [DONE] fails the test.
func runStreamed(t *testing.T, w *chatWorkload, rate int, target func(turnRef) string) []time.Duration {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: w.groups * w.users}, Timeout: time.Minute}
	defer client.CloseIdleConnections()
	var (
		mu   sync.Mutex
		ttft []time.Duration
	)
	gap := time.Second / time.Duration(rate)
	for _, wave := range w.order {
		var wg sync.WaitGroup
		start := time.Now()
		for i, r := range wave {
			time.Sleep(time.Until(start.Add(time.Duration(i) * gap)))
			url := target(r)
			wg.Go(func() {
				d, err := streamTurn(client, url, w.streamBody(r))
				if err != nil {
					t.Errorf("turn %+v: %v", r, err)
					return
				}
				mu.Lock()
				ttft = append(ttft, d)
				mu.Unlock()
			})
		}
		wg.Wait()
	}
	slices.Sort(ttft)
	return ttft
}

// streamTurn posts one streamed request and returns the time to the first byte of its body.
func streamTurn(client *http.Client, url string, body []byte) (time.Duration, error) {
	return streamTurnWith(client, url, body, nil)
}

// streamTurnWith is streamTurn with the request's headers besides its content type.
func streamTurnWith(client *http.Client, url string, body []byte, hdr http.Header) (time.Duration, error) {
	req, err := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	t0 := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.Peek(1); err != nil {
		return 0, fmt.Errorf("status %d, no body: %w", resp.StatusCode, err)
	}
	d := time.Since(t0)
	rest, err := io.ReadAll(br)
	if err != nil {
		return 0, fmt.Errorf("stream cut: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("status %d: %.300s", resp.StatusCode, rest)
	}
	if !bytes.Contains(rest, []byte("data: [DONE]")) {
		return 0, fmt.Errorf("the stream ended before [DONE]: %.300s", rest)
	}
	return d, nil
}

// BenchmarkRoutingCost is what picking a decoder costs a request, by policy, on 4 simulated
// decoders whose caches hold the workload (their KV events read by the router):
// precise_cache_aware's Router.Tokens (a POST /tokenize to the least loaded engine, on
// loopback) and its Acquire (the pick: index and tree scored), cache_aware's Acquire (the
// tree alone), least_inflight's. precise_cache_aware is measured three ways: with the sims'
// own tokenizer at the engine, and with the engines and the proxy on one tokenizer.json
// (internal/hftok/testdata), tokenized at the engine (_file_engine) or in the proxy
// (_file_in_proxy, the router's tokenizers). p50 and p99 of one request's routing (tokenize
// and pick), of the tokenizing and of the pick (Acquire and Release) are reported in µs,
// besides the mean (ns/op); run with -bench RoutingCost -run '^$'.
func BenchmarkRoutingCost(b *testing.B) {
	w := newChatWorkload(defaultShape)
	type turn struct {
		hint     router.Hint
		messages []map[string]string
	}
	var turns []turn
	for _, wave := range w.order {
		for _, r := range wave {
			var req struct {
				Messages []map[string]string `json:"messages"`
			}
			if err := json.Unmarshal(w.body(r), &req); err != nil {
				b.Fatal(err)
			}
			turns = append(turns, turn{router.Hint{Prefix: w.systems[r.group]}, req.Messages})
		}
	}
	cfg := sim.DefaultConfig()
	cfg.PrefillTime, cfg.ITL, cfg.KVHeartbeatInterval, cfg.KVBlocks = 0, 0, 0, 1<<14
	cfg.KVEventsEndpoint, cfg.KVEventsReplayEndpoint = "tcp://*:0", "tcp://*:0"
	const tokenizerFile, templateFile = "../../internal/hftok/testdata/tokenizer.json", "../../internal/hftok/testdata/tokenizer_config.json"
	for _, bc := range []struct {
		name, policy      string
		withFile, inProxy bool
	}{
		{routerconfig.PolicyPreciseCacheAware, routerconfig.PolicyPreciseCacheAware, false, false},
		{routerconfig.PolicyPreciseCacheAware + "_file_engine", routerconfig.PolicyPreciseCacheAware, true, false},
		{routerconfig.PolicyPreciseCacheAware + "_file_in_proxy", routerconfig.PolicyPreciseCacheAware, true, true},
		{routerconfig.PolicyCacheAware, routerconfig.PolicyCacheAware, false, false},
		{routerconfig.PolicyLeastInflight, routerconfig.PolicyLeastInflight, false, false},
	} {
		b.Run(bc.name, func(b *testing.B) {
			cfg := cfg
			if bc.withFile {
				cfg.Tokenizer = tokenizerFile
			}
			decoders := startSims(b, 4, cfg)
			rcfg := routerconfig.Config{DecodePolicy: bc.policy, Health: routerconfig.HealthConfig{Interval: -1}, EngineTokenizer: engine.Tokenizer{}}
			if bc.inProxy {
				rcfg.Tokenizers = map[string]routerconfig.TokenizerFiles{"sim": {File: tokenizerFile, ChatTemplate: templateFile}}
				var err error
				if rcfg.LocalTokenizers, err = app.LoadTokenizers(proxy.Config{}, rcfg); err != nil {
					b.Fatal(err)
				}
			}
			for i, d := range decoders {
				rcfg.Backends = append(rcfg.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i), URL: d.srv.URL, Role: routerconfig.RoleDecode,
					KVEventsEndpoint: kvDial(b, d.e.KVEventsAddr()), KVEventsReplayEndpoint: kvDial(b, d.e.KVEventsReplayAddr())})
			}
			reg := prometheus.NewRegistry()
			r, err := router.New(rcfg, zap.NewNop(), reg)
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					b.Errorf("router Run: %v", err)
				}
			}()
			// The engines' caches hold every group (each on its group mod 4 engine), and the
			// router knows it from their events.
			runWorkload(b, w, 8, func(t turnRef) string { return decoders[t.group%len(decoders)].srv.URL })
			testutil.WaitFor(b, 10*time.Second, func() (bool, string) {
				for i := range decoders {
					if len(r.CachedBlocks(fmt.Sprintf("d%d", i), 1)) == 0 {
						return false, fmt.Sprintf("the router has no KV events of d%d", i)
					}
				}
				return true, ""
			})
			if err := r.CheckTokenizers(ctx); err != nil {
				b.Fatal(err)
			}
			if v := testutil.Value(b, reg, "pdproxy_tokenizer_in_proxy", map[string]string{"model": "sim"}); bc.inProxy && v != 1 {
				b.Fatalf("pdproxy_tokenizer_in_proxy %v: the proxy's tokenizer is not in use", v)
			}
			precise := r.WantsTokens(routerconfig.RoleDecode)
			var total, tok, pick []time.Duration
			i := 0
			for b.Loop() {
				// Every pick's last message is new, as a conversation's next turn is: the
				// turn's question with the pick's number after it.
				tu := turns[i%len(turns)]
				i++
				msgs := slices.Clone(tu.messages)
				last := maps.Clone(msgs[len(msgs)-1])
				last["content"] += fmt.Sprintf(" (%d)", i)
				msgs[len(msgs)-1] = last
				raw, err := json.Marshal(msgs)
				if err != nil {
					b.Fatal(err)
				}
				h := tu.hint
				h.Text = string(raw)
				t0 := time.Now()
				if precise {
					toks, err := r.Tokens(ctx, router.TokenizeRequest{Model: "sim", Messages: raw})
					if err != nil {
						b.Fatal(err)
					}
					h.Tokens = toks
					tok = append(tok, time.Since(t0))
				}
				t1 := time.Now()
				l, err := r.Acquire(ctx, routerconfig.RoleDecode, h)
				if err != nil {
					b.Fatal(err)
				}
				l.Release(router.Result{})
				t2 := time.Now()
				total, pick = append(total, t2.Sub(t0)), append(pick, t2.Sub(t1))
				if h.Tokens != nil {
					r.ReturnTokens(h.Tokens) // as the proxy does once the request is served
				}
			}
			slices.Sort(total)
			slices.Sort(pick)
			b.ReportMetric(float64(q(total, 0.5))/1e3, "p50-µs")
			b.ReportMetric(float64(q(total, 0.99))/1e3, "p99-µs")
			b.ReportMetric(float64(q(pick, 0.5))/1e3, "pick-p50-µs")
			b.ReportMetric(float64(q(pick, 0.99))/1e3, "pick-p99-µs")
			if precise {
				slices.Sort(tok)
				b.ReportMetric(float64(q(tok, 0.5))/1e3, "tokenize-p50-µs")
				b.ReportMetric(float64(q(tok, 0.99))/1e3, "tokenize-p99-µs")
			}
			r.CloseIdleConnections()
		})
	}
}
