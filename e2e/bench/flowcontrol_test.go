package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// flowAnswer is one request of the flow-control benchmark as its client saw it.
type flowAnswer struct {
	tenant     string
	code       int
	ttft, took time.Duration // to the first byte of the answer, and to its end
	end        time.Time
	retryAfter string
	err        error
}

// flowSend sends tenant's streamed completion and reads it to its end.
func flowSend(ctx context.Context, c *http.Client, url, tenant string, i, promptWords int) flowAnswer {
	prompt := fmt.Sprintf("%s %d: %s", tenant, i, strings.Repeat("word ", promptWords))
	body := fmt.Sprintf(`{"model":"sim","prompt":%q,"max_tokens":16,"ignore_eos":true,"stream":true}`, prompt)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return flowAnswer{tenant: tenant, err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Tenant", tenant)
	t0 := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return flowAnswer{tenant: tenant, err: err}
	}
	defer resp.Body.Close()
	a := flowAnswer{tenant: tenant, code: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After")}
	br := bufio.NewReader(resp.Body)
	if _, err := br.Peek(1); err != nil {
		a.err = err
		return a
	}
	a.ttft = time.Since(t0)
	rest, err := io.ReadAll(br)
	a.end = time.Now()
	a.took = a.end.Sub(t0)
	if err == nil && a.code == http.StatusOK && !strings.Contains(string(rest), "data: [DONE]") {
		err = fmt.Errorf("the stream ended before [DONE]")
	}
	a.err = err
	return a
}

// flowStack is two simulated engines that compute 2 requests at once each, behind a proxy of
// max_inflight 2 per engine, the flow control of fc.
func flowStack(t *testing.T, fc proxy.FlowControlConfig, policy string, queue routerconfig.QueueConfig) ([]*simEngine, *app.Main) {
	t.Helper()
	engines := startSims(t, 2, sim.Config{Role: "decode", PrefillTime: 10 * time.Millisecond, PrefillPerToken: 40 * time.Microsecond,
		ITL: 3 * time.Millisecond, MaxRunning: 2, KVBlocks: 4096, BlockSize: 16, KVEventsEndpoint: "tcp://*:0", KVEventsReplayEndpoint: "tcp://*:0"})
	cfg := decodeOnlyProxy(t, policy, engines)
	for i := range cfg.Router.Backends {
		cfg.Router.Backends[i].MaxInflight = 2
	}
	cfg.Router.Queue = queue
	cfg.Proxy.FlowControl = fc
	return engines, startMain(t, cfg)
}

// flowClients runs n closed-loop clients of tenant until ctx ends, each sending its next
// request when its last is answered (after 10 ms, when refused), and collects the answers.
func flowClients(ctx context.Context, wg *sync.WaitGroup, c *http.Client, url, tenant string, n, words int, out *flowLog) {
	for k := range n {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				// The last request goes on past ctx: what the engines served is counted.
				a := flowSend(context.WithoutCancel(ctx), c, url, tenant, k*100000+i, words)
				out.add(a)
				if a.code != http.StatusOK {
					time.Sleep(10 * time.Millisecond)
				}
			}
		})
	}
}

// flowOpen sends tenant's requests at rate a second until ctx ends, whatever the answers.
func flowOpen(ctx context.Context, wg *sync.WaitGroup, c *http.Client, url, tenant string, rate float64, words int, out *flowLog) {
	wg.Go(func() {
		tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			wg.Go(func() {
				a := flowSend(context.WithoutCancel(ctx), c, url, tenant, i, words)
				out.add(a)
			})
		}
	})
}

type flowLog struct {
	mu sync.Mutex
	as []flowAnswer
}

func (l *flowLog) add(a flowAnswer) { l.mu.Lock(); l.as = append(l.as, a); l.mu.Unlock() }

func (l *flowLog) all() []flowAnswer { l.mu.Lock(); defer l.mu.Unlock(); return slices.Clone(l.as) }

// ttftP99 is the p99 of tenant's 200s' TTFT, and how many there were.
func ttftP99(as []flowAnswer, tenant string) (time.Duration, int) {
	var ds []time.Duration
	for _, a := range as {
		if a.tenant == tenant && a.code == http.StatusOK && a.err == nil {
			ds = append(ds, a.ttft)
		}
	}
	slices.Sort(ds)
	if len(ds) == 0 {
		return 0, 0
	}
	return q(ds, 0.99), len(ds)
}

// flowSeconds is how long each phase of the flow-control benchmark runs:
// PDPROXY_BENCH_FLOW=full runs 20 s phases, else 4 s.
func flowSeconds() time.Duration {
	if os.Getenv("PDPROXY_BENCH_FLOW") == "full" {
		return 20 * time.Second
	}
	return 4 * time.Second
}

// checkFlowClean asserts what a user would notice after a flow-control run: every answer a
// 200 to its end or a refusal with Retry-After, the engines' requests the 200s, no KV left.
func checkFlowClean(t *testing.T, what string, engines []*simEngine, m *app.Main, as []flowAnswer) (ok, refused int) {
	t.Helper()
	for _, a := range as {
		switch {
		case a.err != nil:
			t.Errorf("%s: %s: %v", what, a.tenant, a.err)
		case a.code == http.StatusOK:
			ok++
		case a.code == http.StatusTooManyRequests || a.code == http.StatusServiceUnavailable:
			refused++
			if n, err := strconv.Atoi(a.retryAfter); err != nil || n < 1 {
				t.Errorf("%s: a %d with Retry-After %q", what, a.code, a.retryAfter)
			}
		default:
			t.Errorf("%s: %s answered %d", what, a.tenant, a.code)
		}
	}
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		total, used := 0, 0
		for _, e := range engines {
			st := e.e.Stats()
			total += st.RequestsTotal
			used += st.BlocksInUse + st.BlocksHeld
		}
		return total == ok && used == 0 && m.Table.Len() == 0,
			fmt.Sprintf("%s: the engines served %d requests for %d 200s, %d blocks in use or held, %d in the table", what, total, ok, used, m.Table.Len())
	})
	for _, e := range engines {
		checkEngine(t, what, e.e.Stats())
	}
	return ok, refused
}

// TestFlowControlTargets measures flow control's targets on the sim: a quiet tenant's TTFT in
// a flood against alone, ten tenants' and 3:1 tenants' served shares, twice the pool's
// capacity offered under saturation_ttft, and the saturation gauge. It asserts what a user
// would notice (statuses, counts, KV clean); the figures are reported, not asserted.
func TestFlowControlTargets(t *testing.T) {
	phase := flowSeconds()
	tenants := func(names ...string) map[string]proxy.TenantConfig {
		m := map[string]proxy.TenantConfig{}
		for _, n := range names {
			m[n] = proxy.TenantConfig{}
		}
		return m
	}
	var report strings.Builder

	t.Run("quiet tenant in a flood", func(t *testing.T) {
		fmt.Fprintf(&report, "| flow control | quiet p99 alone | quiet p99 in the flood | ratio | noisy 200s / refused |\n|---|---|---|---|---|\n")
		for _, on := range []bool{false, true} {
			fc := proxy.FlowControlConfig{}
			if on {
				fc = proxy.FlowControlConfig{TenantHeader: "X-Tenant", Tenants: tenants("quiet", "noisy"), QueueTimeout: time.Minute}
			}
			engines, m := flowStack(t, fc, routerconfig.PolicyLeastInflight, routerconfig.QueueConfig{Size: 4096, Timeout: time.Minute})
			c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
			run := func(flood bool) []flowAnswer {
				var log flowLog
				var wg sync.WaitGroup
				ctx, cancel := context.WithTimeout(context.Background(), phase)
				if flood {
					flowClients(ctx, &wg, c, m.URL(), "noisy", 48, 50, &log)
				}
				flowOpen(ctx, &wg, c, m.URL(), "quiet", 10, 50, &log)
				<-ctx.Done()
				cancel()
				wg.Wait()
				return log.all()
			}
			solo := run(false)
			flood := run(true)
			all := append(solo, flood...)
			checkFlowClean(t, "quiet tenant", engines, m, all)
			p99Solo, _ := ttftP99(solo, "quiet")
			p99Flood, n := ttftP99(flood, "quiet")
			noisy, _ := ttftP99(flood, "noisy")
			_ = noisy
			ok, ref := 0, 0
			for _, a := range flood {
				if a.tenant == "noisy" {
					if a.code == http.StatusOK {
						ok++
					} else {
						ref++
					}
				}
			}
			if n == 0 {
				t.Errorf("flow control %v: the quiet tenant got no answer in the flood", on)
			}
			fmt.Fprintf(&report, "| %v | %s | %s | %.2fx | %d / %d |\n", on, ms(p99Solo), ms(p99Flood), float64(p99Flood)/float64(max(p99Solo, 1)), ok, ref)
			c.CloseIdleConnections()
		}
	})

	t.Run("shares", func(t *testing.T) {
		fmt.Fprintf(&report, "\n| tenants | served each (fair share) | furthest from its share |\n|---|---|---|\n")
		for _, weights := range [][]int{{1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {3, 1}} {
			names := make([]string, len(weights))
			tc := map[string]proxy.TenantConfig{}
			total := 0
			for i, w := range weights {
				names[i] = fmt.Sprintf("t%d", i)
				tc[names[i]] = proxy.TenantConfig{Weight: w}
				total += w
			}
			engines, m := flowStack(t, proxy.FlowControlConfig{TenantHeader: "X-Tenant", Tenants: tc, QueueTimeout: time.Minute},
				routerconfig.PolicyLeastInflight, routerconfig.QueueConfig{Size: 4096, Timeout: time.Minute})
			c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 128}}
			var log flowLog
			var wg sync.WaitGroup
			ctx, cancel := context.WithTimeout(context.Background(), phase)
			phaseEnd, _ := ctx.Deadline()
			for i, n := range names {
				clients := 6 // every tenant waits all along
				if i == 0 && len(names) == 10 {
					clients = 48 // t0 floods
				}
				flowClients(ctx, &wg, c, m.URL(), n, clients, 50, &log)
			}
			<-ctx.Done()
			cancel()
			wg.Wait()
			as := log.all()
			checkFlowClean(t, "shares", engines, m, as)
			// Served within the phase: the requests still waiting at its end are served after
			// it, each client's last, which would count every client once more whatever its
			// tenant's share.
			served, ok := map[string]int{}, 0
			for _, a := range as {
				if a.code == http.StatusOK && a.end.Before(phaseEnd) {
					served[a.tenant]++
					ok++
				}
			}
			var cells []string
			worst := 0.0
			for i, n := range names {
				fair := float64(ok) * float64(weights[i]) / float64(total)
				off := (float64(served[n]) - fair) / fair
				if abs := max(off, -off); abs > max(worst, -worst) {
					worst = off
				}
				cells = append(cells, fmt.Sprintf("%s %d (%.0f)", n, served[n], fair))
			}
			fmt.Fprintf(&report, "| weights %v | %s | %+.1f%% |\n", weights, strings.Join(cells, ", "), 100*worst)
			c.CloseIdleConnections()
		}
	})

	t.Run("twice the capacity", func(t *testing.T) {
		const bound = 300 * time.Millisecond
		// The queue's limit is the bound: a request that waited that long could only be late.
		fc := proxy.FlowControlConfig{TenantHeader: "X-Tenant", Tenants: tenants("a", "b"), QueueTimeout: bound, SaturationTTFT: bound}
		engines, m := flowStack(t, fc, routerconfig.PolicyCacheAware, routerconfig.QueueConfig{Size: 64, Timeout: bound})
		c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
		// Capacity: about 4 requests at once of about 70 ms each, some 55 a second.
		var log flowLog
		var wg sync.WaitGroup
		var sat []float64
		satDone := make(chan struct{})
		reg := m.Registry
		ctx, cancel := context.WithTimeout(context.Background(), phase)
		go func() {
			defer close(satDone)
			tick := time.NewTicker(50 * time.Millisecond) // a scrape's view of the gauge
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				if v, ok := testutil.Lookup(t, reg, "pdproxy_pool_saturation", map[string]string{"role": "decode"}); ok {
					sat = append(sat, v)
				}
			}
		}()
		flowOpen(ctx, &wg, c, m.URL(), "a", 55, 200, &log)
		flowOpen(ctx, &wg, c, m.URL(), "b", 55, 200, &log)
		<-ctx.Done()
		cancel()
		<-satDone
		ended := time.Now()
		fell := time.Duration(-1)
		poll := time.NewTicker(20 * time.Millisecond)
		for time.Since(ended) < 10*time.Second {
			if v, _ := testutil.Lookup(t, reg, "pdproxy_pool_saturation", map[string]string{"role": "decode"}); v < 0.5 {
				fell = time.Since(ended)
				break
			}
			<-poll.C
		}
		poll.Stop()
		wg.Wait()
		as := log.all()
		ok, refused := checkFlowClean(t, "twice the capacity", engines, m, as)
		var ttfts []time.Duration
		late := 0
		var refusedAfter []time.Duration
		for _, a := range as {
			switch a.code {
			case http.StatusOK:
				ttfts = append(ttfts, a.ttft)
			case http.StatusTooManyRequests, http.StatusServiceUnavailable:
				refusedAfter = append(refusedAfter, a.took)
				if a.took > bound+50*time.Millisecond {
					late++
				}
			}
		}
		slices.Sort(ttfts)
		slices.Sort(refusedAfter)
		slices.Sort(sat)
		if refused == 0 || ok == 0 {
			t.Errorf("twice the capacity: %d 200s, %d refused; want both", ok, refused)
		}
		p99 := time.Duration(0)
		if len(ttfts) > 0 {
			p99 = q(ttfts, 0.99)
		}
		satMedian, satMax := 0.0, 0.0
		if len(sat) > 0 {
			satMedian, satMax = sat[len(sat)/2], sat[len(sat)-1]
		}
		refusedMax := time.Duration(0)
		if len(refusedAfter) > 0 {
			refusedMax = refusedAfter[len(refusedAfter)-1]
		}
		fmt.Fprintf(&report, "\n| offered | 200s | refused | admitted TTFT p99 (bound %s) | refusals later than queue_timeout + 50 ms | slowest refusal | saturation median / max in the flood | below 0.5 after |\n|---|---|---|---|---|---|---|---|\n", ms(bound))
		fmt.Fprintf(&report, "| 110/s | %d | %d | %s | %d | %s | %.2f / %.2f | %s |\n", ok, refused, ms(p99), late, ms(refusedMax), satMedian, satMax, fell)
		c.CloseIdleConnections()
	})
	t.Logf("flow control on the sim, %s phases:\n\n%s", phase, report.String())
}
