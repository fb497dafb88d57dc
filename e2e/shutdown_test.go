package e2e

// A client the proxy gives up on is told so: shutdown past its drain deadline answers a
// request that has no byte yet with a 503, and ends a stream with an error event; a client
// that half-closes its connection after sending is still served.

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

// simURL is the URL of the built binary's in-process engine of role, from its log.
func (p *process) simURL(role string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.lines {
		if l["msg"] == "simulated engine listening" && l["role"] == role {
			if u, ok := l["url"].(string); ok {
				return u
			}
		}
	}
	p.t.Fatalf("no %s engine in the log:\n%s", role, p.raw.String())
	return ""
}

func TestShutdownPastItsDeadlineTellsEveryClientItWasCut(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "proxy.yaml")
	if err := os.WriteFile(cfg, []byte(`listen: 127.0.0.1:0
log_format: json
shutdown_timeout: 500ms
sims:
  - role: prefill
    prefill_time: 2ms
  - role: decode
    itl: 10ms
`), 0o644); err != nil {
		t.Fatal(err)
	}
	p, addr := startProcess(t, "proxy listening", "--config", cfg)
	base := "http://" + addr
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	const long = `{"model":"sim","prompt":"tell me everything","max_tokens":100000,"ignore_eos":true,"stream":%v}`

	type answer struct {
		status int
		body   string
		err    error
	}
	whole := make(chan answer, 1)
	go func() {
		resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(fmt.Sprintf(long, false)))
		if err != nil {
			whole <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		whole <- answer{resp.StatusCode, string(body), err}
	}()
	resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(fmt.Sprintf(long, true)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	readDataLines(t, br, 3)
	d := p.simURL("decode")
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		st := kv(t, d)
		return st.RunningRequests == 2, "decoder: " + jsonString(st)
	})

	// Both decodes would run for 1000 s: the drain deadline passes, and the proxy gives up.
	if code := p.stop(syscall.SIGTERM); code != 0 {
		t.Fatalf("exit code %d:\n%s", code, p.log())
	}
	t.Run("a request with no byte of its answer yet gets a 503", func(t *testing.T) {
		a := testutil.Recv(t, testutil.Timeout, whole, "the non-streaming answer")
		if a.err != nil {
			// A connection closed without an answer is honest too, but the proxy had time to
			// write one.
			t.Fatalf("no answer: %v", a.err)
		}
		if a.status != http.StatusServiceUnavailable {
			t.Fatalf("status %d with %q, want 503: a client the proxy gave up on must not take it for a success", a.status, a.body)
		}
		var e openAIError
		if err := json.Unmarshal([]byte(a.body), &e); err != nil || e.Error == nil || e.Error.Code == nil || *e.Error.Code != "shutting_down" {
			t.Fatalf("not an OpenAI error with code shutting_down: %s", a.body)
		}
	})
	t.Run("a stream ends with an error event and no [DONE]", func(t *testing.T) {
		events := sseEvents(t, br)
		if len(events) == 0 {
			t.Fatal("the stream ended with no event after the shutdown")
		}
		last := events[len(events)-1]
		if last == "[DONE]" || !strings.Contains(last, `"error"`) || !strings.Contains(last, "shutting_down") {
			t.Fatalf("the stream the proxy cut ends with %q, want an error event (shutting_down) and no [DONE]", last)
		}
	})
	if !strings.Contains(p.log(), `"status":503`) {
		t.Errorf("no request logged with status 503:\n%s", p.log())
	}
}

// halfClosed sends a request on a raw connection and then closes the connection's sending
// half, as a client that has said everything may (RFC 9112, section 9.6).
func halfClosed(t *testing.T, addr, body string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	if err := conn.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	return conn
}

func TestHalfClosedClientIsServed(t *testing.T) {
	s := startStack(t, func(c *app.Config) {
		fastSims(c)
		// A prefill long enough that the request waits for it when the half-close arrives.
		c.Sims[0].PrefillTime = 100 * time.Millisecond
	})
	t.Run("a whole JSON answer", func(t *testing.T) {
		conn := halfClosed(t, s.m.Addr(), `{"model":"sim","prompt":"hi","max_tokens":5,"ignore_eos":true}`)
		defer conn.Close()
		readOK(t, readAnswer(t, conn, testutil.Timeout))
	})
	t.Run("a stream", func(t *testing.T) {
		conn := halfClosed(t, s.m.Addr(), `{"model":"sim","prompt":"hi","max_tokens":5,"ignore_eos":true,"stream":true}`)
		defer conn.Close()
		readOK(t, readAnswer(t, conn, testutil.Timeout))
	})
	t.Run("HTTP/1.0, which knows no interim answer, is taken for gone: no answer at all", func(t *testing.T) {
		conn, err := net.Dial("tcp", s.m.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		body := `{"model":"sim","prompt":"hi","max_tokens":5}`
		fmt.Fprintf(conn, "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		conn.(*net.TCPConn).CloseWrite()
		conn.SetReadDeadline(time.Now().Add(testutil.Timeout))
		if got, err := io.ReadAll(conn); len(got) != 0 {
			t.Fatalf("an HTTP/1.0 client that half-closed read %q (%v), want nothing", got, err)
		}
	})
	if got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"code": "200"}); got != 2 {
		t.Errorf(`pdproxy_requests_total{code="200"} = %v, want 2`, got)
	}
	s.assertQuiet(time.Second)
}

func TestClientThatClosesDuringThePrefillIsStillSeenGoneAtOnce(t *testing.T) {
	// A client that closes its connection sends the same FIN as one that half-closes it; the
	// proxy must still tell them apart before the prefill ends.
	s := startStack(t, func(c *app.Config) {
		fastSims(c)
		c.Sims[0].PrefillTime = time.Minute
	})
	conn, err := net.Dial("tcp", s.m.Addr())
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"sim","prompt":"hi","max_tokens":5}`
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		st := kv(t, s.m.SimURLs("prefill")[0])
		return st.RunningRequests == 1, "prefiller: " + jsonString(st)
	})
	conn.Close()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		got := testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": "prefilling"})
		return got == 1, fmt.Sprintf("pdproxy_aborts_total{stage=prefilling} = %v", got)
	})
	s.assertQuiet(testutil.Timeout)
}

func TestHalfCloseOverTLSIsTakenForALeavingNeverASuccess(t *testing.T) {
	// Over TLS the proxy cannot probe the client (a probe would have to be encrypted): a
	// half-close (close_notify, then a FIN) is taken for the client leaving, as net/http takes
	// it. The client must then get nothing, not an empty 200.
	certFile, keyFile, pool := selfSignedCert(t)
	s := startStack(t, fastSims, func(c *app.Config) {
		c.TLSCertFile, c.TLSKeyFile = certFile, keyFile
		c.Sims[0].PrefillTime = 100 * time.Millisecond
	})
	conn, err := tls.Dial("tcp", s.m.Addr(), &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", NextProtos: []string{"http/1.1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"model":"sim","prompt":"hi","max_tokens":5}`
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	if err := conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(testutil.Timeout))
	got, err := io.ReadAll(conn)
	if len(got) != 0 {
		t.Fatalf("a client taken for gone read %q (%v), want the connection closed without an answer", got, err)
	}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"code": "499"})
		return got == 1, fmt.Sprintf(`pdproxy_requests_total{code="499"} = %v`, got)
	})
	s.assertQuiet(testutil.Timeout)
}
