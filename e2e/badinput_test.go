package e2e

// Bad input from clients: every refusal is a 4xx in the OpenAI error shape, reaches no
// engine and leaves nothing behind; clients that trickle headers or never read their stream
// are cut off; headers cannot pick an upstream.

import (
	"context"
	"encoding/json"
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

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// openAIError is an error answer as an OpenAI client reads it.
type openAIError struct {
	Error *struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

// readOpenAIError reads an answer that must be an error in the OpenAI shape with status.
func readOpenAIError(t *testing.T, resp *http.Response, status int) openAIError {
	t.Helper()
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read the answer: %v", err)
	}
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d: %s", resp.StatusCode, status, body)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	var e openAIError
	if err := json.Unmarshal(body, &e); err != nil || e.Error == nil || e.Error.Message == "" || e.Error.Type == "" {
		t.Fatalf("not an OpenAI error (%v): %s", err, body)
	}
	return e
}

// enginesServed is how many completion requests the stack's engines got in all.
func enginesServed(t *testing.T, s *stack) int {
	t.Helper()
	n := 0
	for _, u := range s.allSimURLs() {
		n += kv(t, u).RequestsTotal
	}
	return n
}

// unsized hides a body's length, so that it goes out chunked.
type unsized struct{ io.Reader }

func TestBadInputIsRefusedWithAnOpenAIErrorAndReachesNoEngine(t *testing.T) {
	s := startStack(t, fastSims)
	before := enginesServed(t, s)
	const completions, chat = "/v1/completions", "/v1/chat/completions"
	overLimit := `{"model":"sim","prompt":"` + strings.Repeat("a", 10<<20) + `"}`
	for _, tc := range []struct {
		name, method, path string
		body               io.Reader
		status             int
		param, code        string // "" when any will do
		allow              string // a 405's Allow header
	}{
		{name: "malformed JSON", body: strings.NewReader(`{"model":"sim","prompt":"hi",}`), status: 400},
		{name: "truncated JSON", body: strings.NewReader(`{"model":"sim","prompt":"hel`), status: 400},
		{name: "a JSON array instead of an object", body: strings.NewReader(`[{"model":"sim"}]`), status: 400},
		{name: "an empty body", body: strings.NewReader(``), status: 400},
		{name: "invalid UTF-8", body: strings.NewReader("{\"model\":\"sim\",\"prompt\":\"caf\xe9\"}"), status: 400},
		{name: "a number for the model", body: strings.NewReader(`{"model":7,"prompt":"hi"}`), status: 400, param: "model"},
		{name: "a number for the prompt", body: strings.NewReader(`{"model":"sim","prompt":5}`), status: 400, param: "prompt"},
		{name: "a string for stream", body: strings.NewReader(`{"model":"sim","prompt":"hi","stream":"yes"}`), status: 400, param: "stream"},
		{name: "a string for max_tokens", body: strings.NewReader(`{"model":"sim","prompt":"hi","max_tokens":"5"}`), status: 400, param: "max_tokens"},
		{name: "a fraction for max_tokens", body: strings.NewReader(`{"model":"sim","prompt":"hi","max_tokens":2.5}`), status: 400, param: "max_tokens"},
		{name: "a string for messages", path: chat, body: strings.NewReader(`{"model":"sim","messages":"hi"}`), status: 400, param: "messages"},
		{name: "a message without a role", path: chat, body: strings.NewReader(`{"model":"sim","messages":[{"content":"hi"}]}`), status: 400, param: "messages[0].role"},
		{name: "absurd max_tokens", body: strings.NewReader(`{"model":"sim","prompt":"hi","max_tokens":1000000000000}`), status: 400, param: "max_tokens"},
		{name: "max_tokens beyond any integer", body: strings.NewReader(`{"model":"sim","prompt":"hi","max_tokens":1e400}`), status: 400, param: "max_tokens"},
		{name: "absurd max_completion_tokens", path: chat, body: strings.NewReader(`{"model":"sim","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":99999999999999999999}`), status: 400, param: "max_completion_tokens"},
		{name: "negative max_tokens", body: strings.NewReader(`{"model":"sim","prompt":"hi","max_tokens":-1}`), status: 400, param: "max_tokens"},
		{name: "negative n", body: strings.NewReader(`{"model":"sim","prompt":"hi","n":-3}`), status: 400, param: "n"},
		{name: "negative min_tokens", body: strings.NewReader(`{"model":"sim","prompt":"hi","min_tokens":-5}`), status: 400, param: "min_tokens"},
		{name: "a body over the limit", body: strings.NewReader(overLimit), status: 413, code: "request_too_large"},
		{name: "a chunked body over the limit", body: unsized{strings.NewReader(overLimit)}, status: 413, code: "request_too_large"},
		{name: "an unknown route", path: "/v1/images/generations", body: strings.NewReader(`{"model":"sim","prompt":"hi"}`), status: 404, code: "not_found"},
		{name: "a path outside the API", method: http.MethodGet, path: "/v2/models", status: 404, code: "not_found"},
		{name: "GET on completions", method: http.MethodGet, status: 405, code: "method_not_allowed", allow: "POST"},
		{name: "PUT on chat completions", method: http.MethodPut, path: chat, body: strings.NewReader(`{}`), status: 405, code: "method_not_allowed", allow: "POST"},
		{name: "DELETE on models", method: http.MethodDelete, path: "/v1/models", status: 405, code: "method_not_allowed", allow: "GET"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			method, path := tc.method, tc.path
			if method == "" {
				method = http.MethodPost
			}
			if path == "" {
				path = completions
			}
			req, err := http.NewRequest(method, s.url+path, tc.body)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatalf("%s %s: %v", method, path, err)
			}
			e := readOpenAIError(t, resp, tc.status)
			if tc.status == 400 && e.Error.Type != "invalid_request_error" {
				t.Errorf("type %q, want invalid_request_error", e.Error.Type)
			}
			if tc.param != "" && (e.Error.Param == nil || *e.Error.Param != tc.param) {
				t.Errorf("param %v, want %q (message %q)", e.Error.Param, tc.param, e.Error.Message)
			}
			if tc.code != "" && (e.Error.Code == nil || *e.Error.Code != tc.code) {
				t.Errorf("code %v, want %q", e.Error.Code, tc.code)
			}
			if got := resp.Header.Get("Allow"); got != tc.allow {
				t.Errorf("Allow %q, want %q (RFC 9110, section 15.5.6: a 405 names the methods allowed)", got, tc.allow)
			}
		})
	}
	if after := enginesServed(t, s); after != before {
		t.Errorf("the engines served %d requests during the bad ones, want none", after-before)
	}
	completionOK(t, s.url)
	s.assertQuiet(time.Second)
}

func TestHeadersTrickledSlowlyAreCutAtTheReadHeaderTimeout(t *testing.T) {
	s := startStack(t, func(c *app.Config) {
		fastSims(c)
		c.ReadHeaderTimeout = 500 * time.Millisecond
	})
	conn, err := net.Dial("tcp", s.m.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"model":"sim","prompt":"hi","max_tokens":3}`
	head := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", len(body))
	buf := make([]byte, 4096)
	sent := 0
	for ; sent < len(head); sent++ {
		if _, err := conn.Write([]byte{head[sent]}); err != nil {
			break
		}
		// One byte every 200ms: the read's deadline paces the trickle.
		conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		n, err := conn.Read(buf)
		if n > 0 && strings.HasPrefix(string(buf[:n]), "HTTP/1.1 2") {
			t.Fatalf("answered before the headers were complete: %q", buf[:n])
		}
		if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		break // closed, perhaps after an error status
	}
	if sent == len(head) {
		t.Fatalf("the proxy waited for all %d header bytes trickled 200ms apart", len(head))
	}
	t.Logf("the proxy closed the connection after %d of %d header bytes", sent, len(head))
	completionOK(t, s.url)
	s.assertQuiet(time.Second)
}

// neverReads sends a request on a raw connection with a small receive buffer and never
// reads the answer; closing the returned connection is the caller's. The buffer is small, yet
// not below two of loopback's 32 KiB segments: a window smaller than a segment would trickle
// out a probe per retransmission timeout once the client does read.
func neverReads(t *testing.T, addr, body string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	if err := conn.(*net.TCPConn).SetReadBuffer(64 << 10); err != nil {
		t.Fatal(err)
	}
	if _, err := fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body); err != nil {
		t.Fatal(err)
	}
	return conn
}

// cutByPeer reads conn to its end, which must come before the test deadline, and checks
// that the chunked answer on it was cut: it never got its last chunk.
func cutByPeer(t *testing.T, conn net.Conn) {
	t.Helper()
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(conn)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the proxy never closed the connection of a client that stopped reading (%d bytes read)", len(got))
	}
	if !strings.HasPrefix(string(got), "HTTP/1.1 200") || strings.HasSuffix(string(got), "\r\n0\r\n\r\n") {
		t.Fatalf("want the start of a 200 stream, cut before its end; got %d bytes ending %q", len(got), got[max(0, len(got)-20):])
	}
}

func TestClientThatNeverReadsItsStreamIsGivenUpOn(t *testing.T) {
	const writeTimeout = 300 * time.Millisecond
	t.Run("the decoder is aborted and its KV freed", func(t *testing.T) {
		s := startStack(t, func(c *app.Config) {
			fastSims(c)
			c.Sims[1].ITL = time.Microsecond
			c.Proxy.ClientWriteTimeout = writeTimeout
		})
		d := s.m.SimURLs("decode")[0]
		conn := neverReads(t, s.m.Addr(), `{"model":"sim","prompt":"everything","max_tokens":1000000,"ignore_eos":true,"stream":true}`)
		defer conn.Close()
		testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
			st := kv(t, d)
			return st.AbortedTotal == 1 && st.BlocksFree == st.BlocksTotal && st.RunningRequests == 0, "decoder: " + jsonString(st)
		})
		// Counted as the handler returns, a moment after the decoder saw its abort.
		testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
			got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"code": "499"})
			return got == 1, fmt.Sprintf(`pdproxy_requests_total{code="499"} = %v, want 1: the proxy gave up on the client`, got)
		})
		cutByPeer(t, conn)
		s.assertQuiet(time.Second)
	})
	t.Run("the decoder is read no faster than the client takes it", func(t *testing.T) {
		var written atomic.Int64
		done := make(chan struct{})
		event := []byte("data: {\"choices\":[{\"text\":\"" + strings.Repeat("x", 32<<10) + "\"}]}\n\n")
		firehose := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost {
				return // health checks and model lists: 200, empty
			}
			defer close(done)
			w.Header().Set("Content-Type", "text/event-stream")
			rc := http.NewResponseController(w)
			for {
				n, err := w.Write(event)
				written.Add(int64(n))
				if err == nil {
					err = rc.Flush()
				}
				if err != nil {
					return
				}
			}
		}))
		t.Cleanup(firehose.Close)
		s := startStack(t, func(c *app.Config) {
			c.Sims = nil
			c.Router.Backends = []routerconfig.BackendConfig{{Name: "firehose", URL: firehose.URL, Role: routerconfig.RoleDecode, Engine: "vllm"}}
			c.Proxy.ClientWriteTimeout = writeTimeout
		})
		conn := neverReads(t, s.m.Addr(), `{"model":"m","prompt":"everything","stream":true}`)
		defer conn.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("the proxy still reads the decoder 10s after its client stopped reading (%d bytes)", written.Load())
		}
		// What the decoder could write is what the sockets between it and the client hold,
		// a few MiB on loopback; a proxy that buffered would read as fast as the decoder sends.
		if n := written.Load(); n > 64<<20 {
			t.Errorf("the decoder wrote %d MiB before the proxy gave up; want it held back by the client", n>>20)
		} else {
			t.Logf("the decoder wrote %d KiB before the proxy gave up on the client", n>>10)
		}
		cutByPeer(t, conn)
		s.assertQuiet(time.Second)
	})
}

func TestHeadersThatPickAnUpstreamNeverReachIt(t *testing.T) {
	var hits atomic.Int64
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"text":"from elsewhere"}],"kv_transfer_params":null}`)
	}))
	t.Cleanup(elsewhere.Close)
	s := startStack(t, fastSims)
	before := enginesServed(t, s)
	addr := elsewhere.Listener.Addr().String()
	for _, stream := range []bool{false, true} {
		body := fmt.Sprintf(`{"model":"sim","prompt":"hi","max_tokens":3,"ignore_eos":true,"stream":%v}`, stream)
		req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, s.url+"/v1/completions", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		// What P/D sidecars and routers read to pick an upstream; and the Host a
		// host-routing proxy would follow.
		for _, h := range []string{"X-Prefiller-Host-Port", "X-Decoder-Host-Port", "X-Forwarded-Host"} {
			req.Header.Set(h, addr)
		}
		req.Header.Set("X-Prefiller-Url", elsewhere.URL)
		req.Host = addr
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if stream {
			events := sseEvents(t, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || len(events) == 0 || events[len(events)-1] != "[DONE]" {
				t.Fatalf("stream: status %d, events %q", resp.StatusCode, events)
			}
			continue
		}
		readOK(t, resp)
	}
	if n := hits.Load(); n != 0 {
		t.Errorf("the server the headers named got %d requests; upstreams come from config only", n)
	}
	if got := enginesServed(t, s) - before; got != 4 {
		t.Errorf("the configured engines served %d calls, want 4 (a prefill and a decode each)", got)
	}
	s.assertQuiet(time.Second)
}
