package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// withSecondPair adds a second simulated prefiller and decoder to the embedded default:
// sim-prefill-0, sim-decode-1, sim-prefill-2, sim-decode-3.
func withSecondPair(c *app.Config) {
	c.Sims = append(c.Sims, c.Sims[0], c.Sims[1])
}

// loadShape is one kind of request of a steady load.
type loadShape struct {
	path, body string
	stream     bool
}

func loadShapes(maxTokens int) []loadShape {
	n := fmt.Sprint(maxTokens)
	return []loadShape{
		{"/v1/completions", `{"model":"sim","prompt":"` + prompt(50) + `","max_tokens":` + n + `,"ignore_eos":true,"stream":true}`, true},
		{"/v1/completions", `{"model":"sim","prompt":"` + prompt(50) + `","max_tokens":` + n + `,"ignore_eos":true}`, false},
		{"/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"hi there"}],"max_tokens":` + n + `,"ignore_eos":true,"stream":true}`, true},
		{"/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"hi there"}],"max_tokens":` + n + `,"ignore_eos":true}`, false},
	}
}

// outcome is how one request ended, as its client saw it.
type outcome struct {
	start time.Time
	// kind is "ok", or the error the client got: "http 502", "sse error event" ...
	kind string
	// clean is false when the request ended in a way the API does not allow: a hang, a
	// stream that stops with neither [DONE] nor an error event, an error not in the
	// OpenAI shape.
	clean bool
}

// send makes one request of shape and reads its answer to the end.
func send(ctx context.Context, base string, shape loadShape) outcome {
	o := outcome{start: time.Now()}
	end := func(kind string, clean bool) outcome { o.kind, o.clean = kind, clean; return o }
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+shape.path, strings.NewReader(shape.body))
	if err != nil {
		return end(err.Error(), false)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return end("hang", false)
		}
		return end("transport error: "+err.Error(), false)
	}
	defer resp.Body.Close()
	data, rerr := io.ReadAll(resp.Body)
	if ctx.Err() != nil {
		return end("hang", false)
	}
	if resp.StatusCode != http.StatusOK {
		var e struct {
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal(data, &e) != nil || e.Error == nil {
			return end(fmt.Sprintf("http %d without an OpenAI error body: %q", resp.StatusCode, data), false)
		}
		return end(fmt.Sprintf("http %d", resp.StatusCode), true)
	}
	if !shape.stream {
		if rerr != nil {
			// The documented end of a whole answer that broke after its headers went out.
			return end("connection cut after the headers", true)
		}
		var c completion
		if json.Unmarshal(data, &c) != nil || len(c.Choices) == 0 {
			return end(fmt.Sprintf("200 with a body that is no completion: %q", data), false)
		}
		return end("ok", true)
	}
	if rerr != nil {
		return end("stream cut: "+rerr.Error(), false)
	}
	var last string
	for line := range strings.Lines(string(data)) {
		if d, ok := strings.CutPrefix(strings.TrimSpace(line), "data: "); ok {
			last = d
		}
	}
	switch {
	case last == "[DONE]":
		return end("ok", true)
	case strings.HasPrefix(last, `{"error":`):
		return end("sse error event", true)
	}
	return end(fmt.Sprintf("stream ended with neither [DONE] nor an error event: last %q", last), false)
}

// tally counts outcomes by kind, for messages.
func tally(outs []outcome) string {
	n := map[string]int{}
	for _, o := range outs {
		n[o.kind]++
	}
	keys := make([]string, 0, len(n))
	for k := range n {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s: %d; ", k, n[k])
	}
	return strings.TrimSuffix(b.String(), "; ")
}

// backendSpread reads pdproxy_backend_requests_total as "backend role: code=n ..." lines.
func backendSpread(t *testing.T, s *stack) string {
	t.Helper()
	rows := map[string][]string{}
	for _, m := range testutil.Series(t, s.m.Registry, "pdproxy_backend_requests_total", nil) {
		k := m.Labels["backend"] + " " + m.Labels["role"]
		rows[k] = append(rows[k], fmt.Sprintf("%s=%v", m.Labels["code"], m.Value))
	}
	keys := make([]string, 0, len(rows))
	for k := range rows {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for _, k := range keys {
		slices.Sort(rows[k])
		fmt.Fprintf(&b, "\n  %s: %s", k, strings.Join(rows[k], " "))
	}
	return b.String()
}

func statusOf(t *testing.T, s *stack, url string) router.BackendStatus {
	t.Helper()
	for _, b := range debugBackends(t, s.url) {
		if b.URL == url {
			return b
		}
	}
	t.Fatalf("no backend %s in /debug/backends", url)
	return router.BackendStatus{}
}

func TestDecoderKilledUnderLoadFailsOverToTheSurvivor(t *testing.T) {
	s := startStack(t, fastSims, withSecondPair, func(c *app.Config) {
		// Long enough streams that some are on the victim when it dies.
		for i := range c.Sims {
			c.Sims[i].ITL = 5 * time.Millisecond
		}
		// A dead decoder is marked down after two failed checks; the timeout stays long, so
		// a live but busy one never is.
		c.Router.Health.Interval = 100 * time.Millisecond
	})
	victim, survivor := s.m.SimURLs("decode")[1], s.m.SimURLs("decode")[0]
	shapes := loadShapes(30)

	const workers, perWorker = 8, 100
	var (
		mu       sync.Mutex
		results  []outcome
		wg       sync.WaitGroup
		stop     = make(chan struct{})
		stopOnce sync.Once
	)
	stopLoad := func() { stopOnce.Do(func() { close(stop) }); wg.Wait() }
	defer stopLoad()
	for w := range workers {
		wg.Go(func() {
			for i := range perWorker {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				o := send(ctx, s.url, shapes[(w+i)%len(shapes)])
				cancel()
				mu.Lock()
				results = append(results, o)
				mu.Unlock()
			}
		})
	}
	finished := func(after time.Time) int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, o := range results {
			if o.start.After(after) {
				n++
			}
		}
		return n
	}

	var onVictim int64
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		onVictim = statusOf(t, s, victim).Inflight
		return finished(time.Time{}) >= 2*workers && onVictim >= 2, fmt.Sprintf("%d finished, %d on the victim", finished(time.Time{}), onVictim)
	})
	killed := time.Now()
	if err := s.m.StopSim(victim); err != nil {
		t.Fatal(err)
	}
	// A request may have taken the victim between the count above and the kill: count what
	// it had in flight as it died too (a CI run saw 4 failures against a count of 3).
	onVictim = max(onVictim, statusOf(t, s, victim).Inflight)
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		st := statusOf(t, s, victim)
		return !st.Healthy, fmt.Sprintf("the dead decoder still shows %+v", st)
	})
	down := time.Now()
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		return finished(down) >= 3*workers, fmt.Sprintf("%d requests finished since the victim was marked down", finished(down))
	})
	stopLoad()

	var before, between, after []outcome
	for _, o := range results {
		switch {
		case o.start.Before(killed):
			before = append(before, o)
		case o.start.Before(down):
			between = append(between, o)
		default:
			after = append(after, o)
		}
	}
	t.Logf("%d requests; %d on the victim when it died; marked down %s after the kill", len(results), onVictim, down.Sub(killed).Round(time.Millisecond))
	t.Logf("started before the kill: %s", tally(before))
	t.Logf("started between the kill and the victim marked down: %s", tally(between))
	t.Logf("started after: %s", tally(after))
	t.Logf("pdproxy_backend_requests_total:%s", backendSpread(t, s))

	failed := 0
	for _, o := range results {
		if !o.clean {
			t.Errorf("a request ended badly: %s", o.kind)
		}
		if o.kind != "ok" {
			failed++
		}
	}
	// Only a request the victim had already started can fail: one it never got is retried on
	// the survivor. How many it had started at the kill is up to timing, none included.
	if int64(failed) > onVictim {
		t.Errorf("%d requests failed, but only %d were on the decoder when it died", failed, onVictim)
	}
	for _, o := range after {
		if o.kind != "ok" {
			t.Errorf("a request started after the victim was marked down failed: %s", o.kind)
		}
	}

	if st := statusOf(t, s, victim); st.Healthy {
		t.Errorf("dead decoder reported healthy: %+v", st)
	}
	if st := statusOf(t, s, survivor); !st.Healthy {
		t.Errorf("surviving decoder reported unhealthy: %+v", st)
	}
	resp, err := http.Get(s.url + "/ready")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/ready %d with a healthy decoder left", resp.StatusCode)
	}

	// Nothing leaks: every live engine's KV free, no request or hold in the table, every
	// lease released, the dead decoder's included.
	testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
		for _, u := range append(s.m.SimURLs("prefill"), survivor) {
			st := kv(t, u)
			if st.BlocksFree != st.BlocksTotal || st.HeldRequests != 0 || st.RunningRequests != 0 || st.WaitingRequests != 0 || st.DoubleFreeAttemptsTotal != 0 {
				return false, fmt.Sprintf("%s: %s", u, jsonString(st))
			}
		}
		if n := s.m.Table.Len(); n != 0 {
			return false, fmt.Sprintf("%d requests in the table", n)
		}
		if h := s.m.Table.OutstandingHolds(); h != 0 {
			return false, fmt.Sprintf("%d KV holds not released", h)
		}
		for _, b := range s.m.Router.Backends() {
			if b.Inflight != 0 {
				return false, fmt.Sprintf("backend %s in-flight %d", b.Name, b.Inflight)
			}
		}
		return true, ""
	})
	for _, name := range []string{"pdproxy_inflight_requests", "pdproxy_kv_held_requests", "pdproxy_backend_inflight_requests"} {
		if v := testutil.Value(t, s.m.Registry, name, nil); v != 0 {
			t.Errorf("%s sums to %v after the run", name, v)
		}
	}
}

func TestFailingPrefillersAreRetriedThenSkipped(t *testing.T) {
	for _, tc := range []struct {
		name string
		// failing are the prefill sims (0 and 2) that answer every request 503.
		failing []int
		// fallback: with no prefiller left, the decoder computes the prompt itself.
		fallback bool
	}{
		{"a prefiller answering 503 is retried on the other", []int{0}, false},
		{"with every prefiller answering 503 the decoder serves alone", []int{0, 2}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startStack(t, fastSims, func(c *app.Config) {
				c.Sims = append(c.Sims, c.Sims[0]) // sim-prefill-0, sim-decode-1, sim-prefill-2
				for _, i := range tc.failing {
					c.Sims[i].FailStatus = http.StatusServiceUnavailable
				}
				// Turn by turn, so the failing prefiller is some request's first pick.
				c.Router.PrefillPolicy = routerconfig.PolicyRoundRobin
			})
			const n = 8
			shapes := loadShapes(5)
			for i := range n {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				o := send(ctx, s.url, shapes[i%len(shapes)])
				cancel()
				if o.kind != "ok" {
					t.Fatalf("request %d: %s", i, o.kind)
				}
			}
			retries := testutil.Value(t, s.m.Registry, "pdproxy_retries_total", map[string]string{"role": "prefill"})
			fallbacks := testutil.Value(t, s.m.Registry, "pdproxy_fallbacks_total", nil)
			t.Logf("prefill retries %v, decode-only fallbacks %v; pdproxy_backend_requests_total:%s", retries, fallbacks, backendSpread(t, s))
			if retries == 0 {
				t.Error("no prefill retry counted")
			}
			decoder := s.m.SimURLs("decode")[0]
			if got := kv(t, decoder).RequestsTotal; got != n {
				t.Errorf("decoder served %d requests, want %d", got, n)
			}
			if tc.fallback {
				if fallbacks != n {
					t.Errorf("pdproxy_fallbacks_total = %v, want %d: every request went to the decoder alone", fallbacks, n)
				}
			} else {
				if fallbacks != 0 {
					t.Errorf("pdproxy_fallbacks_total = %v with a working prefiller", fallbacks)
				}
				if got := kv(t, s.m.SimURLs("prefill")[1]).RequestsTotal; got != n {
					t.Errorf("the working prefiller prefilled %d requests, want all %d", got, n)
				}
			}
			s.assertQuiet(2 * time.Second)
		})
	}
}

// takeAndDie is a decoder that reads each request whole, then closes the connection without
// a word, as an engine killed right after it accepted a call.
func takeAndDie(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				if req, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
					io.Copy(io.Discard, req.Body)
				}
			})
		}
	})
	return "http://" + ln.Addr().String()
}

func TestADecoderDyingWithTheParamsLeavesNoKVHeld(t *testing.T) {
	dead := takeAndDie(t)
	s := startStack(t, fastSims, func(c *app.Config) {
		c.Sims = c.Sims[:1] // the prefiller only
		c.Router.Backends = []routerconfig.BackendConfig{{Name: "dead", URL: dead, Role: routerconfig.RoleDecode, Engine: "sim"}}
		c.Router.Health.Interval = -1
	})
	p := s.m.SimURLs("prefill")[0]
	for _, shape := range loadShapes(5)[:2] {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		o := send(ctx, s.url, shape)
		cancel()
		if o.kind != "http 502" {
			t.Fatalf("stream %v: %s, want a 502", shape.stream, o.kind)
		}
	}
	if got := kv(t, p).RequestsTotal; got != 2 {
		t.Fatalf("prefiller served %d requests, want 2", got)
	}
	// The decoder got the params and will never pull them nor tell the prefiller: unless the
	// proxy releases them, the blocks stay held for the engine's whole hold timeout (480s).
	testutil.WaitFor(t, 2*time.Second, s.kvAllFree)
	s.assertQuiet(time.Second)
}
