package e2e

// llm-d's sidecar slot, driven as llm-d drives its routing sidecar: the scheduler picks this
// decode pod and names the prefiller of each request in x-prefiller-host-port (ip:port, as
// net.JoinHostPort writes it); the proxy prefills there and decodes on the vLLM beside it.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/sim"
)

// simPrefillerAt runs a simulated prefiller listening on host (a port of its own), outside any
// proxy's config, as the prefill pods llm-d's scheduler picks from; it returns its host:port.
func simPrefillerAt(t *testing.T, host string) string {
	t.Helper()
	cfg := sim.DefaultConfig()
	cfg.Role = "prefill"
	cfg.PrefillTime = 2 * time.Millisecond
	eng, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatalf("cannot listen on %s (Linux answers all of 127.0.0.0/8 on loopback): %v", host, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(ctx) }()
	srv := &http.Server{Handler: eng.Handler(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("sim prefiller %s: %v", host, err)
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim prefiller %s: %v", host, err)
		}
		eng.CloseIdleConnections()
	})
	return ln.Addr().String()
}

// kvClean reports whether a simulated engine holds nothing: every block free, no request held,
// running or waiting.
func kvClean(t *testing.T, url string) (bool, string) {
	st := kv(t, url)
	if st.BlocksFree != st.BlocksTotal || st.HeldRequests != 0 || st.RunningRequests != 0 || st.WaitingRequests != 0 || st.DoubleFreeAttemptsTotal != 0 {
		return false, url + ": " + jsonString(st)
	}
	return true, ""
}

func TestLLMDSidecarSlot(t *testing.T) {
	p0 := simPrefillerAt(t, "127.0.0.2")
	p1 := simPrefillerAt(t, "127.0.0.3")
	var strayHits atomic.Int64
	stray := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		strayHits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"text":"H"}],"kv_transfer_params":{"remote_host":"127.0.0.1"}}`)
	}))
	t.Cleanup(stray.Close)

	cfg, err := app.ParseConfig([]byte(fmt.Sprintf(`
listen: 127.0.0.1:0
shutdown_timeout: 2s
prefiller_header: x-prefiller-host-port
prefiller_allow: ["127.0.0.2/32", "%s"]
sims:
  - role: decode
    engine: vllm
    itl: 5ms
    kv_transfer_time: 2ms
`, p1)))
	if err != nil {
		t.Fatal(err)
	}
	s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)
	d := s.m.SimURLs("decode")[0]
	completions := s.url + "/v1/completions"
	header := "x-prefiller-host-port"

	t.Run("each named prefiller gets its prefills, the local decoder every decode", func(t *testing.T) {
		before0, before1, beforeD := kv(t, "http://"+p0), kv(t, "http://"+p1), kv(t, d)
		for i, p := range []string{p0, p1, p0, p1, p1} {
			body := fmt.Sprintf(`{"model":"sim","prompt":"%s","max_tokens":4,"ignore_eos":true,"stream":%v}`, prompt(50), i%2 == 0)
			resp := post(t, context.Background(), completions, body, header, p)
			if i%2 == 0 {
				events := sseEvents(t, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK || len(events) == 0 || events[len(events)-1] != "[DONE]" {
					t.Fatalf("request %d via %s: status %d, events %q", i, p, resp.StatusCode, events)
				}
				continue
			}
			readOK(t, resp)
		}
		after0, after1, afterD := kv(t, "http://"+p0), kv(t, "http://"+p1), kv(t, d)
		if n0, n1 := after0.HoldsTotal-before0.HoldsTotal, after1.HoldsTotal-before1.HoldsTotal; n0 != 2 || n1 != 3 {
			t.Errorf("prefills holding KV: %d on %s, %d on %s; want 2 and 3", n0, p0, n1, p1)
		}
		if n := afterD.RemotePrefillRequestsTotal - beforeD.RemotePrefillRequestsTotal; n != 5 {
			t.Errorf("the local decoder got %d decodes with a prefiller's KV params, want 5", n)
		}
		testutil.WaitFor(t, time.Second, func() (bool, string) { return kvClean(t, "http://"+p0) })
		testutil.WaitFor(t, time.Second, func() (bool, string) { return kvClean(t, "http://"+p1) })
	})

	t.Run("a prefiller outside the allowlist is a 403 and no engine is touched", func(t *testing.T) {
		before0, before1, beforeD := kv(t, "http://"+p0), kv(t, "http://"+p1), kv(t, d)
		for _, target := range []string{stray.Listener.Addr().String(), "127.0.0.3:1", "[::1]:8000"} {
			resp := post(t, context.Background(), completions, `{"model":"sim","prompt":"hi","max_tokens":4}`, header, target)
			e := readOpenAIError(t, resp, http.StatusForbidden)
			if e.Error.Code == nil || *e.Error.Code != "prefiller_not_allowed" || e.Error.Type != "permission_error" {
				t.Errorf("%s: error %+v, want permission_error prefiller_not_allowed", target, *e.Error)
			}
		}
		if n := strayHits.Load(); n != 0 {
			t.Errorf("the server outside the allowlist got %d requests", n)
		}
		after0, after1, afterD := kv(t, "http://"+p0), kv(t, "http://"+p1), kv(t, d)
		if after0.RequestsTotal != before0.RequestsTotal || after1.RequestsTotal != before1.RequestsTotal || afterD.RequestsTotal != beforeD.RequestsTotal {
			t.Errorf("engines served requests that were refused: prefillers %d->%d, %d->%d, decoder %d->%d",
				before0.RequestsTotal, after0.RequestsTotal, before1.RequestsTotal, after1.RequestsTotal, beforeD.RequestsTotal, afterD.RequestsTotal)
		}
		if n := testutil.Value(t, s.m.Registry, "pdproxy_prefiller_header_refused_total", map[string]string{"reason": "not_allowed"}); n != 3 {
			t.Errorf("pdproxy_prefiller_header_refused_total{reason=not_allowed} = %v, want 3", n)
		}
	})

	t.Run("a request without the header is decoded by the local decoder alone", func(t *testing.T) {
		before0, before1, beforeD := kv(t, "http://"+p0), kv(t, "http://"+p1), kv(t, d)
		readOK(t, post(t, context.Background(), completions, `{"model":"sim","prompt":"hi","max_tokens":4,"ignore_eos":true}`))
		after0, after1, afterD := kv(t, "http://"+p0), kv(t, "http://"+p1), kv(t, d)
		if after0.RequestsTotal != before0.RequestsTotal || after1.RequestsTotal != before1.RequestsTotal {
			t.Errorf("a prefiller served a request that named none")
		}
		if afterD.RequestsTotal != beforeD.RequestsTotal+1 || afterD.RemotePrefillRequestsTotal != beforeD.RemotePrefillRequestsTotal {
			t.Errorf("the decoder: %+v before, %+v after; want one request, without KV params", beforeD, afterD)
		}
		if n := testutil.Value(t, s.m.Registry, "pdproxy_decode_only_total", map[string]string{"reason": "no_prefiller_header"}); n != 1 {
			t.Errorf("pdproxy_decode_only_total{reason=no_prefiller_header} = %v, want 1", n)
		}
	})

	t.Run("a client leaving mid-stream frees the KV on the named prefiller", func(t *testing.T) {
		// A long prompt: the local decoder spends 2 ms on each of its 125 blocks before it
		// pulls them, so the prefiller still holds them while the decode is under way. Each
		// subtest's prompt is its own, else the decoder would have the second one's blocks
		// cached from the first, pull nothing and let the prefiller free them at once.
		bodyOf := func(first string) string {
			return `{"model":"sim","prompt":"` + first + " " + prompt(2000) + `","max_tokens":100000,"ignore_eos":true,"stream":true}`
		}
		t.Run("after its first tokens", func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			resp := post(t, ctx, completions, bodyOf("first"), header, p1)
			br := bufio.NewReader(resp.Body)
			for range 3 {
				if _, err := br.ReadString('\n'); err != nil {
					t.Fatal(err)
				}
			}
			cancel()
			resp.Body.Close()
			gone := time.Now()
			testutil.WaitFor(t, time.Second, func() (bool, string) { return kvClean(t, "http://"+p1) })
			testutil.WaitFor(t, time.Second, func() (bool, string) { return kvClean(t, d) })
			t.Logf("the named prefiller and the decoder held nothing %s after the client left", time.Since(gone).Round(time.Millisecond))
		})
		t.Run("while the decoder pulls the KV", func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			beforeD := kv(t, d)
			done := inBackground(t, ctx, completions, bodyOf("second"), header, p1)
			// The client leaves once the decoder has the request: before the proxy has the
			// prefill's answer, leaving is race R1, which an engine without an explicit abort
			// (vllm here) leaves to the prefiller's lease.
			testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
				st, sd := kv(t, "http://"+p1), kv(t, d)
				return st.HeldRequests == 1 && sd.RemotePrefillRequestsTotal > beforeD.RemotePrefillRequestsTotal,
					"the prefiller holds no KV, or the decoder has no decode: " + jsonString(st) + " " + jsonString(sd)
			})
			cancel()
			<-done
			gone := time.Now()
			testutil.WaitFor(t, time.Second, func() (bool, string) { return kvClean(t, "http://"+p1) })
			testutil.WaitFor(t, time.Second, func() (bool, string) { return kvClean(t, d) })
			t.Logf("the named prefiller held nothing %s after the client left", time.Since(gone).Round(time.Millisecond))
		})
	})

	s.assertQuiet(time.Second)
	for _, p := range []string{p0, p1} {
		if ok, why := kvClean(t, "http://"+p); !ok {
			t.Errorf("a prefiller holds KV after the run: %s", why)
		}
	}
}

func TestLLMDSidecarSlotStartsOnlyInItsSlot(t *testing.T) {
	logger := zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel))
	shipped, err := os.ReadFile("../configs/llm-d-sidecar.yaml")
	if err != nil {
		t.Fatal(err)
	}
	t.Run("the shipped config starts", func(t *testing.T) {
		cfg, err := app.ParseConfig(shipped)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Listen = "127.0.0.1:0"
		startConfig(t, logger, cfg)
	})
	for _, tc := range []struct {
		name, yaml, want string
	}{
		{"without an allowlist", "prefiller_header: x-prefiller-host-port\nbackends: [{url: 'http://127.0.0.1:8200', role: decode}]\n", "prefiller_allow"},
		{"with two decoders", "prefiller_header: x-prefiller-host-port\nprefiller_allow: [10.0.0.0/8]\nbackends: [{url: 'http://127.0.0.1:8200', role: decode}, {url: 'http://127.0.0.1:8201', role: decode}]\n", "prefiller_header"},
		{"with a prefill backend", "prefiller_header: x-prefiller-host-port\nprefiller_allow: [10.0.0.0/8]\nbackends: [{url: 'http://10.0.0.1:8000', role: prefill}, {url: 'http://127.0.0.1:8200', role: decode}]\n", "prefiller_header"},
	} {
		t.Run("refused "+tc.name, func(t *testing.T) {
			cfg, err := app.ParseConfig([]byte("listen: 127.0.0.1:0\n" + tc.yaml))
			if err != nil {
				t.Fatal(err)
			}
			m, err := app.New(cfg, logger)
			if err != nil {
				t.Fatal(err)
			}
			err = m.Start(context.Background())
			if err == nil {
				m.Shutdown(context.Background())
				t.Fatal("started")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("start: %v; want the error to name %s", err, tc.want)
			}
		})
	}
}
