package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// simEngine is a simulated engine on a loopback port, its scheduler running.
type simEngine struct {
	e   *sim.Engine
	srv *httptest.Server
}

// startSims starts n simulated engines with cfg, stopped when the test ends.
func startSims(t testing.TB, n int, cfg sim.Config) []*simEngine {
	t.Helper()
	var out []*simEngine
	for range n {
		e, err := sim.New(cfg, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- e.Run(ctx) }()
		s := &simEngine{e: e, srv: httptest.NewServer(e.Handler())}
		t.Cleanup(func() {
			s.srv.Close()
			cancel()
			if err := <-done; err != nil {
				t.Errorf("sim Run: %v", err)
			}
			e.CloseIdleConnections()
		})
		out = append(out, s)
	}
	return out
}

// hitRatio is the engines' prefix-cache hits over queries, in tokens.
func hitRatio(engines []*simEngine) (hits, queries int) {
	for _, s := range engines {
		st := s.e.Stats()
		hits += st.PrefixCacheHitsTotal
		queries += st.PrefixCacheQueriesTotal
	}
	return hits, queries
}

// runWorkload sends the workload's waves, one after the other (a turn extends the turn
// before it), each wave's requests from concurrency workers, to the URL target picks, and
// fails the test on any answer but a 200.
func runWorkload(t testing.TB, w *chatWorkload, concurrency int, target func(turnRef) string) {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: concurrency}, Timeout: time.Minute}
	defer client.CloseIdleConnections()
	for _, wave := range w.order {
		refs := make(chan turnRef)
		var wg sync.WaitGroup
		for range concurrency {
			wg.Go(func() {
				for r := range refs {
					resp, err := client.Post(target(r)+"/v1/chat/completions", "application/json", bytes.NewReader(w.body(r)))
					if err != nil {
						t.Errorf("turn %+v: %v", r, err)
						continue
					}
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						t.Errorf("turn %+v: status %d: %.300s", r, resp.StatusCode, b)
					}
				}
			})
		}
		for _, r := range wave {
			refs <- r
		}
		close(refs)
		wg.Wait()
	}
}

// startPolicyProxy runs the proxy in this process in front of prefillers (none:
// decode-only) and decoders, with decode_policy policy.
func startPolicyProxy(t testing.TB, policy string, prefillers, decoders []*simEngine) *app.Main {
	t.Helper()
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 5 * time.Second}
	cfg.Router.DecodePolicy = policy
	for _, p := range prefillers {
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{URL: p.srv.URL, Role: routerconfig.RolePrefill, Engine: engine.KindVLLM})
	}
	for _, d := range decoders {
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{URL: d.srv.URL, Role: routerconfig.RoleDecode, Engine: engine.KindVLLM})
	}
	return startMain(t, cfg)
}

// TestPrefixCacheRouting measures the prefix-cache hit ratio the proxy's routing policies
// reach on the multi-turn chat workload (12 groups x 4 users x 3 turns, a long system
// prompt per group), against its oracle: one engine with an unbounded cache. The fleet is 4
// simulated decoders served decode-only, each with a KV pool (its cache) that holds a
// third of the groups' system prompts, so a policy that scatters a group's users over the
// fleet makes every engine cache every group, and evict. A group-affine assignment
// (group mod 4, straight to the engines) is the reference for what routing by prefix could
// reach. The same policies serve it 1P4D too (a fifth engine prefilling).
// PDPROXY_BENCH_PREFIX_CONCURRENCY sets the clients per wave (default 8),
// PDPROXY_BENCH_PREFIX_ROUNDS the rounds each fleet is measured (default 1; the figures are
// medians), PDPROXY_BENCH_PREFIX_OUT=FILE also writes the figures to FILE.
//
// It asserts only that every request was answered and that the sim, served the workload
// one request at a time with an unbounded cache, reaches the oracle exactly (the oracle
// and the engine count hits the same way); the ratios are figures, printed.
func TestPrefixCacheRouting(t *testing.T) {
	const blockSize = 16
	w := newChatWorkload(defaultShape)
	concurrency := 8
	if v := os.Getenv("PDPROXY_BENCH_PREFIX_CONCURRENCY"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			t.Fatalf("PDPROXY_BENCH_PREFIX_CONCURRENCY=%q: want a positive integer", v)
		}
		concurrency = n
	}
	rounds := 1
	if v := os.Getenv("PDPROXY_BENCH_PREFIX_ROUNDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			t.Fatalf("PDPROXY_BENCH_PREFIX_ROUNDS=%q: want a positive integer", v)
		}
		rounds = n
	}
	oh, oq := w.oracle(blockSize)
	poolBlocks := max(w.systemBlocks(blockSize)/3, 2*w.maxBlocks(blockSize))
	// Work that takes time, so that in-flight counts differ and least_inflight has
	// something to go by: a prefill costs more the less of it is cached.
	cfg := sim.DefaultConfig()
	cfg.PrefillTime, cfg.PrefillPerToken, cfg.ITL, cfg.BlockSize = time.Millisecond, 5*time.Microsecond, time.Millisecond, blockSize
	cfg.KVHeartbeatInterval = 0

	var b strings.Builder
	fmt.Fprintf(&b, "prefix-cache workload: %d groups x %d users x %d turns, %d requests, seed %d; system prompts %d blocks in all, longest request %d blocks; "+
		"bounded engines: %d KV blocks of %d tokens each (a third of the system prompts), %d clients per wave\n",
		w.groups, w.users, w.turns, w.groups*w.users*w.turns, defaultShape.seed, w.systemBlocks(blockSize), w.maxBlocks(blockSize), poolBlocks, blockSize, concurrency)
	ratio := func(h, q int) float64 {
		if q == 0 {
			return 0
		}
		return float64(h) / float64(q)
	}
	fmt.Fprintf(&b, "  %-56s hit ratio %.3f (%d of %d prompt tokens)\n", "oracle: 1 engine, unbounded cache (computed)", ratio(oh, oq), oh, oq)

	unbounded := cfg
	unbounded.KVBlocks = 1 << 20
	one := startSims(t, 1, unbounded)
	runWorkload(t, w, 1, func(turnRef) string { return one[0].srv.URL })
	h, q := hitRatio(one)
	fmt.Fprintf(&b, "  %-56s hit ratio %.3f (%d of %d prompt tokens)\n", "1 sim, unbounded cache, one request at a time", ratio(h, q), h, q)
	if h != oh || q != oq {
		t.Errorf("the sim served alone reached %d/%d hit tokens, the oracle %d/%d", h, q, oh, oq)
	}

	// The fleets: clients run concurrently, so each round orders requests its own way;
	// every row is measured rounds times and reported as its median and range.
	type ratioRow struct {
		name   string
		ratios []float64
	}
	var rows []*ratioRow
	record := func(name string, engines []*simEngine) {
		h, q := hitRatio(engines)
		for _, r := range rows {
			if r.name == name {
				r.ratios = append(r.ratios, ratio(h, q))
				return
			}
		}
		rows = append(rows, &ratioRow{name, []float64{ratio(h, q)}})
	}
	bounded := cfg
	bounded.KVBlocks = poolBlocks
	for round := range rounds {
		// A subtest per round, so that its engines and proxies stop when it ends.
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			for _, policy := range []string{routerconfig.PolicyLeastInflight, routerconfig.PolicyRoundRobin} {
				fleet := startSims(t, 4, bounded)
				m := startPolicyProxy(t, policy, nil, fleet)
				runWorkload(t, w, concurrency, func(turnRef) string { return m.URL() })
				record("proxy "+policy+", 4 sims decode-only", fleet)
			}
			for _, policy := range []string{routerconfig.PolicyLeastInflight, routerconfig.PolicyRoundRobin} {
				// 1P4D: the prefiller computes every prompt, its one cache bounded like
				// the others; the decoders' hits are the blocks they did not pull.
				prefill, decoders := startSims(t, 1, bounded), startSims(t, 4, bounded)
				m := startPolicyProxy(t, policy, prefill, decoders)
				runWorkload(t, w, concurrency, func(turnRef) string { return m.URL() })
				record("proxy "+policy+", 1P4D: the 4 decoders", decoders)
				record("proxy "+policy+", 1P4D: the prefiller", prefill)
			}
			fleet := startSims(t, 4, bounded)
			runWorkload(t, w, concurrency, func(r turnRef) string { return fleet[r.group%len(fleet)].srv.URL })
			record("group-affine (group mod 4, direct), 4 sims", fleet)
		})
	}
	for _, r := range rows {
		sorted := slices.Clone(r.ratios)
		slices.Sort(sorted)
		fmt.Fprintf(&b, "  %-56s hit ratio %.3f (median of %d rounds; %.3f to %.3f)\n", r.name, sorted[len(sorted)/2], len(sorted), sorted[0], sorted[len(sorted)-1])
	}
	t.Log("\n" + b.String())
	if out := os.Getenv("PDPROXY_BENCH_PREFIX_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
			t.Errorf("write %s: %v", out, err)
		}
	}
}
