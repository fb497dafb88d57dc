package e2e

// Broken backends: a prefiller answering garbage, a decoder streaming garbage or one endless
// line. The client gets a clean answer or a clean error, the proxy buffers nothing without
// bound and stays up, and nothing is left behind.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// brokenEngine is an engine on a real port that answers completion calls with its handler,
// which picks a fault by the X-Broken header the client sent (the proxy passes it on), and
// every other call (health checks, model lists) with an empty 200.
type brokenEngine struct {
	*httptest.Server
	calls, returned atomic.Int64
}

func newBrokenEngine(t *testing.T, handle func(w http.ResponseWriter, r *http.Request, fault string)) *brokenEngine {
	t.Helper()
	e := &brokenEngine{}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return
		}
		e.calls.Add(1)
		defer e.returned.Add(1)
		io.Copy(io.Discard, r.Body)
		handle(w, r, r.Header.Get("X-Broken"))
	}))
	t.Cleanup(e.Close)
	return e
}

// idle waits until every call the engine got has returned: none is left hanging on a
// connection the proxy forgot.
func (e *brokenEngine) idle(t *testing.T) {
	t.Helper()
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		c, r := e.calls.Load(), e.returned.Load()
		return c == r, fmt.Sprintf("%d of %d calls still running on the engine", c-r, c)
	})
}

// writeForever writes chunk until the connection fails: a backend that never stops.
func writeForever(w http.ResponseWriter, chunk []byte) {
	rc := http.NewResponseController(w)
	for {
		if _, err := w.Write(chunk); err != nil || rc.Flush() != nil {
			return
		}
	}
}

// noEjection keeps a backend that fails on purpose in rotation, so that the next request
// shows whether the proxy itself is still up.
func noEjection(c *app.Config) { c.Router.Ejection.ConsecutiveFailures = -1 }

func sendBroken(t *testing.T, ctx context.Context, url, fault, body string) *http.Response {
	t.Helper()
	return post(t, ctx, url+"/v1/completions", body, "X-Broken", fault)
}

func TestBrokenPrefillerAnswers(t *testing.T) {
	p := newBrokenEngine(t, func(w http.ResponseWriter, r *http.Request, fault string) {
		w.Header().Set("Content-Type", "application/json")
		answer := func(params string) {
			io.WriteString(w, `{"id":"cmpl-p","object":"text_completion","model":"sim","choices":[{"index":0,"text":"H","finish_reason":"length"}],"kv_transfer_params":`+params+`}`)
		}
		switch fault {
		case "params-string":
			answer(`"garbage"`)
		case "params-array":
			answer(`[1,2,3]`)
		case "params-junk-object":
			answer(`{"junk":true,"nested":{"list":[1,"two",null]}}`)
		case "not-json":
			w.Header().Set("Content-Type", "text/html")
			io.WriteString(w, "<html><body>502 Bad Gateway</body></html>")
		case "endless":
			writeForever(w, bytes.Repeat([]byte("x"), 64<<10))
		default:
			answer(`null`)
		}
	})
	for _, fallback := range []bool{true, false} {
		t.Run(fmt.Sprintf("decode_only_fallback %v", fallback), func(t *testing.T) {
			s := startStack(t, func(c *app.Config) {
				fastSims(c)
				c.Sims = c.Sims[1:] // the simulated decoder only
				c.Router.Backends = []routerconfig.BackendConfig{{Name: "broken-prefill", URL: p.URL, Role: routerconfig.RolePrefill, Engine: "vllm"}}
				c.Proxy.DecodeOnlyFallback = &fallback
				noEjection(c)
			})
			for _, tc := range []struct {
				fault string
				// code is the 502's code without the fallback; "" means the answer is good.
				code string
			}{
				{"params-string", "bad_kv_transfer_params"},
				{"params-array", "bad_kv_transfer_params"},
				{"not-json", "backend_unreachable"},
				{"endless", "backend_unreachable"},
				// An object is opaque: it goes to the decoder as it came.
				{"params-junk-object", ""},
			} {
				t.Run(tc.fault, func(t *testing.T) {
					before := testutil.Value(t, s.m.Registry, "pdproxy_fallbacks_total", nil)
					forwardedBefore := testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "decoded"})
					resp := sendBroken(t, context.Background(), s.url, tc.fault, `{"model":"sim","prompt":"hi","max_tokens":3,"ignore_eos":true}`)
					if tc.code == "" || fallback {
						// The decoder computes the prompt itself, as with no prefiller at all.
						readOK(t, resp)
					} else {
						e := readOpenAIError(t, resp, http.StatusBadGateway)
						if e.Error.Code == nil || *e.Error.Code != tc.code {
							t.Errorf("code %v, want %q: %s", e.Error.Code, tc.code, e.Error.Message)
						}
					}
					wantFallbacks := 0.0
					if tc.code != "" && fallback {
						wantFallbacks = 1
					}
					if got := testutil.Value(t, s.m.Registry, "pdproxy_fallbacks_total", nil) - before; got != wantFallbacks {
						t.Errorf("pdproxy_fallbacks_total went up by %v, want %v", got, wantFallbacks)
					}
					wantForwarded := 0.0
					if tc.code == "" {
						wantForwarded = 1
					}
					if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "decoded"}) - forwardedBefore; got != wantForwarded {
						t.Errorf("params forwarded to the decoder %v times, want %v", got, wantForwarded)
					}
				})
			}
			p.idle(t)
			resp := sendBroken(t, context.Background(), s.url, "none", `{"model":"sim","prompt":"still up?","max_tokens":3,"stream":true}`)
			readOK(t, resp)
			s.assertQuiet(time.Second)
		})
	}
}

// The stream a healthy decoder sends.
const goodStream = "data: {\"choices\":[{\"index\":0,\"text\":\"ok\"}]}\n\ndata: [DONE]\n\n"

// malformedSSE is a stream no client can make sense of: the proxy passes it on as it came.
const malformedSSE = "data: {not json\n\nevent: bogus\nretry: soon\n\n: a comment\n\ndata: {\"choices\":\n\ndata:[DONE]\r\n\r\n"

func TestBrokenDecoderStreams(t *testing.T) {
	tenMiB := 10 << 20
	release := make(chan struct{})
	d := newBrokenEngine(t, func(w http.ResponseWriter, r *http.Request, fault string) {
		rc := http.NewResponseController(w)
		w.Header().Set("Content-Type", "text/event-stream")
		switch fault {
		case "malformed-sse":
			io.WriteString(w, malformedSSE)
		case "endless-line":
			// 10 MiB of one line, then the decoder waits for the test and dies mid-line.
			io.WriteString(w, "data: ")
			chunk := bytes.Repeat([]byte("x"), 64<<10)
			for sent := 0; sent < tenMiB; sent += len(chunk) {
				if _, err := w.Write(chunk); err != nil || rc.Flush() != nil {
					return
				}
			}
			select {
			case <-release:
				panic(http.ErrAbortHandler)
			case <-r.Context().Done():
			}
		case "endless-line-forever":
			io.WriteString(w, "data: ")
			writeForever(w, bytes.Repeat([]byte("x"), 64<<10))
		case "hang-up":
			conn, _, err := rc.Hijack()
			if err == nil {
				conn.Close()
			}
		case "500":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusInternalServerError)
			io.WriteString(w, `{"error":{"message":"CUDA error: an illegal memory access","type":"InternalServerError","code":500}}`)
		default:
			io.WriteString(w, goodStream)
		}
	})
	s := startStack(t, func(c *app.Config) {
		c.Sims = nil // the decoder alone computes the prompt: no prefiller
		c.Router.Backends = []routerconfig.BackendConfig{{Name: "broken-decode", URL: d.URL, Role: routerconfig.RoleDecode, Engine: "vllm"}}
		noEjection(c)
	})
	const stream = `{"model":"sim","prompt":"hi","stream":true}`

	t.Run("malformed SSE reaches the client as it came", func(t *testing.T) {
		resp := sendBroken(t, context.Background(), s.url, "malformed-sse", stream)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != http.StatusOK || string(body) != malformedSSE {
			t.Fatalf("status %d (%v), body %q; want 200 and the decoder's bytes unchanged", resp.StatusCode, err, body)
		}
	})
	t.Run("an endless line streams through, and the decoder dying mid-line ends it with an error event", func(t *testing.T) {
		resp := sendBroken(t, context.Background(), s.url, "endless-line", stream)
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
		// The whole line reaches the client while the decoder holds its stream open: the
		// proxy passes on what it reads, it does not wait for the line's end.
		br := bufio.NewReaderSize(resp.Body, 64<<10)
		head := make([]byte, len("data: ")+tenMiB)
		if _, err := io.ReadFull(br, head); err != nil {
			t.Fatalf("read the first %d bytes of the line: %v", len(head), err)
		}
		close(release)
		rest, err := io.ReadAll(br)
		if err != nil {
			t.Fatalf("the stream did not end cleanly after the decoder died: %v", err)
		}
		// The error is an event of its own, on a line of its own, and no [DONE] follows.
		if !bytes.HasPrefix(rest, []byte("\n\ndata: {")) || !bytes.HasSuffix(rest, []byte("}\n\n")) {
			t.Fatalf("after the line: %q; want an error event of its own", rest)
		}
		var e openAIError
		if err := json.Unmarshal(bytes.TrimSpace(rest[len("\n\ndata: "):]), &e); err != nil || e.Error == nil || e.Error.Type == "" {
			t.Fatalf("the last event %q is not an OpenAI error: %v", rest, err)
		}
	})
	t.Run("a client leaving an endless line closes the decoder's stream", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		resp := sendBroken(t, ctx, s.url, "endless-line-forever", stream)
		if _, err := io.ReadFull(resp.Body, make([]byte, 1<<20)); err != nil {
			t.Fatal(err)
		}
		cancel()
		resp.Body.Close()
		d.idle(t)
	})
	t.Run("a decoder hanging up without an answer is a 502", func(t *testing.T) {
		readOpenAIError(t, sendBroken(t, context.Background(), s.url, "hang-up", stream), http.StatusBadGateway)
	})
	t.Run("a decoder failing with a 500 is a 502 that keeps its internals", func(t *testing.T) {
		e := readOpenAIError(t, sendBroken(t, context.Background(), s.url, "500", stream), http.StatusBadGateway)
		if strings.Contains(e.Error.Message, "CUDA") {
			t.Errorf("the client reads the decoder's internals: %q", e.Error.Message)
		}
	})
	d.idle(t)
	resp := sendBroken(t, context.Background(), s.url, "none", stream)
	defer resp.Body.Close()
	if body, err := io.ReadAll(resp.Body); err != nil || string(body) != goodStream {
		t.Fatalf("after the broken answers: %q, %v; want the proxy up and the stream whole", body, err)
	}
	s.assertQuiet(time.Second)
}
