package h1client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// server serves h and counts the connections it accepted.
func server(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &conns
}

func client(t *testing.T, o Options) (*Transport, *http.Client) {
	tr := New(o)
	t.Cleanup(tr.CloseIdleConnections)
	return tr, &http.Client{Transport: tr}
}

func post(t *testing.T, c *http.Client, ctx context.Context, url, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func sse(n int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range n {
			fmt.Fprintf(w, "data: {\"i\":%d}\n\n", i)
			w.(http.Flusher).Flush()
		}
		io.WriteString(w, "data: [DONE]\n\n")
	}
}

func want(n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "data: {\"i\":%d}\n\n", i)
	}
	return b.String() + "data: [DONE]\n\n"
}

func TestBodiesArriveWholeAndConnectionsAreReused(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    http.HandlerFunc
		want string
	}{
		{"a chunked stream", sse(50), want(50)},
		{"a Content-Length answer", func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			w.Header().Set("Content-Length", fmt.Sprint(len(b)))
			w.Write(b)
		}, `{"prompt":"hi"}`},
		{"an empty answer", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, conns := server(t, tc.h)
			_, c := client(t, Options{})
			for range 5 {
				resp := post(t, c, context.Background(), srv.URL+"/v1/completions", `{"prompt":"hi"}`)
				got, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || string(got) != tc.want {
					t.Fatalf("body = %q, %v; want %q", got, err, tc.want)
				}
			}
			if n := conns.Load(); n != 1 {
				t.Errorf("5 calls in a row took %d connections, want 1", n)
			}
		})
	}
}

func TestRequestCarriesHeadersBodyAndTheBackendKey(t *testing.T) {
	var got http.Header
	var body []byte
	srv, _ := server(t, func(w http.ResponseWriter, r *http.Request) {
		got, body = r.Header.Clone(), must(io.ReadAll(r.Body))
		if r.Host == "" || r.URL.RequestURI() != "/v1/x?y=1" {
			t.Errorf("host %q uri %q", r.Host, r.URL.RequestURI())
		}
	})
	tr, _ := client(t, Options{})
	c := &http.Client{Transport: tr.WithAuthorization("Bearer engine")}
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/x?y=1", bytes.NewReader(bytes.Repeat([]byte("a"), 10000)))
	req.Header.Set("Authorization", "Bearer client")
	req.Header.Set("X-Request-Id", "r1")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if got.Get("Authorization") != "Bearer engine" || got.Get("X-Request-Id") != "r1" || len(body) != 10000 {
		t.Errorf("backend saw %v and a %d-byte body", got, len(body))
	}
}

func must[T any](v T, _ error) T { return v }

func TestContinueIsTheAcknowledgement(t *testing.T) {
	release := make(chan struct{})
	srv, _ := server(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body) // sends 100 Continue
		<-release
		io.WriteString(w, "ok")
	})
	_, c := client(t, Options{})
	acked := make(chan struct{})
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{Got100Continue: func() { close(acked); close(release) }})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("{}"))
	req.Header.Set("Expect", "100-continue")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	select {
	case <-acked:
	default:
		t.Fatal("answer without the acknowledgement")
	}
	if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
		t.Errorf("body %q", b)
	}
}

func TestARefusedDialIsADialError(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	_, c := client(t, Options{})
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/", strings.NewReader("{}"))
	_, err := c.Do(req)
	var op *net.OpError
	if !errors.As(err, &op) || op.Op != "dial" {
		t.Errorf("err = %v, want a dial *net.OpError", err)
	}
}

func TestCancelClosesTheConnection(t *testing.T) {
	gone := make(chan struct{})
	srv, _ := server(t, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
		close(gone)
	})
	_, c := client(t, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	resp := post(t, c, ctx, srv.URL, "{}")
	buf := make([]byte, 100)
	if n, err := resp.Body.Read(buf); err != nil || string(buf[:n]) != "data: 1\n\n" {
		t.Fatalf("read %q, %v", buf[:n], err)
	}
	cancel()
	select {
	case <-gone:
	case <-time.After(5 * time.Second):
		t.Fatal("the backend never saw the abort")
	}
	if _, err := resp.Body.Read(buf); !errors.Is(err, context.Canceled) {
		t.Errorf("read after cancel: %v, want context.Canceled", err)
	}
	resp.Body.Close()
}

func TestConnectionsNotReusedWhenTheyCannotBe(t *testing.T) {
	for _, tc := range []struct {
		name  string
		h     http.HandlerFunc
		early bool // close the body before its end
	}{
		{"the server asks to close", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Connection", "close")
			io.WriteString(w, "ok")
		}, false},
		{"the body was closed before its end", sse(2000), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, conns := server(t, tc.h)
			_, c := client(t, Options{})
			for range 3 {
				resp := post(t, c, context.Background(), srv.URL, "{}")
				if tc.early {
					resp.Body.Read(make([]byte, 10))
				} else {
					io.ReadAll(resp.Body)
				}
				resp.Body.Close()
			}
			if n := conns.Load(); n != 3 {
				t.Errorf("3 calls took %d connections, want 3", n)
			}
		})
	}
}

func TestIdleConnectionsCloseAfterTheIdleTimeout(t *testing.T) {
	closed := make(chan struct{}, 1)
	srv := httptest.NewUnstartedServer(sse(1))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateClosed {
			closed <- struct{}{}
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	_, c := client(t, Options{IdleTimeout: 50 * time.Millisecond})
	resp := post(t, c, context.Background(), srv.URL, "{}")
	io.ReadAll(resp.Body)
	resp.Body.Close()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the idle connection was never closed")
	}
}

func TestTLS(t *testing.T) {
	srv := httptest.NewTLSServer(sse(3))
	t.Cleanup(srv.Close)
	cfg := srv.Client().Transport.(*http.Transport).TLSClientConfig
	_, c := client(t, Options{TLS: cfg})
	resp := post(t, c, context.Background(), srv.URL, "{}")
	defer resp.Body.Close()
	if b, _ := io.ReadAll(resp.Body); string(b) != want(3) {
		t.Errorf("body %q", b)
	}
	_, bad := client(t, Options{})
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("{}"))
	if _, err := bad.Do(req); err == nil {
		t.Error("an unknown certificate was accepted")
	}
}

func TestConcurrentCalls(t *testing.T) {
	srv, conns := server(t, sse(20))
	_, c := client(t, Options{MaxIdlePerHost: 8})
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				resp := post(t, c, context.Background(), srv.URL, "{}")
				if b, _ := io.ReadAll(resp.Body); string(b) != want(20) {
					t.Errorf("body %q", b)
				}
				resp.Body.Close()
			}
		}()
	}
	wg.Wait()
	if n := conns.Load(); n > 8 {
		t.Errorf("%d connections for 8 workers", n)
	}
}

func TestNextHandsOutTheBodyAndFreesTheConnection(t *testing.T) {
	srv, conns := server(t, sse(300))
	_, c := client(t, Options{})
	for range 3 {
		resp := post(t, c, context.Background(), srv.URL, "{}")
		next := resp.Body.(interface {
			Next() ([]byte, bool, error)
		})
		var got bytes.Buffer
		for {
			p, _, err := next.Next()
			got.Write(p)
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		resp.Body.Close()
		if got.String() != want(300) {
			t.Fatalf("body of %d bytes, want %d", got.Len(), len(want(300)))
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("3 calls took %d connections, want 1", n)
	}
}
