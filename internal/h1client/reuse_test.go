package h1client

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// tlsServer is server on https.
func tlsServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int64, *tls.Config) {
	t.Helper()
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv, &conns, srv.Client().Transport.(*http.Transport).TLSClientConfig
}

func TestTLSConnectionsAreReused(t *testing.T) {
	srv, conns, cfg := tlsServer(t, sse(3))
	_, c := client(t, Options{TLS: cfg})
	for range 3 {
		resp := post(t, c, context.Background(), srv.URL, "{}")
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(b) != want(3) {
			t.Fatalf("body %q, %v", b, err)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("3 calls over TLS took %d connections, want 1", n)
	}
}

// readBody reads a body whole with Read, or with Next, as the relay does.
func readBody(t *testing.T, resp *http.Response, next bool) string {
	t.Helper()
	defer resp.Body.Close()
	if !next {
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("read body: %v", err)
		}
		return string(b)
	}
	var sb strings.Builder
	for {
		p, _, err := resp.Body.(*body).Next()
		sb.Write(p)
		if err == io.EOF {
			return sb.String()
		}
		if err != nil {
			t.Fatalf("next: %v", err)
		}
	}
}

func TestTrailersAreReadAndTheConnectionReused(t *testing.T) {
	srv, conns := server(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Trailer", "X-Usage")
		io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		io.WriteString(w, "data: [DONE]\n\n")
		w.Header().Set("X-Usage", "42")
		w.Header().Set(http.TrailerPrefix+"X-Undeclared", "7")
	})
	_, c := client(t, Options{})
	for _, tc := range []struct {
		name string
		next bool
	}{{"read with Read", false}, {"read with Next", true}, {"read with Read again", false}} {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, c, context.Background(), srv.URL, "{}")
			if got := readBody(t, resp, tc.next); got != "data: 1\n\ndata: [DONE]\n\n" {
				t.Errorf("body %q", got)
			}
			if resp.Trailer.Get("X-Usage") != "42" || resp.Trailer.Get("X-Undeclared") != "7" {
				t.Errorf("trailer %v", resp.Trailer)
			}
		})
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("3 answers with trailers took %d connections, want 1", n)
	}
}

// idleConn returns the connection tr holds idle for rawURL's host, if any.
func idleConn(t *testing.T, tr *Transport, rawURL string) *conn {
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	tr.pools.mu.Lock()
	defer tr.pools.mu.Unlock()
	if hp := tr.pools.m[u.Scheme+"://"+canonicalAddr(u)]; hp != nil && len(hp.idle) > 0 {
		return hp.idle[0]
	}
	return nil
}

func TestAnIdleConnectionTheServerClosedIsNotUsed(t *testing.T) {
	for _, tc := range []struct {
		name string
		tls  bool
	}{{"over http", false}, {"over https", true}} {
		t.Run(tc.name, func(t *testing.T) {
			var srv *httptest.Server
			var conns *atomic.Int64
			var o Options
			if tc.tls {
				srv, conns, o.TLS = tlsServer(t, sse(1))
			} else {
				srv, conns = server(t, sse(1))
			}
			tr, c := client(t, o)
			resp := post(t, c, context.Background(), srv.URL, "{}")
			readBody(t, resp, false)
			idle := idleConn(t, tr, srv.URL)
			if idle == nil {
				t.Fatal("no idle connection after a whole answer")
			}
			srv.CloseClientConnections()
			// The close reaches the client's socket a moment later; only then can it be seen.
			testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
				return !alive(idle.nc), "the idle connection still looks open"
			})
			resp = post(t, c, context.Background(), srv.URL, "{}")
			if got := readBody(t, resp, false); got != want(1) {
				t.Errorf("body %q", got)
			}
			if n := conns.Load(); n != 2 {
				t.Errorf("%d connections, want 2", n)
			}
		})
	}
}

// rawServer answers each request "ok" on the connection it came on, except the requests drop
// picks (by their number overall, from 1): it reads those whole and closes the connection
// without a byte of answer, as a server does that is restarted, or that times an idle
// connection out as the request arrives. It counts connections and requests.
func rawServer(t *testing.T, drop func(n int64) bool) (url string, conns, requests *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns, requests = new(atomic.Int64), new(atomic.Int64)
	var wg sync.WaitGroup
	var mu sync.Mutex
	open := map[net.Conn]bool{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			mu.Lock()
			open[nc] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer nc.Close()
				br := bufio.NewReader(nc)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					io.Copy(io.Discard, req.Body)
					if drop(requests.Add(1)) {
						return
					}
					if _, err := io.WriteString(nc, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for nc := range open {
			nc.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return "http://" + ln.Addr().String(), conns, requests
}

// TestAConnectionLostBeforeAnyAnswer is the keep-alive race: a pooled connection the server
// closes after the request went out. An idempotent request is sent again on a new
// connection, as net/http's transport does; a POST is not (an engine may have begun it), and
// its error says that it may have reached the server.
func TestAConnectionLostBeforeAnyAnswer(t *testing.T) {
	for _, tc := range []struct {
		name       string
		method     string
		idempotent bool // the request carries an Idempotency-Key
		sentAgain  bool
	}{
		{"a GET is sent again on a new connection", http.MethodGet, false, true},
		{"a POST is not sent again", http.MethodPost, false, false},
		{"a POST with an Idempotency-Key is sent again", http.MethodPost, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url, conns, requests := rawServer(t, func(n int64) bool { return n == 2 })
			_, c := client(t, Options{})
			do := func() (*http.Response, error) {
				req, _ := http.NewRequest(tc.method, url+"/v1/completions", strings.NewReader(`{"prompt":"hi"}`))
				if tc.idempotent {
					req.Header.Set("Idempotency-Key", "k1")
				}
				return c.Do(req)
			}
			resp, err := do()
			if err != nil {
				t.Fatal(err)
			}
			if got := readBody(t, resp, false); got != "ok" {
				t.Fatalf("first answer %q", got)
			}
			resp, err = do()
			switch {
			case tc.sentAgain && err != nil:
				t.Fatalf("second call: %v, want it sent again and answered", err)
			case tc.sentAgain:
				if got := readBody(t, resp, false); got != "ok" {
					t.Errorf("second answer %q", got)
				}
			case err == nil:
				resp.Body.Close()
				t.Fatal("second call answered: it was sent again")
			default:
				var unsent interface{ Unsent() bool }
				if !errors.Is(err, ErrClosedBeforeAnswer) || errors.As(err, &unsent) {
					t.Errorf("error %v, want ErrClosedBeforeAnswer and not an UnsentError", err)
				}
			}
			wantConns, wantRequests := int64(1), int64(2)
			if tc.sentAgain {
				wantConns, wantRequests = 2, 3
			}
			if n, r := conns.Load(), requests.Load(); n != wantConns || r != wantRequests {
				t.Errorf("the server saw %d connections and %d requests, want %d and %d", n, r, wantConns, wantRequests)
			}
		})
	}
}

func TestAFailedTLSHandshakeIsUnsent(t *testing.T) {
	srv, _, _ := tlsServer(t, sse(1))
	_, c := client(t, Options{}) // the system roots do not know httptest's certificate
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("{}"))
	_, err := c.Do(req)
	var unsent interface{ Unsent() bool }
	if !errors.As(err, &unsent) || !unsent.Unsent() {
		t.Errorf("error %v, want an UnsentError", err)
	}
}

func TestAnswersWithoutABodyLeaveTheConnectionReusable(t *testing.T) {
	for _, tc := range []struct {
		name   string
		method string
		h      http.HandlerFunc
	}{
		{"a HEAD with a Content-Length", http.MethodHead, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", "100")
		}},
		{"a 204", http.MethodPost, func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) }},
		{"a 304", http.MethodGet, func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNotModified) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, conns := server(t, tc.h)
			_, c := client(t, Options{})
			for range 3 {
				req, _ := http.NewRequest(tc.method, srv.URL, nil)
				resp, err := c.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				if got := readBody(t, resp, false); got != "" {
					t.Errorf("body %q", got)
				}
			}
			if n := conns.Load(); n != 1 {
				t.Errorf("3 calls took %d connections, want 1", n)
			}
		})
	}
}
