package pdflow

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// reads hands out its parts one read each, then io.EOF.
type reads struct{ parts []string }

func (r *reads) Read(p []byte) (int, error) {
	for len(r.parts) > 0 && r.parts[0] == "" {
		r.parts = r.parts[1:]
	}
	if len(r.parts) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.parts[0])
	r.parts[0] = r.parts[0][n:]
	return n, nil
}

// A Responses stream is complete only at an SSE event line that names its end, wherever the
// decoder's reads split it: the same words inside a data line (generated text, JSON-escaped)
// or on a line that names another event leave the stream unfinished.
func TestResponsesStreamEndsOnlyAtItsEndEventLine(t *testing.T) {
	const created = "event: response.created\ndata: {\"type\":\"response.created\"}\n\n"
	tests := []struct {
		name, stream string
		complete     bool
	}{
		{"response.completed after other events", created +
			"event: response.completed\ndata: {\"type\":\"response.completed\"}\n\n", true},
		{"response.incomplete, no space after the colon, CRLF line ends", strings.ReplaceAll(created, "\n", "\r\n") +
			"event:response.incomplete\r\ndata: {\"type\":\"response.incomplete\"}\r\n\r\n", true},
		{"response.failed after a line that ends in a lone CR", "data: {}\r\r" +
			"event: response.failed\ndata: {\"type\":\"response.failed\"}\n\n", true},
		{"the end event as the stream's first line", "event: response.completed\ndata: {}\n\n", true},
		{"the end's words in a delta's text", created +
			"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"\\nevent: response.completed\\n\"}\n\n", false},
		{"the end's words in a data line", created + "data: event: response.completed\n\n", false},
		{"the end's words in a comment", created + ": event: response.completed\n\n", false},
		{"an event whose name only begins with the end's", created + "event: response.completed_soon\ndata: {}\n\n", false},
		{"an event whose name has a second space before it", created + "event:  response.completed\ndata: {}\n\n", false},
	}
	reg := prometheus.NewRegistry()
	table := lifecycle.New(lifecycle.Config{}, zap.NewNop(), reg)
	srv, err := New(Config{}, noBackends{}, table, zap.NewNop(), NewMetrics(reg), false), error(nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for cut := range len(tt.stream) + 1 {
				id := "resp-end"
				if err := table.Begin(id, "/v1/responses", func() {}); err != nil {
					t.Fatal(err)
				}
				if _, _, ok := table.StartDecode(id, "d0"); !ok {
					t.Fatal("StartDecode refused")
				}
				ctx, cancel := context.WithCancelCause(context.Background())
				rec := httptest.NewRecorder()
				x := &Exchange{s: srv, W: rec, Ctx: ctx, Cancel: cancel, ID: id, Route: "/v1/responses",
					Req: &api.Request{Stream: true, API: engine.APIResponses}}
				x.Times.Start = time.Now()
				wd := newWatchdog(ctx, false, false, time.Hour, time.Hour)
				resp := &http.Response{StatusCode: http.StatusOK, Header: http.Header{},
					Body: io.NopCloser(&reads{parts: []string{tt.stream[:cut], tt.stream[cut:]}})}
				_, e := x.relay(custody{id: id}, resp, wd)
				wd.stop()
				cancel(nil)
				table.End(id)
				if complete := e == nil; complete != tt.complete {
					t.Fatalf("reads split at %d: complete %v (%v), want %v; relayed %q", cut, complete, e, tt.complete, rec.Body.String())
				}
			}
		})
	}
}
