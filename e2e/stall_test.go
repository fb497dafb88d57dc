package e2e

// Clients that stall: bodies that never arrive, more connections than the proxy will hold,
// clients that stop reading. What they hold is bounded, and what they get says so.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

// openFDs counts the process's open file descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("counting file descriptors needs /proc (Linux): %v", err)
	}
	return len(fds)
}

// stalledBody opens a connection and sends a request's headers and the first bytes of a body
// it announced longer, then nothing.
func stalledBody(t *testing.T, addr string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(conn, "POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":\"sim\","); err != nil {
		t.Fatal(err)
	}
	return conn
}

// readAnswer reads the answer on a raw connection, skipping interim (1xx) ones, and then
// checks that the proxy closed the connection.
func readAnswer(t *testing.T, conn net.Conn, within time.Duration) *http.Response {
	t.Helper()
	conn.SetReadDeadline(time.Now().Add(within))
	br := bufio.NewReader(conn)
	for {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("no answer within %s: %v", within, err)
		}
		if resp.StatusCode >= 200 {
			body, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Fatalf("read the answer's body: %v", err)
			}
			resp.Body = io.NopCloser(strings.NewReader(string(body)))
			return resp
		}
	}
}

func TestStalledRequestBodiesAreCutAtTheReadBodyTimeout(t *testing.T) {
	const bodyTimeout = time.Second
	stalled := func(c *app.Config) {
		fastSims(c)
		c.Proxy.ReadBodyTimeout = bodyTimeout
	}
	t.Run("800 HTTP/1.1 connections with part of a body get a 408 and are closed", func(t *testing.T) {
		s := startStack(t, stalled)
		const n = 800
		open := func() float64 { return testutil.Value(t, s.m.Registry, "pdproxy_connections_open", nil) }
		g0, f0 := runtime.NumGoroutine(), openFDs(t)
		conns := make([]net.Conn, n)
		for i := range conns {
			conns[i] = stalledBody(t, s.m.Addr())
			defer conns[i].Close()
		}
		testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
			return open() == n, fmt.Sprintf("the proxy holds %v connections", open())
		})
		// The test's own ends of the connections are descriptors of this process too.
		held, heldFDs := runtime.NumGoroutine()-g0, openFDs(t)-f0-n
		for i, conn := range conns {
			resp := readAnswer(t, conn, bodyTimeout+10*time.Second)
			if i == 0 {
				e := readOpenAIError(t, resp, http.StatusRequestTimeout)
				if e.Error.Code == nil || *e.Error.Code != "request_timeout" {
					t.Errorf("code %v, want request_timeout", e.Error.Code)
				}
			} else if resp.StatusCode != http.StatusRequestTimeout {
				t.Fatalf("connection %d: status %d, want 408", i, resp.StatusCode)
			}
			if _, err := conn.Read(make([]byte, 1)); err != io.EOF {
				t.Fatalf("connection %d: %v after the 408, want it closed by the proxy", i, err)
			}
		}
		testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
			return open() == 0, fmt.Sprintf("the proxy still holds %v connections", open())
		})
		for _, c := range conns {
			c.Close()
		}
		testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
			g, f := runtime.NumGoroutine()-g0, openFDs(t)-f0
			// A few are the stack's own keep-alive connections, opened meanwhile.
			return g <= 20 && f <= 20, fmt.Sprintf("%d goroutines and %d descriptors more than before", g, f)
		})
		t.Logf("%d stalled bodies held %d goroutines and %d descriptors of the proxy; after read_body_timeout (%s): %d and %d",
			n, held, heldFDs, bodyTimeout, runtime.NumGoroutine()-g0, openFDs(t)-f0)
		if got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"code": "408"}); got != n {
			t.Errorf(`pdproxy_requests_total{code="408"} = %v, want %d`, got, n)
		}
		completionOK(t, s.url)
		s.assertQuiet(time.Second)
	})
	t.Run("100 HTTP/2 streams with headers and no body get a 408 each", func(t *testing.T) {
		s := startStack(t, stalled)
		client := h2cClient(t)
		const n = 100
		var wg sync.WaitGroup
		statuses := make(chan int, n)
		var writers []*io.PipeWriter
		for i := 0; i < n; i++ {
			pr, pw := io.Pipe()
			writers = append(writers, pw)
			req, err := http.NewRequest(http.MethodPost, s.url+"/v1/completions", pr)
			if err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := client.Do(req)
				if err != nil {
					statuses <- -1
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.ProtoMajor != 2 {
					statuses <- -2
					return
				}
				statuses <- resp.StatusCode
			}()
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(bodyTimeout + 10*time.Second):
			for _, pw := range writers {
				pw.Close()
			}
			<-done
			t.Fatalf("HTTP/2 streams with no body were still waited for %s after read_body_timeout", 10*time.Second)
		}
		for _, pw := range writers {
			pw.Close()
		}
		close(statuses)
		for st := range statuses {
			if st != http.StatusRequestTimeout {
				t.Fatalf("a stream got %d, want 408 (-1: no answer, -2: not HTTP/2)", st)
			}
		}
		if got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"code": "408"}); got != n {
			t.Errorf(`pdproxy_requests_total{code="408"} = %v, want %d`, got, n)
		}
		resp, _, _ := tracedPost(t, context.Background(), client, s.url+"/v1/completions", `{"model":"sim","prompt":"hi","max_tokens":3,"ignore_eos":true}`)
		readOK(t, resp)
		s.assertQuiet(time.Second)
	})
	t.Run("a body announced over max_body_bytes is refused with 413 before it is sent", func(t *testing.T) {
		// A read_body_timeout far longer than the test: only a refusal up front answers.
		s := startStack(t, fastSims, func(c *app.Config) { c.Proxy.ReadBodyTimeout = time.Hour })
		const announced = 11 << 20
		t.Run("HTTP/1.1", func(t *testing.T) {
			conn, err := net.Dial("tcp", s.m.Addr())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", announced)
			e := readOpenAIError(t, readAnswer(t, conn, testutil.Timeout), http.StatusRequestEntityTooLarge)
			if e.Error.Code == nil || *e.Error.Code != "request_too_large" {
				t.Errorf("code %v, want request_too_large", e.Error.Code)
			}
		})
		t.Run("HTTP/2", func(t *testing.T) {
			pr, pw := io.Pipe()
			defer pw.Close()
			req, err := http.NewRequest(http.MethodPost, s.url+"/v1/completions", pr)
			if err != nil {
				t.Fatal(err)
			}
			req.ContentLength = announced
			ctx, cancel := context.WithTimeout(context.Background(), testutil.Timeout)
			defer cancel()
			resp, err := h2cClient(t).Do(req.WithContext(ctx))
			if err != nil {
				t.Fatalf("no answer: %v", err)
			}
			readOpenAIError(t, resp, http.StatusRequestEntityTooLarge)
		})
		if got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"code": "413"}); got != 2 {
			t.Errorf(`pdproxy_requests_total{code="413"} = %v, want 2`, got)
		}
		s.assertQuiet(time.Second)
	})
	t.Run("an answer that takes longer than read_body_timeout is not cut", func(t *testing.T) {
		s := startStack(t, func(c *app.Config) {
			stalled(c)
			c.Proxy.ReadBodyTimeout = 200 * time.Millisecond
			c.Sims[1].ITL = 5 * time.Millisecond // 100 tokens: half a second
		})
		body := `{"model":"sim","prompt":"count","max_tokens":100,"ignore_eos":true,"stream":%v}`
		for _, stream := range []bool{false, true} {
			readOK(t, post(t, context.Background(), s.url+"/v1/completions", fmt.Sprintf(body, stream)))
			resp, _, _ := tracedPost(t, context.Background(), h2cClient(t), s.url+"/v1/completions", fmt.Sprintf(body, stream))
			readOK(t, resp)
		}
		s.assertQuiet(time.Second)
	})
}

func TestConnectionsBeyondMaxConnectionsAreRefusedAndCounted(t *testing.T) {
	const max = 8
	s := startStack(t, fastSims, func(c *app.Config) { c.Proxy.MaxConnections = max })
	open := func() float64 { return testutil.Value(t, s.m.Registry, "pdproxy_connections_open", nil) }
	var idle []net.Conn
	for i := 0; i < max; i++ {
		c, err := net.Dial("tcp", s.m.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		idle = append(idle, c)
	}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		return open() == max, fmt.Sprintf("the proxy holds %v connections", open())
	})
	// The refusal is a reset, which on loopback can reach the client before its connect call
	// has even returned: then the dial itself fails with it.
	extra, err := net.Dial("tcp", s.m.Addr())
	if err == nil {
		defer extra.Close()
		extra.SetReadDeadline(time.Now().Add(testutil.Timeout))
		var n int
		n, err = extra.Read(make([]byte, 1))
		if n != 0 || err == nil || os.IsTimeout(err) {
			t.Fatalf("a connection beyond max_connections read %d bytes, %v; want it closed at once", n, err)
		}
	} else if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("a connection beyond max_connections: %v; want it reset", err)
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_connections_refused_total", nil); got != 1 {
		t.Errorf("pdproxy_connections_refused_total = %v, want 1", got)
	}
	idle[0].Close()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		return open() == max-1, fmt.Sprintf("the proxy holds %v connections", open())
	})
	completionOK(t, s.url)
	s.assertQuiet(time.Second)
}

// TestClientThatStopsReadingHoldsItsDecodeAboutClientWriteTimeout streams 100 tokens a second,
// as a decoder does, to a client that never reads. Its decode must stop about
// client_write_timeout after the client stops taking it, not once the kernel buffers between
// the proxy and the client are full, which at this pace takes minutes.
func TestClientThatStopsReadingHoldsItsDecodeAboutClientWriteTimeout(t *testing.T) {
	const writeTimeout = time.Second
	s := startStack(t, func(c *app.Config) {
		fastSims(c)
		c.Sims[1].ITL = 10 * time.Millisecond
		c.Proxy.ClientWriteTimeout = writeTimeout
	})
	d := s.m.SimURLs("decode")[0]
	conn, err := net.Dial("tcp", s.m.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// What the client's own kernel accepts and its application never reads is acknowledged,
	// and no server can tell it from what was read: a client that keeps it small (as a
	// small receive buffer does) is what the proxy's own bound can be measured against. A
	// socket left to autotune may take megabytes of a slow stream of small events (Linux
	// grows its buffer to tcp_rmem's maximum rather than close the window).
	if err := conn.(*net.TCPConn).SetReadBuffer(8 << 10); err != nil {
		t.Fatal(err)
	}
	body := `{"model":"sim","prompt":"everything","max_tokens":1000000,"ignore_eos":true,"stream":true}`
	start := time.Now()
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	// Without a bound of its own, the proxy's send buffer grows to 4 MiB (tcp_wmem), which at
	// about 20 KB/s takes over three minutes to fill.
	testutil.WaitFor(t, writeTimeout+5*time.Second, func() (bool, string) {
		st := kv(t, d)
		return st.AbortedTotal == 1 && st.RunningRequests == 0, "decoder: " + jsonString(st)
	})
	t.Logf("the decode of a client that never read stopped %.1fs after the request (client_write_timeout %s)", time.Since(start).Seconds(), writeTimeout)
	if got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"code": "499"}); got != 1 {
		t.Errorf(`pdproxy_requests_total{code="499"} = %v, want 1: the proxy gave up on the client`, got)
	}
	s.assertQuiet(time.Second)
}
