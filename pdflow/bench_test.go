package pdflow

import (
	"context"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// BenchmarkRelay is relaying one decode answer of 16 SSE chunks to the client, each read from
// the decoder written and flushed on its own, with the watchdog and the lifecycle table as a
// request uses them.
func BenchmarkRelay(b *testing.B) {
	s := New(Config{}, noBackends{}, lifecycle.New(lifecycle.Config{}, zap.NewNop(), prometheus.NewRegistry()), zap.NewNop(),
		NewMetrics(prometheus.NewRegistry()), false)
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
		x := &Exchange{s: s, W: w, R: r, Ctx: ctx, Cancel: cancel, ID: "bench", Route: "/v1/completions", Req: &api.Request{Stream: true}}
		x.Times.Start = time.Now()
		if err := s.table.Begin(x.ID, x.Route, func() { cancel(nil) }); err != nil {
			b.Fatal(err)
		}
		wd := newWatchdog(ctx, false, false, time.Minute, time.Minute)
		resp := &http.Response{StatusCode: http.StatusOK, Header: backendHeader, Body: &chunkReader{chunks: chunks}}
		if _, e := x.relay(custody{id: x.ID}, resp, wd); e != nil {
			b.Fatal(e)
		}
		wd.stop()
		s.table.End(x.ID)
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

func (w *flushWriter) Header() http.Header { return w.header }

func (w *flushWriter) WriteHeader(int) {}

func (w *flushWriter) Write(p []byte) (int, error) { w.written += int64(len(p)); return len(p), nil }

func (w *flushWriter) FlushError() error { return nil }

func (w *flushWriter) SetWriteDeadline(time.Time) error { return nil }
