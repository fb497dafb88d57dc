package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

// TestRandomDisconnectsLeaveEveryBlockFree sends requests through a 1P1D stack whose clients
// give up at random moments, then checks both engines got every block back. In CI it sends a
// few hundred; PDPROXY_DISCONNECTS=1000 sends more.
func TestRandomDisconnectsLeaveEveryBlockFree(t *testing.T) {
	n := 200
	if v := os.Getenv("PDPROXY_DISCONNECTS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			t.Fatalf("PDPROXY_DISCONNECTS=%q: %v", v, err)
		}
	}
	s := startStack(t, func(c *app.Config) {
		c.Sims[0].PrefillTime = 5 * time.Millisecond
		c.Sims[0].PrefillPerToken = 10 * time.Microsecond
		c.Sims[1].ITL = 2 * time.Millisecond
		c.Sims[1].KVTransferTime = 100 * time.Microsecond
	})
	runDisconnects(t, s, n)
}

// runDisconnects sends n requests whose clients give up at random moments and checks that
// nothing is left behind.
func runDisconnects(t *testing.T, s *stack, n int) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	defer client.CloseIdleConnections()
	var (
		mu       sync.Mutex
		outcomes = map[string]int{}
		wg       sync.WaitGroup
		next     = make(chan int)
	)
	for w := 0; w < 16; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range next {
				stream := i%2 == 0
				body := fmt.Sprintf(`{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"stream":%t}`, prompt(rng.IntN(800)+1), rng.IntN(40)+1, stream)
				// A request takes tens of milliseconds here (more under -race): clients leave
				// at every stage, and some never do.
				giveUp := time.Duration(rng.IntN(500)) * time.Millisecond
				ctx, cancel := context.WithTimeout(context.Background(), giveUp)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.url+"/v1/completions", strings.NewReader(body))
				outcome := "gave_up_before_answer"
				resp, err := client.Do(req)
				if err != nil && ctx.Err() == nil {
					outcome = "error: " + err.Error()
				}
				if err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					switch {
					case err != nil:
						outcome = "gave_up_mid_answer"
					case resp.StatusCode == 200:
						outcome = "completed"
					default:
						outcome = "status_" + strconv.Itoa(resp.StatusCode)
					}
				}
				cancel()
				mu.Lock()
				outcomes[outcome]++
				mu.Unlock()
			}
		}(w)
	}
	for i := 0; i < n; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	t.Logf("%d requests: %v", n, outcomes)
	for k := range outcomes {
		if strings.HasPrefix(k, "status_") {
			t.Errorf("a request the client waited for failed: %v", outcomes)
		}
	}
	s.assertQuiet(5 * time.Second)
	for _, u := range s.allSimURLs() {
		t.Logf("%s /debug/kv: %s", u, jsonString(kv(t, u)))
	}
}

// TestAbortPropagationByStage measures, for clients leaving at each stage, how long the proxy
// took from seeing the disconnect to cancelling the backend call or sending the release
// (pdproxy_abort_propagation_seconds), and how long until the prefiller's KV was free.
func TestAbortPropagationByStage(t *testing.T) {
	const rounds = 15
	type stageRun struct {
		name  string
		stage string
		setup func(*app.Config)
		run   func(t *testing.T, s *stack) time.Duration // returns the time until the prefiller is free
	}
	freeAfter := func(t *testing.T, s *stack, left time.Time) time.Duration {
		testutil.WaitFor(t, 2*time.Second, prefillerHoldsNothing(t, s))
		return time.Since(left)
	}
	stages := []stageRun{
		{
			name: "prefilling", stage: "prefilling",
			setup: fastSims,
			run: func(t *testing.T, s *stack) time.Duration {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Millisecond)
				defer cancel()
				<-inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(200)+`","max_tokens":5,"ignore_eos":true}`, "X-Sim-Stall", "300ms")
				return freeAfter(t, s, time.Now())
			},
		},
		{
			name: "kv_held", stage: "kv_held",
			setup: func(c *app.Config) {
				fastSims(c)
				c.Sims[1].MaxRunning = 1
				c.Sims[1].MaxInflight = 1
				c.Proxy.DecoderReservation = "after_prefill"
				c.Proxy.KVRelease = "abort"
			},
			run: func(t *testing.T, s *stack) time.Duration {
				stop := busyDecoder(t, s)
				defer stop()
				ctx, cancel := context.WithCancel(context.Background())
				done := inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(200)+`","max_tokens":5,"ignore_eos":true}`)
				testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
					for _, r := range s.m.Table.Snapshot() {
						if r.State.String() == "kv_held" {
							return true, ""
						}
					}
					return false, "no request in kv_held"
				})
				cancel()
				<-done
				return freeAfter(t, s, time.Now())
			},
		},
		{
			name: "decoding (queued in the engine)", stage: "decoding",
			setup: func(c *app.Config) { fastSims(c); c.Sims[1].MaxRunning = 1 },
			run: func(t *testing.T, s *stack) time.Duration {
				stop := busyDecoder(t, s)
				defer stop()
				ctx, cancel := context.WithCancel(context.Background())
				id := fmt.Sprintf("queued-%d", time.Now().UnixNano())
				done := inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(200)+`","max_tokens":5,"ignore_eos":true}`, "X-Request-Id", id)
				testutil.WaitFor(t, 2*time.Second, queuedOnDecoder(t, s, id))
				cancel()
				<-done
				return freeAfter(t, s, time.Now())
			},
		},
	}
	for _, st := range stages {
		t.Run(st.name, func(t *testing.T) {
			s := startStack(t, st.setup)
			var free []time.Duration
			for i := 0; i < rounds; i++ {
				// Each round starts from a quiet stack, so that what it waits for is its own.
				testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
					if n := s.m.Table.Len(); n != 0 {
						return false, fmt.Sprintf("%d requests in flight", n)
					}
					return s.kvAllFree()
				})
				free = append(free, st.run(t, s))
			}
			// At least one per round (the streams that keep the decoder busy count as
			// decoding aborts too when they are stopped).
			if got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": st.stage}); got < rounds {
				t.Fatalf("aborts{stage=%s} = %v, want at least %d", st.stage, got, rounds)
			}
			p50, p99 := histogramQuantiles(t, s, "pdproxy_abort_propagation_seconds", st.stage)
			sort.Slice(free, func(i, j int) bool { return free[i] < free[j] })
			t.Logf("stage %s: abort propagation p50 <= %s, p99 <= %s (histogram bucket bounds); prefiller KV free after the client left: p50 %s, max %s (engine hold timeout if nobody tells it: 480s)",
				st.stage, p50, p99, free[len(free)/2].Round(time.Microsecond), free[len(free)-1].Round(time.Microsecond))
			s.assertQuiet(2 * time.Second)
		})
	}
}

// histogramQuantiles returns the upper bounds of the buckets holding the 50th and 99th
// percentiles of a histogram series with the given stage label.
func histogramQuantiles(t *testing.T, s *stack, name, stage string) (p50, p99 time.Duration) {
	t.Helper()
	h, ok := testutil.HistogramOf(t, s.m.Registry, name, map[string]string{"stage": stage})
	if !ok {
		t.Fatalf("no %s{stage=%s}", name, stage)
	}
	at := func(q float64) time.Duration {
		for _, b := range h.Buckets {
			if float64(b.CumulativeCount) >= q*float64(h.Count) {
				return time.Duration(b.UpperBound * float64(time.Second))
			}
		}
		return -1
	}
	return at(0.5), at(0.99)
}

// TestGracefulShutdownUnderLoad stops the proxy while streams are running: /ready fails at
// once, short streams finish, long ones are aborted at the drain deadline through the table
// (their KV released), and Shutdown returns cleanly.
func TestGracefulShutdownUnderLoad(t *testing.T) {
	cfg := app.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.ShutdownTimeout = 400 * time.Millisecond
	fastSims(&cfg)
	cfg.Sims[1].ITL = 5 * time.Millisecond
	m, err := app.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	s := &stack{t: t, m: m, url: m.URL()}
	defer http.DefaultClient.CloseIdleConnections()

	type result struct {
		long bool
		done bool // saw [DONE]
	}
	results := make(chan result, 20)
	started := make(chan struct{}, 20)
	for i := 0; i < 20; i++ {
		long := i%2 == 0
		maxTokens := 20 // about 100ms: finishes within the drain deadline
		if long {
			maxTokens = 100000
		}
		go func() {
			resp := post(t, context.Background(), s.url+"/v1/completions", fmt.Sprintf(`{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"stream":true}`, prompt(100), maxTokens))
			defer resp.Body.Close()
			br := bufio.NewReader(resp.Body)
			first := true
			done := false
			for {
				line, err := br.ReadString('\n')
				if first {
					started <- struct{}{}
					first = false
				}
				if strings.Contains(line, "[DONE]") {
					done = true
				}
				if err != nil {
					break
				}
			}
			results <- result{long: long, done: done}
		}()
	}
	for i := 0; i < 20; i++ {
		<-started
	}
	shutdownDone := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		shutdownDone <- s.m.Shutdown(ctx)
	}()
	// /ready fails at once, while requests are still being served.
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		w := httptest.NewRecorder()
		s.m.Server.Handler().ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/ready", nil))
		return w.Code == http.StatusServiceUnavailable, fmt.Sprintf("/ready answered %d", w.Code)
	})
	var shortDone, longAborted int
	for i := 0; i < 20; i++ {
		r := <-results
		if !r.long && r.done {
			shortDone++
		}
		if r.long && !r.done {
			longAborted++
		}
	}
	if err := <-shutdownDone; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if shortDone != 10 || longAborted != 10 {
		t.Fatalf("short streams finished: %d/10, long streams cut at the deadline: %d/10", shortDone, longAborted)
	}
	if n := s.m.Table.Len(); n != 0 {
		t.Fatalf("%d requests left in the table", n)
	}
	if h := s.m.Table.OutstandingHolds(); h != 0 {
		t.Fatalf("%d KV holds not released", h)
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "decoding"}); got != 10 {
		t.Errorf("aborts{stage=decoding} = %v, want the 10 long streams", got)
	}
	if _, err := http.Get(s.url + "/health"); err == nil {
		t.Error("the proxy still accepts connections after shutdown")
	}
}
