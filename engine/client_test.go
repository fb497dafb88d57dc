package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// seen is what a fake engine received.
type seen struct {
	method, path string
	header       http.Header
	body         []byte
}

// fakeEngine serves h and records every request; its client's idle connections are closed
// at cleanup so no transport goroutine outlives the test.
func fakeEngine(t *testing.T, h http.HandlerFunc) (*httptest.Server, *http.Client, func() []seen) {
	t.Helper()
	var mu sync.Mutex
	var got []seen
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, seen{r.Method, r.URL.Path, r.Header.Clone(), body})
		mu.Unlock()
		h(w, r)
	}))
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(func() {
		srv.Close()
		client.CloseIdleConnections()
	})
	return srv, client, func() []seen {
		mu.Lock()
		defer mu.Unlock()
		return append([]seen(nil), got...)
	}
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestCallSendsTheBodyAndTheRequestID(t *testing.T) {
	srv, client, got := fakeEngine(t, func(w http.ResponseWriter, _ *http.Request) {
		io.WriteString(w, `{"kv_transfer_params":`+kvParams+`}`)
	})
	body := []byte(`{"model":"m","prompt":"hi"}`)
	hdr := http.Header{"Authorization": {"Bearer k"}, "X-Request-Id": {"from-client"}, "Accept-Encoding": {"gzip"}}
	c := Call{Client: client, BaseURL: srv.URL, Path: "/v1/completions", ID: "req-1", Header: hdr, Body: body}
	params, err := c.Prefill(testCtx(t))
	if err != nil {
		t.Fatalf("Prefill: %v", err)
	}
	if string(params) != kvParams {
		t.Errorf("params %s, want %s", params, kvParams)
	}
	r := got()[0]
	if r.method != http.MethodPost || r.path != "/v1/completions" || !bytes.Equal(r.body, body) {
		t.Errorf("engine got %s %s %s", r.method, r.path, r.body)
	}
	for k, v := range map[string]string{
		"X-Request-Id":    "req-1", // the call's id wins over anything in Header
		"Content-Type":    "application/json",
		"Accept-Encoding": "identity", // an SSE stream must reach the relay as it was sent
		"Authorization":   "Bearer k",
	} {
		if r.header.Get(k) != v {
			t.Errorf("%s = %q, want %q", k, r.header.Get(k), v)
		}
	}
	if hdr.Get("X-Request-Id") != "from-client" {
		t.Errorf("the call changed the caller's header map")
	}
}

func TestCallErrors(t *testing.T) {
	t.Run("a non-200 answer is a StatusError that keeps status, type and body", func(t *testing.T) {
		const body = `{"object":"error","message":"too long","type":"BadRequestError","code":400}`
		srv, client, _ := fakeEngine(t, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, body)
		})
		_, err := Call{Client: client, BaseURL: srv.URL, Path: "/v1/completions", ID: "x"}.Do(testCtx(t))
		var se *StatusError
		if !errors.As(err, &se) || se.Status != 400 || se.ContentType != "application/json" || string(se.Body) != body {
			t.Fatalf("error %#v, want a StatusError 400 with the body", err)
		}
	})
	t.Run("a huge error body is kept bounded", func(t *testing.T) {
		srv, client, _ := fakeEngine(t, func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusInternalServerError)
			w.Write(bytes.Repeat([]byte("x"), 1<<20))
		})
		_, err := Call{Client: client, BaseURL: srv.URL, Path: "/", ID: "x"}.Do(testCtx(t))
		var se *StatusError
		if !errors.As(err, &se) || len(se.Body) > 64<<10 || len(err.Error()) > 300 {
			t.Fatalf("error body %d bytes, message %d bytes; want both bounded", len(se.Body), len(err.Error()))
		}
	})
	t.Run("a closed port is a CallError that says the request never left", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		client := &http.Client{Transport: &http.Transport{}}
		defer client.CloseIdleConnections()
		_, err = Call{Client: client, BaseURL: "http://" + addr, Path: "/v1/completions", ID: "x"}.Prefill(testCtx(t))
		var ce *CallError
		if !errors.As(err, &ce) || !ce.Connect {
			t.Fatalf("error %#v, want a CallError with Connect", err)
		}
	})
	t.Run("a connection cut mid-answer is a CallError that may have reached the engine", func(t *testing.T) {
		srv, client, _ := fakeEngine(t, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", "100")
			io.WriteString(w, `{"kv_transfer_params":`)
			panic(http.ErrAbortHandler)
		})
		_, err := Call{Client: client, BaseURL: srv.URL, Path: "/", ID: "x"}.Prefill(testCtx(t))
		var ce *CallError
		if !errors.As(err, &ce) || ce.Connect {
			t.Fatalf("error %#v, want a CallError without Connect", err)
		}
	})
	t.Run("a prefiller answering non-JSON is an error, not params", func(t *testing.T) {
		srv, client, _ := fakeEngine(t, func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "<html>") })
		params, err := Call{Client: client, BaseURL: srv.URL, Path: "/", ID: "x"}.Prefill(testCtx(t))
		if err == nil || params != nil {
			t.Fatalf("params %s error %v, want an error", params, err)
		}
	})
	t.Run("a cancelled context ends the call and the engine sees its request end", func(t *testing.T) {
		arrived, gone := make(chan struct{}), make(chan struct{})
		srv, client, _ := fakeEngine(t, func(_ http.ResponseWriter, r *http.Request) {
			close(arrived)
			<-r.Context().Done()
			close(gone)
		})
		ctx, cancel := context.WithCancel(testCtx(t))
		defer cancel()
		done := make(chan error, 1)
		go func() {
			_, err := Call{Client: client, BaseURL: srv.URL, Path: "/", ID: "x"}.Prefill(ctx)
			done <- err
		}()
		testutil.Recv(t, testutil.Timeout, arrived, "the call to reach the engine")
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("error %v, want context.Canceled", err)
		}
		testutil.Recv(t, testutil.Timeout, gone, "the engine's request context to end")
	})
}

func TestAbort(t *testing.T) {
	t.Run("posts the request id to /abort_request", func(t *testing.T) {
		srv, client, got := fakeEngine(t, func(http.ResponseWriter, *http.Request) {})
		if err := Sim.(Aborter).Abort(testCtx(t), client, srv.URL, "req-9"); err != nil {
			t.Fatalf("Abort: %v", err)
		}
		r := got()[0]
		var body map[string]string
		json.Unmarshal(r.body, &body)
		if r.method != http.MethodPost || r.path != "/abort_request" || body["rid"] != "req-9" || r.header.Get("X-Request-Id") != "req-9" {
			t.Errorf("engine got %s %s %s (X-Request-Id %q)", r.method, r.path, r.body, r.header.Get("X-Request-Id"))
		}
	})
	t.Run("a refusal is an error", func(t *testing.T) {
		srv, client, _ := fakeEngine(t, func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNotFound) })
		if err := Sim.(Aborter).Abort(testCtx(t), client, srv.URL, "req-9"); err == nil || !strings.Contains(err.Error(), "404") {
			t.Errorf("error %v, want one naming the 404", err)
		}
	})
}

func TestEngineKinds(t *testing.T) {
	type caps struct{ sequential, paired, aborter bool }
	for kind, want := range map[string]caps{
		KindVLLM: {sequential: true}, KindVLLMLegacy: {sequential: true}, KindSim: {sequential: true, aborter: true},
		KindSGLang: {paired: true, aborter: true}, "": {sequential: true},
	} {
		e, ok := Lookup(kind)
		if !ok {
			t.Fatalf("Lookup(%q) found no engine", kind)
		}
		_, seq := e.(Sequential)
		_, paired := e.(Paired)
		_, aborter := e.(Aborter)
		if got := (caps{seq, paired, aborter}); got != want {
			t.Errorf("Lookup(%q) has capabilities %+v, want %+v", kind, got, want)
		}
	}
	if _, ok := Lookup("tgi"); ok {
		t.Error("Lookup(\"tgi\") found an engine")
	}
}

func TestPrefillParamsOutliveTheNextCall(t *testing.T) {
	// Answers are read into pooled buffers: params handed out must not share them.
	var n int
	var mu sync.Mutex
	srv, client, _ := fakeEngine(t, func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		n++
		i := n
		mu.Unlock()
		io.WriteString(w, `{"kv_transfer_params":{"remote_request_id":"req-`+strings.Repeat(string(rune('a'+i)), 40)+`"}}`)
	})
	call := Call{Client: client, BaseURL: srv.URL, Path: "/v1/completions", ID: "x"}
	first, err := call.Prefill(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	want := string(first)
	for range 20 {
		if _, err := call.Prefill(testCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	if string(first) != want {
		t.Fatalf("the first params changed after later calls: %s, was %s", first, want)
	}
}

func TestStatusErrorMessageKeepsTheBackendsBodyOut(t *testing.T) {
	// Error messages reach log lines; an engine's error text may quote the prompt.
	err := &StatusError{Status: 400, Body: []byte(`{"error":{"message":"prompt 'my secret prompt' is too long"}}`)}
	if strings.Contains(err.Error(), "secret") {
		t.Fatalf("message carries the body: %q", err.Error())
	}
	if !strings.Contains(err.Error(), "400") {
		t.Fatalf("message lacks the status: %q", err.Error())
	}
}
