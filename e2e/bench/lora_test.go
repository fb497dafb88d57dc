package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// loraAdapter is the LoRA adapter the engines of TestLoRARouting serve beside their base
// model, sim.
const loraAdapter = "ad"

// loraParams sizes TestLoRARouting: the tiny run (every `go test`) shows that each contender
// runs and yields its figures; PDPROXY_BENCH_LORA=full is the measurement.
type loraParams struct {
	name        string
	shape       workloadShape
	engines     int
	concurrency int // clients per wave
	rounds      int
}

func loraParamsOf(t *testing.T) loraParams {
	p := loraParams{name: "tiny", shape: workloadShape{groups: 2, users: 2, turns: 2, systemWords: 80, questionWords: 10, replyWords: 8, seed: 42},
		engines: 2, concurrency: 4, rounds: 1}
	if os.Getenv("PDPROXY_BENCH_LORA") == "full" {
		p = loraParams{name: "full", shape: defaultShape, engines: 4, concurrency: 8, rounds: 15}
	}
	if v := os.Getenv("PDPROXY_BENCH_LORA_ROUNDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			t.Fatalf("PDPROXY_BENCH_LORA_ROUNDS=%q: want a positive integer", v)
		}
		p.rounds = n
	}
	return p
}

// loraRun is what one contender did with the workload in one round: each identity's prompt
// tokens and those the engines served from their caches (the answers' cached_tokens), the
// requests each engine got, and the KV events the proxy took and dropped.
type loraRun struct {
	tokens, cached [2]int // [0] the base model, [1] the adapter
	perEngine      []int
	events         int
	dropped        int
}

func (r loraRun) hit(i int) float64 { return ratio(r.cached[i], r.tokens[i]) }

// TestLoRARouting measures the prefix-cache hit ratio of the same conversations served half
// on a base model and half on a LoRA adapter of it, on simulated vLLM engines served
// decode-only that key their blocks by the adapter (its name in every block, as vLLM does) and
// publish their KV events with lora_name and extra_keys. Every turn of every session of the
// multi-turn chat workload (chatWorkload) is sent twice, once as model sim and once as
// adapter ad, in a shuffled order; the adapter's copy shares no KV with the base model's,
// so a router that matched tokens alone would take the base model's blocks for the
// adapter's. Each engine's KV pool holds a third of the groups' system prompts under both
// identities. The contenders are precise_cache_aware (the index of the engines' events),
// cache_aware (the routed text, tagged by the identity) and least_inflight, each on fresh
// engines every round, in an order that rotates round by round.
//
// The targets: the adapter's hit ratio within 0.05 of the base model's under
// precise_cache_aware, and at least 0.1 above least_inflight's; no KV event dropped.
// PDPROXY_BENCH_LORA=full is the measurement (the 12x4x3 workload on 4 engines, 15 rounds);
// PDPROXY_BENCH_LORA_ROUNDS overrides the rounds; PDPROXY_BENCH_LORA_OUT=FILE also writes the
// table to FILE. It asserts what a user would notice, every request answered, and that no
// KV event was dropped; the ratios are figures, the targets marked met or not.
func TestLoRARouting(t *testing.T) {
	const blockSize = 16
	p := loraParamsOf(t)
	w := newChatWorkload(p.shape)
	oh, oq := w.oracle(blockSize)
	cfg := sim.DefaultConfig()
	cfg.PrefillTime, cfg.PrefillPerToken, cfg.ITL, cfg.BlockSize = time.Millisecond, 5*time.Microsecond, time.Millisecond, blockSize
	cfg.KVHeartbeatInterval = 0
	cfg.KVBlocks = max(2*w.systemBlocks(blockSize)/3, 2*w.maxBlocks(blockSize))
	cfg.LoRAModules = loraAdapter + "=/adapters/" + loraAdapter
	cfg.KVEventsEndpoint, cfg.KVEventsReplayEndpoint, cfg.KVEventsFormat = "tcp://*:0", "tcp://*:0", "map"

	contenders := []string{routerconfig.PolicyPreciseCacheAware, routerconfig.PolicyCacheAware, routerconfig.PolicyLeastInflight}
	runs := make([][]loraRun, len(contenders))
	for round := range p.rounds {
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			for j := range contenders {
				i := (j + round) % len(contenders)
				// A subtest per contender, so that its engines and proxy stop before the next.
				t.Run(contenders[i], func(t *testing.T) {
					runs[i] = append(runs[i], runLoRAContender(t, w, p, contenders[i], cfg, uint64(round)))
				})
			}
		})
	}

	// med is the median over rounds of f, with the rounds' range where there is more than one.
	med := func(rs []loraRun, f func(loraRun) float64) (float64, string) {
		var xs []float64
		for _, r := range rs {
			xs = append(xs, f(r))
		}
		if len(xs) < 2 {
			return median(xs), ""
		}
		return median(xs), fmt.Sprintf(" (%+.3f to %+.3f)", slices.Min(xs), slices.Max(xs))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "LoRA routing (%s run), %s, %d CPUs, %s: %d groups x %d users x %d turns, each turn sent as model sim and as adapter %s, %d requests, seed %d, %d clients per wave; "+
		"%d engines decode-only (sim, vllm protocol, KV events as maps), each %d KV blocks of %d tokens (a third of the system prompts' %d blocks under both identities), prefill %s + %s/uncached token, itl %s; "+
		"oracle hit ratio of either identity %.3f (one engine, unbounded cache); medians of %d rounds (their range)\n\n",
		p.name, time.Now().UTC().Format(time.RFC3339), runtime.NumCPU(), runtime.Version(), w.groups, w.users, w.turns, loraAdapter, 2*w.groups*w.users*w.turns, p.shape.seed, p.concurrency,
		p.engines, cfg.KVBlocks, blockSize, 2*w.systemBlocks(blockSize), cfg.PrefillTime, cfg.PrefillPerToken, cfg.ITL, ratio(oh, oq), p.rounds)
	fmt.Fprintf(&b, "| routing | hit ratio, base model | hit ratio, adapter | adapter - base | adapter - least_inflight's adapter | requests per engine max/min | KV events taken | dropped, all rounds |\n")
	fmt.Fprintf(&b, "|---|---|---|---|---|---|---|---|\n")
	liAdapter, _ := med(runs[slices.Index(contenders, routerconfig.PolicyLeastInflight)], func(r loraRun) float64 { return r.hit(1) })
	for i, c := range contenders {
		rs := runs[i]
		if len(rs) == 0 {
			continue
		}
		base, _ := med(rs, func(r loraRun) float64 { return r.hit(0) })
		adapter, _ := med(rs, func(r loraRun) float64 { return r.hit(1) })
		d, dSpan := med(rs, func(r loraRun) float64 { return r.hit(1) - r.hit(0) })
		diff, over := fmt.Sprintf("%+.3f%s", d, dSpan), fmt.Sprintf("%+.3f", adapter-liAdapter)
		if c == routerconfig.PolicyPreciseCacheAware {
			diff += " " + loraMet(p, d <= 0.05 && d >= -0.05, "within 0.05")
			over += " " + loraMet(p, adapter-liAdapter >= 0.1, "at least 0.1")
		}
		if c == routerconfig.PolicyLeastInflight {
			over = ""
		}
		most, _ := med(rs, func(r loraRun) float64 { return float64(slices.Max(r.perEngine)) })
		least, _ := med(rs, func(r loraRun) float64 { return float64(slices.Min(r.perEngine)) })
		events, _ := med(rs, func(r loraRun) float64 { return float64(r.events) })
		dropped := 0
		for _, r := range rs {
			dropped += r.dropped
		}
		fmt.Fprintf(&b, "| %s | %.3f | %.3f | %s | %s | %.0f/%.0f | %.0f | %d |\n", c, base, adapter, diff, over, most, least, events, dropped)
	}
	t.Log("\n" + b.String())
	if out := os.Getenv("PDPROXY_BENCH_LORA_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
			t.Errorf("write %s: %v", out, err)
		}
	}
}

// loraMet says whether a target is met; a tiny run is too short to say.
func loraMet(p loraParams, ok bool, target string) string {
	switch {
	case p.name != "full":
		return "(target " + target + ": n/a, tiny run)"
	case ok:
		return "(target " + target + ": met)"
	}
	return "(target " + target + ": NOT met)"
}

// runLoRAContender starts fresh engines and a proxy routing them by policy, waits until the
// proxy knows the adapter on every engine, sends the workload under both identities, and
// returns what the answers and the proxy counted.
func runLoRAContender(t *testing.T, w *chatWorkload, p loraParams, policy string, cfg sim.Config, round uint64) loraRun {
	engines := startSims(t, p.engines, cfg)
	pcfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 5 * time.Second}
	pcfg.Router.DecodePolicy = policy
	pcfg.Router.Health.Interval = 100 * time.Millisecond
	for _, e := range engines {
		// Every proxy dials the events, whatever its policy: the dropped count is the
		// same decoder's for all.
		pcfg.Router.Backends = append(pcfg.Router.Backends, routerconfig.BackendConfig{URL: e.srv.URL, Role: routerconfig.RoleDecode, Engine: engine.KindVLLM,
			KVEventsEndpoint: kvDial(t, e.e.KVEventsAddr()), KVEventsReplayEndpoint: kvDial(t, e.e.KVEventsReplayAddr())})
	}
	m := startMain(t, pcfg)
	// An adapter request is keyed by the adapter once the proxy has read an engine's
	// /v1/models; before, it would be taken for a model of its own.
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		for _, s := range m.Router.Backends() {
			if !slices.Contains(s.Models, loraAdapter) {
				return false, fmt.Sprintf("backend %s lists %v", s.Name, s.Models)
			}
		}
		return m.Router.Adapter(loraAdapter), "the proxy does not take " + loraAdapter + " for an adapter"
	})

	run := loraRun{perEngine: make([]int, len(engines))}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: p.concurrency}, Timeout: time.Minute}
	defer client.CloseIdleConnections()
	type ask struct {
		r     turnRef
		model int // 0 the base model, 1 the adapter
	}
	rng := rand.New(rand.NewPCG(p.shape.seed, round))
	var mu sync.Mutex
	for _, wave := range w.order {
		var asks []ask
		for _, r := range wave {
			asks = append(asks, ask{r, 0}, ask{r, 1})
		}
		rng.Shuffle(len(asks), func(i, j int) { asks[i], asks[j] = asks[j], asks[i] })
		ch := make(chan ask)
		var wg sync.WaitGroup
		for range p.concurrency {
			wg.Go(func() {
				for a := range ch {
					model := []string{"sim", loraAdapter}[a.model]
					tokens, cached, err := loraTurn(client, m.URL(), w.requestAs(a.r, model))
					if err != nil {
						t.Errorf("turn %+v as %s: %v", a.r, model, err)
						continue
					}
					mu.Lock()
					run.tokens[a.model] += tokens
					run.cached[a.model] += cached
					mu.Unlock()
				}
			})
		}
		for _, a := range asks {
			ch <- a
		}
		close(ch)
		wg.Wait()
	}
	for i, e := range engines {
		st := e.e.Stats()
		run.perEngine[i] = st.RequestsTotal
		checkEngine(t, "engine", st)
	}
	if n, want := sum(run.perEngine), 2*w.groups*w.users*w.turns; n != want {
		t.Errorf("the engines served %d requests, want %d", n, want)
	}
	run.events = counterOf(t, m.Registry, "pdproxy_kv_events_total", "", "")
	run.dropped = counterOf(t, m.Registry, "pdproxy_kv_events_dropped_total", "", "")
	if run.dropped != 0 {
		t.Errorf("the proxy dropped %d KV events, want none", run.dropped)
	}
	return run
}

// requestAs is the chat completion request of one turn as model: a short answer, not
// streamed.
func (w *chatWorkload) requestAs(r turnRef, model string) []byte {
	var ms []map[string]string
	for _, m := range w.messages(r) {
		ms = append(ms, map[string]string{"role": m.Role, "content": m.Content})
	}
	b, _ := json.Marshal(map[string]any{"model": model, "messages": ms, "max_tokens": 4, "ignore_eos": true})
	return b
}

// loraTurn posts one chat completion and returns its prompt tokens and those the engine
// served from its cache.
func loraTurn(client *http.Client, url string, body []byte) (tokens, cached int, err error) {
	resp, err := client.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return 0, 0, err
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return 0, 0, err
	}
	var ans struct {
		Usage *struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails *struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if resp.StatusCode != http.StatusOK {
		return 0, 0, fmt.Errorf("status %d: %.300s", resp.StatusCode, b)
	}
	if err := json.Unmarshal(b, &ans); err != nil || ans.Usage == nil || ans.Usage.PromptTokensDetails == nil {
		return 0, 0, fmt.Errorf("no usage with cached_tokens in %.300s", b)
	}
	return ans.Usage.PromptTokens, ans.Usage.PromptTokensDetails.CachedTokens, nil
}
