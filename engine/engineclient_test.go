package engine

import (
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/pdproxy/pdproxy/internal/h1client"
)

// TestCallMapsErrorsTheSameOnEitherEngineClient runs the outcomes the flow tells apart
// through net/http's transport and through h1client (engine_client: stdlib and lean).
func TestCallMapsErrorsTheSameOnEitherEngineClient(t *testing.T) {
	clients := map[string]func() http.RoundTripper{
		"stdlib": func() http.RoundTripper { return &http.Transport{} },
		"lean":   func() http.RoundTripper { return h1client.New(h1client.Options{}) },
	}
	for name, newRT := range clients {
		t.Run(name, func(t *testing.T) {
			client := &http.Client{Transport: newRT()}
			t.Cleanup(client.CloseIdleConnections)
			serve := func(h http.HandlerFunc) string {
				srv := httptest.NewServer(h)
				t.Cleanup(srv.Close)
				return srv.URL
			}
			t.Run("a 200 stream comes back whole, acknowledged first", func(t *testing.T) {
				url := serve(func(w http.ResponseWriter, r *http.Request) {
					io.ReadAll(r.Body)
					w.Header().Set("Content-Type", "text/event-stream")
					io.WriteString(w, "data: 1\n\n")
					w.(http.Flusher).Flush()
					io.WriteString(w, "data: [DONE]\n\n")
				})
				var acked atomic.Bool
				resp, err := Call{Client: client, BaseURL: url, Path: "/v1/completions", ID: "x", Body: []byte(`{}`), OnAck: func() { acked.Store(true) }}.Do(testCtx(t))
				if err != nil {
					t.Fatal(err)
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || string(b) != "data: 1\n\ndata: [DONE]\n\n" || !acked.Load() {
					t.Errorf("body %q, %v, acked %v", b, err, acked.Load())
				}
			})
			t.Run("a 4xx is a StatusError with its body", func(t *testing.T) {
				url := serve(func(w http.ResponseWriter, _ *http.Request) {
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(http.StatusBadRequest)
					io.WriteString(w, `{"error":"no"}`)
				})
				_, err := Call{Client: client, BaseURL: url, Path: "/", ID: "x"}.Do(testCtx(t))
				var se *StatusError
				if !errors.As(err, &se) || se.Status != 400 || se.ContentType != "application/json" || string(se.Body) != `{"error":"no"}` {
					t.Errorf("error %#v", err)
				}
			})
			t.Run("a refused connect is a CallError with Connect", func(t *testing.T) {
				l, _ := net.Listen("tcp", "127.0.0.1:0")
				addr := l.Addr().String()
				l.Close()
				_, err := Call{Client: client, BaseURL: "http://" + addr, Path: "/", ID: "x"}.Do(testCtx(t))
				var ce *CallError
				if !errors.As(err, &ce) || !ce.Connect {
					t.Errorf("error %#v, want Connect", err)
				}
			})
			t.Run("a refused certificate is a CallError with Connect", func(t *testing.T) {
				srv := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
				srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshake error it logs is this test's point
				srv.StartTLS()
				t.Cleanup(srv.Close)
				_, err := Call{Client: client, BaseURL: srv.URL, Path: "/", ID: "x"}.Do(testCtx(t))
				var ce *CallError
				if !errors.As(err, &ce) || !ce.Connect {
					t.Errorf("error %#v, want Connect", err)
				}
			})
			t.Run("a POST the server drops on a reused connection is a CallError without Connect", func(t *testing.T) {
				var calls atomic.Int64
				url := serve(func(w http.ResponseWriter, r *http.Request) {
					io.ReadAll(r.Body)
					if calls.Add(1) == 2 {
						// Read, then gone without a byte of answer: the engine may have begun it.
						nc, _, _ := w.(http.Hijacker).Hijack()
						nc.Close()
						return
					}
					io.WriteString(w, "{}")
				})
				call := Call{Client: client, BaseURL: url, Path: "/v1/completions", ID: "x", Body: []byte(`{}`)}
				resp, err := call.Do(testCtx(t))
				if err != nil {
					t.Fatal(err)
				}
				io.ReadAll(resp.Body)
				resp.Body.Close()
				_, err = call.Do(testCtx(t))
				var ce *CallError
				if !errors.As(err, &ce) || ce.Connect {
					t.Errorf("error %#v, want a CallError without Connect", err)
				}
				if n := calls.Load(); n != 2 {
					t.Errorf("the engine got %d calls, want 2 (the dropped one not sent again)", n)
				}
			})
			t.Run("a connection cut mid-answer is a CallError without Connect", func(t *testing.T) {
				url := serve(func(w http.ResponseWriter, _ *http.Request) {
					w.Header().Set("Content-Length", "100")
					io.WriteString(w, `{"kv_transfer_params":`)
					panic(http.ErrAbortHandler)
				})
				_, err := Call{Client: client, BaseURL: url, Path: "/", ID: "x"}.Prefill(testCtx(t))
				var ce *CallError
				if !errors.As(err, &ce) || ce.Connect {
					t.Errorf("error %#v, want a CallError without Connect", err)
				}
			})
			t.Run("a server gone before answering is a CallError without Connect", func(t *testing.T) {
				url := serve(func(w http.ResponseWriter, _ *http.Request) { panic(http.ErrAbortHandler) })
				_, err := Call{Client: client, BaseURL: url, Path: "/", ID: "x"}.Do(testCtx(t))
				var ce *CallError
				if !errors.As(err, &ce) || ce.Connect {
					t.Errorf("error %#v, want a CallError without Connect", err)
				}
			})
		})
	}
}
