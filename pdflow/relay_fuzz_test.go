package pdflow

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
)

// chopReader hands out data in the read sizes cuts gives (each byte one read of 1 to 256
// bytes, cycled), then ends with end. A cut byte above 0xf0 returns the last piece together
// with end, as a connection's reader may.
type chopReader struct {
	data []byte
	cuts []byte
	i    int
	end  error
}

func (r *chopReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, r.end
	}
	n := len(r.data)
	var early bool
	if len(r.cuts) > 0 {
		c := r.cuts[r.i%len(r.cuts)]
		r.i++
		n = min(n, int(c)+1)
		early = c > 0xf0
	}
	n = copy(p, r.data[:n])
	r.data = r.data[n:]
	if len(r.data) == 0 && early {
		return n, r.end
	}
	return n, nil
}

var errDecoderCut = errors.New("decoder connection cut")

// FuzzRelay feeds the SSE relay arbitrary decoder bytes, cut into arbitrary reads. It must
// never panic and must pass every byte to the client unchanged, in order. When the decoder
// breaks mid-answer, a stream ends with an error event in the OpenAI shape that a client's
// SSE parser reads as an event of its own, whatever partial line the decoder left; a
// non-streaming answer is left truncated for the handler to cut the connection. An answer
// that ends cleanly is broken all the same when it is empty, or a stream whose last event is
// not its [DONE] (api.EndWatch, tested on its own in package api); a stream whose last event
// is its [DONE] is whole, however its connection ends.
func FuzzRelay(f *testing.F) {
	for _, seed := range []struct {
		data   string
		cuts   []byte
		stream bool
		broken bool
	}{
		{"data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n", nil, true, false},
		{"data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n", []byte{3, 0, 200}, true, true},
		{"data: {\"choices\":[{\"text\":\"h", []byte{5}, true, true},
		{"data: {\"a\":1}\r\n\r\ndata: {\"a\":2}\r\n", []byte{0xff}, true, true},
		{"data: x\r", nil, true, true},
		{"data: x\n", nil, true, true},
		{"event: ping\n: comment\n\nretry: 10\nid: 7\ndata: {}\n\n", []byte{1, 2}, true, false},
		{"not sse at all", []byte{0xf8}, true, false},
		{"\x00\xff\xfe garbage \n\n\n\r\r", []byte{0}, true, true},
		{"", nil, true, true},
		{"", nil, false, false},
		{`{"id":"cmpl-d","choices":[{"text":"Hello"}]}`, []byte{9}, false, false},
		{`{"id":"cmpl-d","choi`, nil, false, true},
		{string(bytes.Repeat([]byte("x"), 100<<10)), []byte{0xff, 0x10}, true, true},
	} {
		f.Add([]byte(seed.data), seed.cuts, seed.stream, seed.broken)
	}
	reg := prometheus.NewRegistry()
	table := lifecycle.New(lifecycle.Config{}, zap.NewNop(), reg)
	srv, err := New(Config{}, noBackends{}, table, zap.NewNop(), NewMetrics(reg), false), error(nil)
	if err != nil {
		f.Fatal(err)
	}
	var n atomic.Int64
	f.Fuzz(func(t *testing.T, data, cuts []byte, stream, broken bool) {
		id := "fuzz-" + strconv.FormatInt(n.Add(1), 10)
		if err := table.Begin(id, "/v1/completions", func() {}); err != nil {
			t.Fatal(err)
		}
		defer table.End(id)
		if _, _, ok := table.StartDecode(id, "d0"); !ok {
			t.Fatal("StartDecode refused")
		}
		ctx, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		rec := httptest.NewRecorder()
		x := &Exchange{s: srv, W: rec, Ctx: ctx, Cancel: cancel, ID: id, Route: "/v1/completions", Req: &api.Request{Stream: stream}}
		x.Times.Start = time.Now()
		wd := newWatchdog(ctx, false, false, time.Hour, time.Hour)
		defer wd.stop()
		end := io.EOF
		if broken {
			end = errDecoderCut
		}
		in := append([]byte(nil), data...)
		ends := api.EndWatch{API: engine.APICompletions}
		ends.Note(data)
		switch {
		case !broken && (len(data) == 0 || stream && !ends.Complete()):
			broken = true
		case broken && stream && ends.Complete():
			// The stream's end went out: the client has the whole answer, and whatever the
			// decoder does after it is for nobody.
			broken = false
		}
		resp := &http.Response{StatusCode: http.StatusOK, Header: http.Header{}, Body: io.NopCloser(&chopReader{data: in, cuts: cuts, end: end})}
		_, e := x.relay(custody{id: id}, resp, wd)
		got := rec.Body.Bytes()

		if !broken {
			if e != nil {
				t.Fatalf("a complete answer ended in error %v", e)
			}
			if rec.Code != http.StatusOK || !bytes.Equal(got, data) {
				t.Fatalf("status %d, relayed %s, want 200 and %s", rec.Code, testutil.Clip(got), testutil.Clip(data))
			}
			return
		}
		if e == nil || e.Status != http.StatusBadGateway {
			t.Fatalf("a broken answer ended with %v, want a 502", e)
		}
		if len(data) == 0 {
			// Nothing went out: the handler answers with the error itself.
			if x.Out.Wrote || len(got) != 0 {
				t.Fatalf("wrote %s before any byte came from the decoder", testutil.Clip(got))
			}
			return
		}
		if !bytes.HasPrefix(got, data) {
			t.Fatalf("relayed %s, which does not start with the decoder's bytes %s", testutil.Clip(got), testutil.Clip(data))
		}
		if !stream {
			if !x.Out.AbortConn || len(got) != len(data) {
				t.Fatalf("a broken non-streaming answer: abortConn %v, relayed %s; want the connection cut after %s", x.Out.AbortConn, testutil.Clip(got), testutil.Clip(data))
			}
			return
		}
		events := testutil.SSEDispatched(got)
		if len(events) == 0 {
			t.Fatalf("no event dispatched from %s", testutil.Clip(got))
		}
		var body api.ErrorBody
		last := events[len(events)-1]
		if err := json.Unmarshal([]byte(last), &body); err != nil || body.Error.Type == "" || body.Error.Message == "" {
			t.Fatalf("last event %s is not an OpenAI error (%v); stream %s", testutil.Clip([]byte(last)), err, testutil.Clip(got))
		}
		if !bytes.HasSuffix(got, []byte("\n\n")) {
			t.Fatalf("stream %s does not end with a blank line", testutil.Clip(got))
		}
	})
}
