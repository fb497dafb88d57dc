// Package e2e holds tests that start pdproxy as users run it (the same app.Main that
// cmd/proxy uses, or the built binary) with simulated engines on loopback, and drive it
// with real clients: plain HTTP, the OpenAI Go SDK, clients that leave mid-stream.
package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/sim"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(int) {
		if builtDir != "" {
			os.RemoveAll(builtDir)
		}
	}),
		// zmq4's PUB socket may leave its writer goroutine parked after Close (pubSocket.Close
		// closes the socket, not its pubMWriter): one per simulated engine that published KV
		// events, as in kvcache's, router's and the sim's TestMain. The proxy's own sockets
		// are SUB and DEALER, which stop.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		// Nor does any socket's reader of a connection stop when a message arrives as the
		// socket closes: qreader.listen then waits for ever to hand it to a Recv that no
		// longer comes (zmq4 v0.17.0 sends on its channel without watching its context).
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*qreader).listen"))
}

// stack is a running pdproxy with its in-process simulated engines.
type stack struct {
	t   *testing.T
	m   *app.Main
	url string
}

// fastSims makes the embedded default's engines quick, for tests that are about the flow
// and not about timing.
func fastSims(c *app.Config) {
	for i := range c.Sims {
		c.Sims[i].PrefillTime = 2 * time.Millisecond
		c.Sims[i].ITL = time.Millisecond
	}
}

// startStack starts the embedded default on a free port, changed by mutate, and stops it
// when the test ends, checking that nothing was left behind.
func startStack(t *testing.T, mutate ...func(*app.Config)) *stack {
	t.Helper()
	return startStackWith(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), mutate...)
}

// startStackWith is startStack with the logger given.
func startStackWith(t *testing.T, logger *zap.Logger, mutate ...func(*app.Config)) *stack {
	t.Helper()
	cfg := app.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.ShutdownTimeout = 2 * time.Second
	for _, f := range mutate {
		f(&cfg)
	}
	return startConfig(t, logger, cfg)
}

// startConfig starts pdproxy with cfg as given, e.g. as app.LoadConfig made it from flags,
// and stops it when the test ends.
func startConfig(t *testing.T, logger *zap.Logger, cfg app.Config) *stack {
	t.Helper()
	m, err := app.New(cfg, logger)
	if err != nil {
		t.Fatalf("new: %v", err)
	}
	if err := m.Start(context.Background()); err != nil {
		t.Fatalf("start: %v", err)
	}
	s := &stack{t: t, m: m, url: m.URL()}
	t.Cleanup(func() {
		http.DefaultClient.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := m.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	})
	return s
}

// kv reads a simulated engine's /debug/kv.
func kv(t *testing.T, url string) sim.KVStats {
	t.Helper()
	resp, err := http.Get(url + "/debug/kv")
	if err != nil {
		t.Fatalf("GET %s/debug/kv: %v", url, err)
	}
	defer resp.Body.Close()
	var st sim.KVStats
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatalf("decode /debug/kv: %v", err)
	}
	return st
}

// allSimURLs lists every in-process engine.
func (s *stack) allSimURLs() []string {
	return append(s.m.SimURLs("prefill"), s.m.SimURLs("decode")...)
}

// kvAllFree reports whether every engine has every block free and nothing held or running.
func (s *stack) kvAllFree() (bool, string) {
	for _, u := range s.allSimURLs() {
		st := kv(s.t, u)
		if st.BlocksFree != st.BlocksTotal || st.HeldRequests != 0 || st.RunningRequests != 0 || st.WaitingRequests != 0 {
			return false, fmt.Sprintf("%s: %+v", u, st)
		}
		if st.DoubleFreeAttemptsTotal != 0 {
			return false, fmt.Sprintf("%s: double frees: %+v", u, st)
		}
	}
	return true, ""
}

// assertQuiet checks the invariants after a run: every engine's KV free, no request in the
// table, every in-flight gauge at zero.
func (s *stack) assertQuiet(within time.Duration) {
	s.t.Helper()
	testutil.WaitFor(s.t, within, s.kvAllFree)
	testutil.WaitFor(s.t, within, func() (bool, string) {
		if n := s.m.Table.Len(); n != 0 {
			return false, fmt.Sprintf("%d requests still in the table: %+v", n, s.m.Table.Snapshot())
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
	if n := len(testutil.Series(s.t, s.m.Registry, "pdproxy_inflight_requests", nil)); n == 0 {
		s.t.Fatalf("pdproxy_inflight_requests missing: %d series", n)
	}
	for _, name := range []string{"pdproxy_inflight_requests", "pdproxy_kv_held_requests", "pdproxy_backend_inflight_requests"} {
		if v := testutil.Value(s.t, s.m.Registry, name, nil); v != 0 {
			s.t.Fatalf("%s sums to %v after the run", name, v)
		}
	}
}

// post sends a JSON body and returns the response (the caller closes it).
func post(t *testing.T, ctx context.Context, url, body string, hdr ...string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return resp
}

// sseEvents reads an SSE body into its data payloads, in order.
func sseEvents(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "data: ") {
			out = append(out, strings.TrimPrefix(line, "data: "))
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("read stream: %v", err)
	}
	return out
}
