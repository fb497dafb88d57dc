package proxy

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// simEngine runs a simulated engine with cfg on a loopback port until the test ends, its
// handler wrapped by wrap when it is not nil.
func simEngine(t *testing.T, cfg sim.Config, wrap func(http.Handler) http.Handler) (*sim.Engine, string) {
	t.Helper()
	e, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	h := e.Handler()
	if wrap != nil {
		h = wrap(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim engine: %v", err)
		}
		e.CloseIdleConnections()
	})
	return e, srv.URL
}

// lingering holds a streamed answer's response open for a while after its last event, before
// its end (HTTP/1.1's last chunk) goes out, as an engine's server does between the stream's
// last event and the end of the response it writes after it. The proxy closing the connection
// ends the wait. It makes the moment a client may leave in, after the stream's end reached it
// and before the engine's response ended, one every stream has.
func lingering(linger time.Duration) func(http.Handler) http.Handler {
	return func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h.ServeHTTP(w, r)
			if w.Header().Get("Content-Type") != "text/event-stream" {
				return
			}
			t := time.NewTimer(linger)
			defer t.Stop()
			select {
			case <-t.C:
			case <-r.Context().Done():
			}
		})
	}
}

// readEndAndClose sends body to path on the proxy at addr from a client of its own connection,
// reads the streamed answer up to and including the event that ends it (isEnd), and closes
// the connection at once, as scripts and load tools do.
func readEndAndClose(addr, path, body string, isEnd func(event string) bool) error {
	conn, err := net.DialTimeout("tcp", addr, testDeadline)
	if err != nil {
		return err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(testDeadline))
	if _, err := fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		path, addr, len(body), body); err != nil {
		return err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	for {
		ev, err := readEvent(br)
		if err != nil {
			return fmt.Errorf("the stream broke before its end: %q: %w", ev, err)
		}
		if isEnd(ev) {
			return nil
		}
	}
}

// TestAStreamWhoseEndReachedTheClientIsServedThoughTheClientClosesAtOnce: clients that close
// their connection the moment they have read a stream's end, while the engine's response has
// not ended yet, were served: every one is a 200 in pdproxy_requests_total, in its log line
// and in its span, none is aborted, and the engines hold nothing after. In each mode (sequential
// P/D, paired legs, aggregated), for each API's end ([DONE], a Responses stream's last event,
// a Messages stream's message_stop).
func TestAStreamWhoseEndReachedTheClientIsServedThoughTheClientClosesAtOnce(t *testing.T) {
	const (
		streams     = 100
		concurrency = 4
		// linger is far longer than the proxy takes to see a client close its connection.
		linger = 200 * time.Millisecond
	)
	done := func(ev string) bool { return ev == "data: [DONE]\n\n" }
	routes := []struct {
		name, path, body string
		isEnd            func(string) bool
	}{
		{"completions", "/v1/completions", `{"model":"sim","prompt":"hello there","max_tokens":3,"stream":true}`, done},
		{"chat", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"hello there"}],"max_tokens":3,"stream":true}`, done},
		// A Responses stream has no [DONE]: its last event ends it (the sim's, cut by
		// max_output_tokens, is response.incomplete).
		{"responses", "/v1/responses", `{"model":"sim","input":"hello there","max_output_tokens":3,"stream":true}`,
			func(ev string) bool {
				return strings.HasPrefix(ev, "event: response.completed\n") || strings.HasPrefix(ev, "event: response.incomplete\n") ||
					strings.HasPrefix(ev, "event: response.failed\n")
			}},
		{"messages", "/v1/messages", `{"model":"sim","messages":[{"role":"user","content":"hello there"}],"max_tokens":3,"stream":true}`,
			func(ev string) bool { return strings.HasPrefix(ev, "event: message_stop\n") }},
	}
	modes := []struct {
		name string
		// engines starts the mode's engines, its decoders' answers lingering, and returns
		// them and the router's backends.
		engines func(t *testing.T) ([]*sim.Engine, []routerconfig.BackendConfig)
	}{
		{"sequential P/D", func(t *testing.T) ([]*sim.Engine, []routerconfig.BackendConfig) {
			p, pu := simEngine(t, fastSim(sim.ProtocolVLLM, "prefill"), nil)
			d, du := simEngine(t, fastSim(sim.ProtocolVLLM, "decode"), lingering(linger))
			pc, dc := prefiller("p0", pu), decoder("d0", du)
			pc.Engine, dc.Engine = "sim", "sim"
			return []*sim.Engine{p, d}, []routerconfig.BackendConfig{pc, dc}
		}},
		{"paired legs", func(t *testing.T) ([]*sim.Engine, []routerconfig.BackendConfig) {
			p, pu := simEngine(t, fastSim(sim.ProtocolSGLang, "prefill"), nil)
			d, du := simEngine(t, fastSim(sim.ProtocolSGLang, "decode"), lingering(linger))
			pc, dc := prefiller("p0", pu), decoder("d0", du)
			pc.Engine, dc.Engine = "sglang", "sglang"
			return []*sim.Engine{p, d}, []routerconfig.BackendConfig{pc, dc}
		}},
		{"aggregated", func(t *testing.T) ([]*sim.Engine, []routerconfig.BackendConfig) {
			d, du := simEngine(t, fastSim(sim.ProtocolVLLM, "both"), lingering(linger))
			dc := decoder("d0", du)
			dc.Engine = "sim"
			return []*sim.Engine{d}, []routerconfig.BackendConfig{dc}
		}},
	}
	for _, mode := range modes {
		for _, rt := range routes {
			t.Run(mode.name+"/"+rt.name, func(t *testing.T) {
				engines, backends := mode.engines(t)
				spans := tracetest.NewSpanRecorder()
				tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
				t.Cleanup(func() { tp.Shutdown(context.Background()) })
				core, logs := observer.New(zap.InfoLevel)
				h := newHarnessLogged(t, Config{}, routerconfig.Config{Backends: backends}, lifecycle.Config{}, core, WithTracerProvider(tp))
				addr := strings.TrimPrefix(h.front.URL, "http://")

				var (
					wg     sync.WaitGroup
					mu     sync.Mutex
					failed []error
				)
				jobs := make(chan int)
				for range concurrency {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for range jobs {
							if err := readEndAndClose(addr, rt.path, rt.body, rt.isEnd); err != nil {
								mu.Lock()
								failed = append(failed, err)
								mu.Unlock()
							}
						}
					}()
				}
				for i := range streams {
					jobs <- i
				}
				close(jobs)
				wg.Wait()
				if len(failed) > 0 {
					t.Fatalf("%d of %d clients did not read their stream to its end; the first: %v", len(failed), streams, failed[0])
				}
				h.waitQuiet()
				// A request's log line is its last word: written after its table entry went,
				// its metrics and its span.
				testutil.WaitFor(t, testDeadline, func() (bool, string) {
					n := logs.FilterMessage("request").Len()
					return n == streams, fmt.Sprintf("%d request log lines, want %d", n, streams)
				})

				byCode := map[string]float64{}
				for _, code := range []string{"200", "499", "502", "504"} {
					byCode[code] = h.value("pdproxy_requests_total", map[string]string{"route": rt.path, "code": code})
				}
				if byCode["200"] != streams || byCode["499"] != 0 {
					t.Errorf("pdproxy_requests_total by code %v, want all %d streams 200: each client had its stream's end", byCode, streams)
				}
				if n := h.value("pdproxy_aborts_total", nil); n != 0 {
					t.Errorf("pdproxy_aborts_total = %v, want 0: no stream was aborted", n)
				}
				logged := map[int64]int{}
				for _, l := range logs.FilterMessage("request").All() {
					status, _ := l.ContextMap()["status"].(int64)
					logged[status]++
				}
				if logged[http.StatusOK] != streams || len(logged) != 1 {
					t.Errorf("request log lines by status %v, want %d, all 200", logged, streams)
				}
				traced := map[int64]int{}
				for _, s := range spans.Ended() {
					if s.SpanKind() != trace.SpanKindServer {
						continue
					}
					for _, a := range s.Attributes() {
						if a.Key == attribute.Key("http.response.status_code") {
							traced[a.Value.AsInt64()]++
						}
					}
				}
				if traced[http.StatusOK] != streams || len(traced) != 1 {
					t.Errorf("request spans by status %v, want %d, all 200", traced, streams)
				}
				// Every engine's KV free, nothing running, nothing aborted.
				testutil.WaitFor(t, testDeadline, func() (bool, string) {
					for i, e := range engines {
						st := e.Stats()
						if st.BlocksFree != st.BlocksTotal || st.HeldRequests != 0 || st.RunningRequests != 0 || st.WaitingRequests != 0 ||
							st.RoomsHeld != 0 || st.RoomsWaiting != 0 || st.AbortedTotal != 0 || st.DoubleFreeAttemptsTotal != 0 {
							return false, fmt.Sprintf("engine %d: %+v", i, st)
						}
					}
					return true, ""
				})
				if h.table.OutstandingHolds() != 0 {
					t.Errorf("%d KV holds not released", h.table.OutstandingHolds())
				}
			})
		}
	}
}

// fastSim is a simulated engine of protocol and role that answers at once.
func fastSim(protocol, role string) sim.Config {
	cfg := sim.DefaultConfig()
	cfg.Protocol, cfg.Role = protocol, role
	cfg.PrefillTime, cfg.ITL = time.Millisecond, 0
	cfg.BootstrapPort = 0 // a free port, which /server_info reports
	return cfg
}
