package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// sharedPool is a 2P3D pool of simulated engines, each on a port of its own, that proxy
// replicas share, and a client of its own that loads it behind their backs: d0 runs long
// streams that no proxy sent, and p0 holds KV for prefills no proxy sent, 92 blocks of 100.
type sharedPool struct {
	engines map[string]*httptest.Server // p0, p1, d0, d1, d2
	// external is the client of the load that does not go through the proxies.
	external *http.Client
	stop     context.CancelFunc
	streams  sync.WaitGroup
}

const (
	externalStreams = 6  // long streams running on d0
	externalHolds   = 23 // prefills holding 4 blocks each on p0: 92 of its 100
)

func startSharedPool(t *testing.T) *sharedPool {
	t.Helper()
	fast := func(c *sim.Config) {
		c.PrefillTime = 5 * time.Millisecond
		c.ITL = 5 * time.Millisecond
	}
	sp := &sharedPool{engines: map[string]*httptest.Server{}, external: &http.Client{Transport: &http.Transport{}}}
	sp.engines["p0"] = startSimEngine(t, func(c *sim.Config) {
		fast(c)
		c.Role, c.KVBlocks, c.KVHoldTimeout = "prefill", 100, 10*time.Minute // the holds outlast the test
	})
	sp.engines["p1"] = startSimEngine(t, func(c *sim.Config) { fast(c); c.Role = "prefill" })
	for _, name := range []string{"d0", "d1", "d2"} {
		sp.engines[name] = startSimEngine(t, func(c *sim.Config) { fast(c); c.Role = "decode" })
	}

	ctx, cancel := context.WithCancel(context.Background())
	sp.stop = cancel
	for i := range externalStreams {
		sp.streams.Go(func() {
			body := `{"model":"sim","prompt":"someone else's","max_tokens":1000000,"ignore_eos":true,"stream":true}`
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, sp.engines["d0"].URL+"/v1/completions", strings.NewReader(body))
			req.Header.Set("X-Request-Id", fmt.Sprintf("ext-stream-%d", i))
			resp, err := sp.external.Do(req)
			if err != nil {
				return // the test's end cancels it
			}
			defer resp.Body.Close()
			_, _ = io.Copy(io.Discard, resp.Body)
		})
	}
	for i := range externalHolds {
		// A prompt of its own (64 tokens, 4 blocks): identical prompts would share their
		// cached blocks and hold 4 in all.
		body := `{"model":"sim","prompt":"` + fmt.Sprintf("%04d", i) + strings.Repeat("abcd", 63) + `","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}`
		req, _ := http.NewRequest(http.MethodPost, sp.engines["p0"].URL+"/v1/completions", strings.NewReader(body))
		req.Header.Set("X-Request-Id", fmt.Sprintf("ext-hold-%d", i))
		resp, err := sp.external.Do(req)
		if err != nil {
			t.Fatalf("external prefill: %v", err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"remote_block_ids"`) {
			t.Fatalf("external prefill answered %d %s, want 200 holding KV", resp.StatusCode, b)
		}
	}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		d0, p0 := kv(t, sp.engines["d0"].URL), kv(t, sp.engines["p0"].URL)
		return d0.RunningRequests == externalStreams && p0.BlocksHeld == 4*externalHolds,
			fmt.Sprintf("d0 %+v, p0 %+v", d0, p0)
	})
	t.Cleanup(func() { sp.release(t) })
	return sp
}

// release ends the load that did not come through the proxies and checks that every engine
// is left with nothing held, running or waiting.
func (sp *sharedPool) release(t *testing.T) {
	sp.stop()
	sp.streams.Wait()
	for i := range externalHolds {
		req, _ := http.NewRequest(http.MethodPost, sp.engines["p0"].URL+"/abort_request", strings.NewReader(fmt.Sprintf(`{"rid":"ext-hold-%d"}`, i)))
		if resp, err := sp.external.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}
	sp.external.CloseIdleConnections()
	for name, srv := range sp.engines {
		testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
			s := kv(t, srv.URL)
			ok := s.BlocksFree == s.BlocksTotal && s.HeldRequests == 0 && s.RunningRequests == 0 && s.WaitingRequests == 0 && s.DoubleFreeAttemptsTotal == 0
			return ok, fmt.Sprintf("%s: %+v", name, s)
		})
	}
}

// replica starts one proxy in front of the pool, picking with policy in both roles.
func (sp *sharedPool) replica(t *testing.T, policy string) *stack {
	t.Helper()
	cfg := app.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.ShutdownTimeout = 2 * time.Second
	cfg.Sims = nil
	cfg.Router.PrefillPolicy, cfg.Router.DecodePolicy = policy, policy
	cfg.Router.ScrapeInterval = 250 * time.Millisecond
	for _, name := range []string{"p0", "p1", "d0", "d1", "d2"} {
		role := routerconfig.RoleDecode
		if name[0] == 'p' {
			role = routerconfig.RolePrefill
		}
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: name, URL: sp.engines[name].URL, Role: role, Engine: "sim"})
	}
	return startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)
}

// sees waits until the replica's least_loaded has scraped the load it was not told about.
func (s *stack) sees(t *testing.T) {
	t.Helper()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		var d0, p0 *router.LoadStatus
		for _, b := range debugBackends(t, s.url) {
			switch b.Name {
			case "d0":
				d0 = b.Load
			case "p0":
				p0 = b.Load
			}
		}
		ok := d0 != nil && !d0.Stale && d0.Running >= externalStreams && p0 != nil && !p0.Stale && p0.KVFull
		return ok, fmt.Sprintf("d0 load %+v, p0 load %+v", d0, p0)
	})
}

// spread is what the replicas sent each engine, as their pdproxy_backend_requests_total say.
type spread map[string]float64

func (sp spread) share(name string, of ...string) float64 {
	var total float64
	for _, n := range of {
		total += sp[n]
	}
	return sp[name] / total
}

func (sp spread) String() string {
	p := sp["p0"] + sp["p1"]
	d := sp["d0"] + sp["d1"] + sp["d2"]
	return fmt.Sprintf("prefill p0 %.0f (%.0f%%) p1 %.0f; decode d0 %.0f (%.0f%%) d1 %.0f d2 %.0f",
		sp["p0"], 100*sp["p0"]/p, sp["p1"], sp["d0"], 100*sp["d0"]/d, sp["d1"], sp["d2"])
}

// driveReplicas sends perWorker requests from each of workers clients to each replica at
// once, checks every one succeeded, and returns what the replicas sent each engine.
func driveReplicas(t *testing.T, replicas []*stack, workers, perWorker int) spread {
	t.Helper()
	body := `{"model":"sim","prompt":"` + prompt(50) + `","max_tokens":20,"ignore_eos":true}`
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	var wg sync.WaitGroup
	failures := make(chan string, len(replicas)*workers*perWorker)
	for _, s := range replicas {
		for range workers {
			wg.Go(func() {
				for range perWorker {
					resp, err := client.Post(s.url+"/v1/completions", "application/json", strings.NewReader(body))
					if err != nil {
						failures <- err.Error()
						continue
					}
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						failures <- fmt.Sprintf("%d %s", resp.StatusCode, b)
					}
				}
			})
		}
	}
	wg.Wait()
	close(failures)
	for f := range failures {
		t.Errorf("a request through a replica failed: %s", f)
	}
	out := spread{}
	for _, s := range replicas {
		for _, m := range testutil.Series(t, s.m.Registry, "pdproxy_backend_requests_total", nil) {
			out[m.Labels["backend"]] += m.Value
		}
	}
	return out
}

// Two proxy replicas in front of one pool, each knowing only its own requests: with
// least_loaded both read the same engines' /metrics, so the load neither of them sent (a busy
// decoder, a prefiller whose KV pool is nearly full of someone else's holds) steers both away;
// least_inflight, for comparison, spreads evenly over engines that have no room.
func TestTwoReplicasWithLeastLoadedSendTheirLoadWhereTheEnginesHaveRoom(t *testing.T) {
	const workers, perWorker = 4, 15 // per replica: 120 requests in all
	sp := startSharedPool(t)

	run := func(policy string) spread {
		replicas := []*stack{sp.replica(t, policy), sp.replica(t, policy)}
		if policy == routerconfig.PolicyLeastLoaded {
			for _, s := range replicas {
				s.sees(t)
			}
		}
		got := driveReplicas(t, replicas, workers, perWorker)
		for _, s := range replicas {
			s.assertNothingInFlight()
		}
		return got
	}
	loaded := run(routerconfig.PolicyLeastLoaded)
	inflight := run(routerconfig.PolicyLeastInflight)
	t.Logf("least_loaded:   %v", loaded)
	t.Logf("least_inflight: %v", inflight)

	total := float64(2 * workers * perWorker)
	for name, sp := range map[string]spread{"least_loaded": loaded, "least_inflight": inflight} {
		if p, d := sp["p0"]+sp["p1"], sp["d0"]+sp["d1"]+sp["d2"]; p != total || d != total {
			t.Errorf("%s: %v prefills and %v decodes counted, want %v each", name, p, d, total)
		}
	}
	// Even shares would be 1/3 of the decodes on d0 and 1/2 of the prefills on p0: with
	// least_loaded, both replicas keep clearly below them.
	if s := loaded.share("d0", "d0", "d1", "d2"); s >= 1.0/6 {
		t.Errorf("least_loaded sent %.0f%% of the decodes to d0, running %d streams of someone else's; want under half its even share of 33%%", 100*s, externalStreams)
	}
	if s := loaded.share("p0", "p0", "p1"); s >= 1.0/4 {
		t.Errorf("least_loaded sent %.0f%% of the prefills to p0, its KV pool 92%% held; want under half its even share of 50%%", 100*s)
	}
}

// assertNothingInFlight checks, once its load is answered, that the replica holds no request
// and no lease.
func (s *stack) assertNothingInFlight() {
	s.t.Helper()
	testutil.WaitFor(s.t, testutil.Timeout, func() (bool, string) {
		if n := s.m.Table.Len(); n != 0 {
			return false, fmt.Sprintf("%d requests still in the table", n)
		}
		for _, b := range s.m.Router.Backends() {
			if b.Inflight != 0 {
				return false, fmt.Sprintf("backend %s in-flight %d", b.Name, b.Inflight)
			}
		}
		return true, ""
	})
}
