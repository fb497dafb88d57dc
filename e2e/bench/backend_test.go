package bench

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Headers the fast backend reads from a request (the proxy passes them on) to behave slowly.
const (
	// hdrInterval makes a stream send one chunk per interval until the client leaves (or
	// slowStreamLimit passes), instead of 16 chunks at once.
	hdrInterval = "X-Bench-Interval"
	// hdrPrefillStall makes a prefill wait until the client leaves (or slowStreamLimit).
	hdrPrefillStall = "X-Bench-Prefill-Stall"
	// hdrChunks makes a fast stream write this many chunks instead of chunksPerStream.
	hdrChunks = "X-Bench-Chunks"
	// chunksPerStream is how many SSE chunks a fast stream writes, each flushed on its own.
	chunksPerStream = 16
	// slowStreamLimit bounds a slow stream or a stalled prefill, so that a harness that lost
	// track of a client still ends.
	slowStreamLimit = 5 * time.Minute
)

var (
	doneEvent = []byte("data: [DONE]\n\n")
	// tokenEvent is a vLLM-shaped completion chunk of one token (about 190 bytes).
	tokenEvent = []byte(`data: {"id":"cmpl-bench-0","object":"text_completion","created":1700000000,"model":"bench",` +
		`"choices":[{"index":0,"text":" tok1234","logprobs":null,"finish_reason":null,"stop_reason":null}]}` + "\n\n")
	// lastEvent is the 16th write: the last token and the end of the stream.
	lastEvent = append(append([]byte(nil), tokenEvent...), doneEvent...)
	// prefillAnswer is a vLLM prefiller's answer: one token and the params of the KV it holds.
	prefillAnswer = []byte(`{"id":"cmpl-bench-0","object":"text_completion","created":1700000000,"model":"bench",` +
		`"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":null}],` +
		`"usage":{"prompt_tokens":12,"total_tokens":13,"completion_tokens":1,"prompt_tokens_details":null},` +
		`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4],` +
		`"remote_engine_id":"bench-prefill-0","remote_request_id":"cmpl-bench-0","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}`)
	wholeAnswer = []byte(`{"id":"cmpl-bench-0","object":"text_completion","created":1700000000,"model":"bench",` +
		`"choices":[{"index":0,"text":" tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok","logprobs":null,"finish_reason":"length","stop_reason":null}],` +
		`"usage":{"prompt_tokens":12,"total_tokens":28,"completion_tokens":16}}`)
	healthAnswer = []byte(`{"status":"ok"}`)
)

// backend is the fastest backend that still speaks the protocol: a prefill (a body with
// do_remote_decode true) gets kv_transfer_params at once; a stream gets 16 chunks, each
// written and flushed on its own; nothing is computed. It watches chosen requests (by
// X-Request-Id) for the moment it sees their connection closed.
type backend struct {
	srv    *httptest.Server
	active atomic.Int64 // completion requests being served

	mu     sync.Mutex
	probes map[string]*probe
}

// probe follows one request through the backend.
type probe struct {
	started chan struct{}  // closed once the backend is stalling or streaming it
	closed  chan time.Time // when the backend saw the request's context done
}

func startBackend(t testing.TB) *backend {
	b := &backend{probes: map[string]*probe{}}
	b.srv = httptest.NewUnstartedServer(b)
	b.srv.Config.ReadHeaderTimeout = 10 * time.Second
	b.srv.Start()
	t.Cleanup(func() {
		b.srv.CloseClientConnections()
		b.srv.Close()
	})
	return b
}

func (b *backend) URL() string { return b.srv.URL }

// watch starts following the request with this id; its probe reports when the backend
// starts it and when it sees its connection closed.
func (b *backend) watch(id string) *probe {
	p := &probe{started: make(chan struct{}), closed: make(chan time.Time, 1)}
	b.mu.Lock()
	b.probes[id] = p
	b.mu.Unlock()
	return p
}

func (b *backend) unwatch(id string) {
	b.mu.Lock()
	delete(b.probes, id)
	b.mu.Unlock()
}

func (b *backend) probe(r *http.Request) *probe {
	// Through the proxy the engine id is the proxy's own; the client's id comes beside it.
	id := r.Header.Get("X-Client-Request-Id")
	if id == "" {
		id = r.Header.Get("X-Request-Id")
	}
	if id == "" {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.probes[id]
}

var bodyPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

func (b *backend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/health":
		w.Header().Set("Content-Type", "application/json")
		w.Write(healthAnswer)
		return
	case "/v1/completions", "/v1/chat/completions":
	default:
		http.NotFound(w, r)
		return
	}
	b.active.Add(1)
	defer b.active.Add(-1)
	buf := bodyPool.Get().(*bytes.Buffer)
	buf.Reset()
	defer bodyPool.Put(buf)
	if _, err := io.Copy(buf, r.Body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	body := buf.Bytes()
	switch {
	case bytes.Contains(body, []byte(`"do_remote_decode":true`)):
		b.prefill(w, r)
	case bytes.Contains(body, []byte(`"stream":true`)):
		b.stream(w, r)
	default:
		w.Header().Set("Content-Type", "application/json")
		w.Write(wholeAnswer)
	}
}

func (b *backend) prefill(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get(hdrPrefillStall) != "" {
		p := b.probe(r)
		if p != nil {
			close(p.started)
		}
		select {
		case <-r.Context().Done():
			if p != nil {
				p.closed <- time.Now()
			}
			return
		case <-time.After(slowStreamLimit):
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(prefillAnswer)))
	w.Write(prefillAnswer)
}

func (b *backend) stream(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(w)
	interval, _ := time.ParseDuration(r.Header.Get(hdrInterval))
	if interval <= 0 {
		n := chunksPerStream
		if v, err := strconv.Atoi(r.Header.Get(hdrChunks)); err == nil && v > 0 {
			n = v
		}
		for i := 1; i < n; i++ {
			w.Write(tokenEvent)
			if rc.Flush() != nil {
				return
			}
		}
		w.Write(lastEvent)
		return
	}
	p := b.probe(r)
	// The backend sees the connection closed either way: its context ends, or (when a chunk
	// was due first) a write fails.
	sawClose := func() {
		if p != nil {
			p.closed <- time.Now()
		}
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	limit := time.NewTimer(slowStreamLimit)
	defer limit.Stop()
	for i := 0; ; i++ {
		if _, err := w.Write(tokenEvent); err != nil {
			sawClose()
			return
		}
		if rc.Flush() != nil {
			sawClose()
			return
		}
		if i == 0 && p != nil {
			close(p.started)
		}
		select {
		case <-r.Context().Done():
			sawClose()
			return
		case <-limit.C:
			w.Write(doneEvent)
			return
		case <-tick.C:
		}
	}
}

// streamBody is a client's streaming completion request, compact as SDKs send it.
func streamBody(id int) []byte {
	return []byte(fmt.Sprintf(`{"model":"bench","prompt":"The quick brown fox jumps over the lazy dog, request %d.",`+
		`"max_tokens":16,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}`, id))
}

// completeStream reports whether a stream's body ended as a whole stream does.
func completeStream(body []byte) bool { return bytes.HasSuffix(body, doneEvent) }
