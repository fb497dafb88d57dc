package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	vegeta "github.com/tsenart/vegeta/v12/lib"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
)

// soakDuration is how long the chaos soak drives load: a few seconds in CI, longer with
// PDPROXY_SOAK (e.g. PDPROXY_SOAK=10m).
func soakDuration(t *testing.T) time.Duration {
	if v := os.Getenv("PDPROXY_SOAK"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("PDPROXY_SOAK=%q: %v", v, err)
		}
		return d
	}
	return 4 * time.Second
}

// twoPTwoD is the soak's layout: two simulated prefillers and two decoders, with decoder
// slots scarce enough that prefilled requests wait in kv_held now and then.
func twoPTwoD(c *app.Config) {
	p := app.SimConfig{Role: "prefill", PrefillTime: 3 * time.Millisecond, KVBlocks: 8192, MaxInflight: 64}
	d := app.SimConfig{Role: "decode", ITL: 2 * time.Millisecond, KVBlocks: 8192, MaxInflight: 6, KVTransferTime: 50 * time.Microsecond}
	c.Sims = []app.SimConfig{p, p, d, d}
	c.Proxy.DecoderReservation = proxy.ReserveAfterPrefill
	c.Proxy.DrainTimeout = 500 * time.Millisecond
	c.Router.Queue.Timeout = 5 * time.Second
	// Injected faults must not eject the engines for the rest of the run.
	c.Router.Ejection.ConsecutiveFailures = -1
}

// counter is a set of named counts, safe for concurrent use.
type counter struct {
	mu sync.Mutex
	m  map[string]int
}

func (c *counter) add(k string) {
	c.mu.Lock()
	if c.m == nil {
		c.m = map[string]int{}
	}
	c.m[k]++
	c.mu.Unlock()
}

func (c *counter) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprint(c.m)
}

func TestChaosSoak(t *testing.T) {
	dur := soakDuration(t)
	core, logs := observer.New(zapcore.WarnLevel)
	logger := zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)).WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewTee(c, core)
	}))
	s := startStackWith(t, logger, twoPTwoD)
	// The baseline is taken as the end count is: once the long-lived loops (health checks,
	// discovery, load scrapes, the sims' heartbeats) have started, with the keep-alive pools
	// empty, and the count steady for 150 ms.
	baseline, steadySince := -1, time.Now()
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		http.DefaultClient.CloseIdleConnections()
		s.m.CloseIdleConnections()
		if n := runtime.NumGoroutine(); n != baseline {
			baseline, steadySince = n, time.Now()
		}
		return time.Since(steadySince) >= 150*time.Millisecond, fmt.Sprintf("goroutines still changing: %d", baseline)
	})

	ctx, cancel := context.WithTimeout(context.Background(), dur+30*time.Second)
	defer cancel()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	defer client.CloseIdleConnections()

	// Clean traffic: vegeta at a steady rate, a mix of completions and chat, streaming and
	// not. Every one of these must succeed.
	rate := vegeta.Rate{Freq: 60, Per: time.Second}
	var n atomic.Uint64
	targeter := func(tg *vegeta.Target) error {
		i := n.Add(1)
		tg.Method = http.MethodPost
		tg.Header = http.Header{"Content-Type": {"application/json"}}
		stream := i%2 == 0
		if i%3 == 0 {
			tg.URL = s.url + "/v1/chat/completions"
			tg.Body = []byte(fmt.Sprintf(`{"model":"sim","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"stream":%t}`, prompt(int(i%300)+1), i%24+1, stream))
		} else {
			tg.URL = s.url + "/v1/completions"
			tg.Body = []byte(fmt.Sprintf(`{"model":"sim","prompt":"%s","max_tokens":%d,"stream":%t}`, prompt(int(i%500)+1), i%24+1, stream))
		}
		return nil
	}
	attacker := vegeta.NewAttacker(vegeta.Client(client), vegeta.Timeout(20*time.Second), vegeta.MaxWorkers(64))
	var metrics vegeta.Metrics
	var codes counter
	attackDone := make(chan struct{})
	go func() {
		defer close(attackDone)
		for res := range attacker.Attack(targeter, rate, dur, "soak") {
			metrics.Add(res)
			codes.add(fmt.Sprint(res.Code))
		}
		metrics.Close()
	}()

	// Chaos: clients that give up at every stage, and requests with injected faults, at the
	// same time as the clean load.
	var (
		giveUps, faults counter
		wg              sync.WaitGroup
		stop            = time.Now().Add(dur)
	)
	for w := 0; w < 6; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			for time.Now().Before(stop) && ctx.Err() == nil {
				switch k := rng.IntN(6); k {
				case 0: // gives up during the prefill: the prefiller stalls its answer
					giveUp(ctx, client, s.url, 20*time.Millisecond, `{"model":"sim","prompt":"stalled","max_tokens":8}`, "X-Sim-Stall", "150ms")
					giveUps.add("during_prefill")
				case 1: // gives up at a random moment of the whole flow
					d := time.Duration(rng.IntN(60)) * time.Millisecond
					giveUp(ctx, client, s.url, d, `{"model":"sim","prompt":"`+prompt(rng.IntN(400)+1)+`","max_tokens":30,"stream":true}`)
					giveUps.add("random_moment")
				case 2: // gives up mid-stream, after a few chunks
					midStream(ctx, client, s.url, 2+rng.IntN(5))
					giveUps.add("mid_stream")
				case 3:
					faults.add("backend_503:" + faultOutcome(ctx, client, s.url, "X-Sim-Fail-Status", "503"))
				case 4:
					faults.add("backend_dies_mid_stream:" + faultOutcome(ctx, client, s.url, "X-Sim-Close-After", "3"))
				case 5:
					faults.add("slow_backend:" + faultOutcome(ctx, client, s.url, "X-Sim-Slow-Write", "3ms"))
				}
			}
		}(w)
	}
	wg.Wait()
	<-attackDone
	client.CloseIdleConnections()

	t.Logf("clean load: %d requests, success %.4f, p50 %s, p99 %s, codes %s",
		metrics.Requests, metrics.Success, metrics.Latencies.P50, metrics.Latencies.P99, codes.String())
	t.Logf("give-ups: %s; proxy aborts by stage: prefilling %v, kv_held %v, decoding %v, received %v",
		giveUps.String(),
		testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "prefilling"}),
		testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "kv_held"}),
		testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "decoding"}),
		testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "received"}))
	t.Logf("faults injected (kind:client saw): %s", faults.String())
	t.Logf("kv releases: decoded %v drained %v aborted %v expired %v",
		testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "decoded"}),
		testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "drained"}),
		testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "aborted"}),
		testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "expired"}))

	if metrics.Requests == 0 || metrics.Success != 1 {
		t.Errorf("clean requests: %d, success ratio %v (errors %v)", metrics.Requests, metrics.Success, metrics.Errors)
	}
	s.assertQuiet(5 * time.Second)
	leaked := 0
	for _, u := range s.allSimURLs() {
		st := kv(t, u)
		leaked += st.BlocksTotal - st.BlocksFree
		t.Logf("%s: %s", u, jsonString(st))
	}
	t.Logf("leaked blocks: %d", leaked)
	// Keep-alive pools (client to proxy, proxy to engines) are not leaks, but they hold
	// goroutines: empty them before comparing with the baseline.
	// Background work that outlives requests on purpose (a repeated engine abort, a drain)
	// dials connections of its own: let it end first.
	wctx, wcancel := context.WithTimeout(context.Background(), 5*time.Second)
	if err := s.m.Server.Wait(wctx); err != nil {
		t.Errorf("background releases still running: %v", err)
	}
	wcancel()
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		// Health checks and the simulated decoders' heartbeats go on meanwhile, each leaving
		// a keep-alive connection behind: empty the pools on every look.
		client.CloseIdleConnections()
		http.DefaultClient.CloseIdleConnections()
		s.m.CloseIdleConnections()
		n := runtime.NumGoroutine()
		if n <= baseline+2 {
			return true, ""
		}
		buf := make([]byte, 1<<20)
		return false, fmt.Sprintf("goroutines %d, baseline %d:\n%s", n, baseline, buf[:runtime.Stack(buf, true)])
	})
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	t.Logf("goroutines: baseline %d, after %d; heap sys %d MiB, peak RSS %s", baseline, runtime.NumGoroutine(), ms.HeapSys>>20, peakRSS())
	for _, e := range logs.All() {
		if strings.Contains(strings.ToLower(e.Message), "panic") {
			t.Errorf("panic logged: %s %v", e.Message, e.ContextMap())
		}
	}
}

// giveUp sends a request and abandons it after d.
func giveUp(ctx context.Context, c *http.Client, base string, d time.Duration, body string, hdr ...string) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	if resp, err := c.Do(req); err == nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// midStream reads n chunks of a long stream and leaves.
func midStream(ctx context.Context, c *http.Client, base string, n int) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions",
		strings.NewReader(`{"model":"sim","prompt":"a long one","max_tokens":100000,"ignore_eos":true,"stream":true}`))
	resp, err := c.Do(req)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for i := 0; i < 2*n; i++ { // an event is a data line and a blank line
		if _, err := br.ReadString('\n'); err != nil {
			return
		}
	}
}

// faultOutcome sends a streaming request carrying a fault header and says what the client saw:
// the status, and for a 200 whether the stream ended with [DONE] or an error event.
func faultOutcome(ctx context.Context, c *http.Client, base, header, value string) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions",
		strings.NewReader(`{"model":"sim","prompt":"faulty","max_tokens":12,"stream":true}`))
	req.Header.Set(header, value)
	resp, err := c.Do(req)
	if err != nil {
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			return "hang"
		}
		return "transport_error"
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	switch {
	case err != nil:
		return fmt.Sprintf("%d_cut", resp.StatusCode)
	case resp.StatusCode != 200:
		return fmt.Sprint(resp.StatusCode)
	case strings.Contains(string(body), `data: {"error"`):
		return "200_error_event"
	case strings.Contains(string(body), "[DONE]"):
		return "200_done"
	}
	return "200_other"
}

// peakRSS is this process's peak resident memory (VmHWM), which includes the test itself.
func peakRSS() string {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return "unknown"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmHWM:") {
			return strings.TrimSpace(strings.TrimPrefix(line, "VmHWM:"))
		}
	}
	return "unknown"
}
