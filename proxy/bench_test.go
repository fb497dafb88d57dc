package proxy

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
)

// Bodies as clients send them: a completion, and a chat with a system prompt and a few turns.
var (
	benchCompletion = []byte(`{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"The quick brown fox jumps over the lazy dog. ` +
		strings.Repeat("Tell me more about it. ", 8) + `","max_tokens":128,"temperature":0.7,"top_p":0.95,"stream":true,` +
		`"stream_options":{"include_usage":true},"seed":7}`)
	benchChat = []byte(`{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[` +
		`{"role":"system","content":"You are a helpful assistant. ` + strings.Repeat("Answer briefly and precisely. ", 10) + `"},` +
		`{"role":"user","content":"What is disaggregated prefill?"},` +
		`{"role":"assistant","content":"Prefill and decode run on different engines; the KV cache moves between them."},` +
		`{"role":"user","content":"Why does it help? \u00e9\u00e8 <b>bold</b> & more"}],` +
		`"max_completion_tokens":256,"temperature":0.2,"stream":true,"stream_options":{"include_usage":true},"tools":null}`)
	// benchKVParams is a prefiller's answer params, passed on to the decoder as they came.
	benchKVParams = json.RawMessage(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4,5,6,7,8],` +
		`"remote_engine_id":"a7c2e0f4-prefill-0","remote_request_id":"cmpl-0123456789abcdef","remote_host":"10.0.0.7","remote_port":5600,"tp_size":1}`)
)

// BenchmarkRewrite is the request work of one P/D request before any byte goes out: parse and
// validate the client's body, build the prefill body, build the decode body with the params.
func BenchmarkRewrite(b *testing.B) {
	for _, bc := range []struct {
		name string
		body []byte
		chat bool
	}{
		{"completion", benchCompletion, false},
		{"chat", benchChat, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bc.body)))
			for b.Loop() {
				parse := api.ParseCompletions
				if bc.chat {
					parse = api.ParseChat
				}
				req, e := parse(bc.body)
				if e != nil {
					b.Fatal(e)
				}
				if _, err := engine.PrefillBody(req.Fields, req.API); err != nil {
					b.Fatal(err)
				}
				if _, err := engine.DecodeBody(req.Fields, benchKVParams); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRelay is relaying one decode answer of 16 SSE chunks to the client, each read from
// the decoder written and flushed on its own, with the watchdog and the lifecycle table as a
// request uses them.
func BenchmarkRelay(b *testing.B) {
	// A router with one decoder that is never called: New asks it for its backends.
	rt, err := router.New(router.Config{Backends: []router.BackendConfig{{Name: "d0", URL: "http://127.0.0.1:9", Role: router.RoleDecode}},
		Engines: engineCatalog{}, Health: router.HealthConfig{Interval: -1}}, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	s, err := New(Config{}, rt, lifecycle.New(lifecycle.Config{}, zap.NewNop(), prometheus.NewRegistry()), zap.NewNop(), prometheus.NewRegistry(), nil)
	if err != nil {
		b.Fatal(err)
	}
	event := []byte(`data: {"id":"cmpl-bench-0","object":"text_completion","created":1700000000,"model":"bench",` +
		`"choices":[{"index":0,"text":" tok1234","logprobs":null,"finish_reason":null,"stop_reason":null}]}` + "\n\n")
	chunks := make([][]byte, 16)
	for i := range chunks {
		chunks[i] = event
	}
	chunks[15] = append(append([]byte(nil), event...), "data: [DONE]\n\n"...)
	w := &flushWriter{header: http.Header{}}
	backendHeader := http.Header{"Content-Type": {"text/event-stream"}}
	r := &http.Request{Header: http.Header{}}
	b.ReportAllocs()
	b.SetBytes(int64(16 * len(event)))
	for b.Loop() {
		clear(w.header)
		ctx, cancel := context.WithCancelCause(context.Background())
		x := &exchange{s: s, w: w, r: r, ctx: ctx, cancel: cancel, id: "bench", route: "/v1/completions", req: &api.Request{Stream: true}}
		x.times.start = time.Now()
		if err := s.table.Begin(x.id, x.route, func() { cancel(nil) }); err != nil {
			b.Fatal(err)
		}
		wd := newWatchdog(ctx, false, false, time.Minute, time.Minute)
		resp := &http.Response{StatusCode: http.StatusOK, Header: backendHeader, Body: &chunkReader{chunks: chunks}}
		if e := x.relay(&custody{id: x.id}, resp, wd); e != nil {
			b.Fatal(e)
		}
		wd.stop()
		s.table.End(x.id)
		cancel(nil)
	}
	if w.written != int64(b.N)*int64(16*len(event)+len("data: [DONE]\n\n")) {
		b.Fatalf("relayed %d bytes for %d answers", w.written, b.N)
	}
}

// chunkReader hands out one chunk per Read, as a decoder's stream arrives.
type chunkReader struct {
	chunks [][]byte
	i      int
}

func (c *chunkReader) Read(p []byte) (int, error) {
	if c.i == len(c.chunks) {
		return 0, io.EOF
	}
	n := copy(p, c.chunks[c.i])
	c.i++
	return n, nil
}

func (c *chunkReader) Close() error { return nil }

// flushWriter is a client connection that takes everything at once.
type flushWriter struct {
	header  http.Header
	written int64
}

func (w *flushWriter) Header() http.Header              { return w.header }
func (w *flushWriter) WriteHeader(int)                  {}
func (w *flushWriter) Write(p []byte) (int, error)      { w.written += int64(len(p)); return len(p), nil }
func (w *flushWriter) FlushError() error                { return nil }
func (w *flushWriter) SetWriteDeadline(time.Time) error { return nil }
