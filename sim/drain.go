package sim

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Draining follows vLLM's graceful shutdown (vllm serve --shutdown-timeout,
// vLLM 0.18 and later): on SIGTERM its API server's
// ServiceUnavailableMiddleware answers every path but /live and /metrics
// with a 503 {"error": "Server is unavailable. Please try again later."}
// (GET /health included, so a load balancer takes the server out), while
// the requests already in flight run on for up to the shutdown timeout;
// those still running then are aborted and the process exits. Its default
// timeout, 0, aborts them at once.
//
// The sim's /kv/* routes stand for NIXL's side channel, not the API
// server, and stay open: a draining prefiller's holds can still be read.

// errDrainCut ends the requests still running when a drain's grace ends.
var errDrainCut = errors.New("sim: drain grace period over")

// drainer is an engine's drain state, shared by its data parallel ranks:
// the generation requests in flight, each with the cancel that cuts it.
type drainer struct {
	mu       sync.Mutex
	draining bool
	next     uint64
	inflight map[uint64]context.CancelCauseFunc
	idle     chan struct{} // closed once draining and nothing is in flight
}

func newDrainer() *drainer {
	return &drainer{inflight: make(map[uint64]context.CancelCauseFunc)}
}

// enter admits a generation request, unless the engine drains: ctx is
// ctx cut when the grace ends, leave must be called once it has ended.
func (d *drainer) enter(parent context.Context) (ctx context.Context, leave func(), ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.draining {
		return nil, nil, false
	}
	ctx, cancel := context.WithCancelCause(parent)
	d.next++
	id := d.next
	d.inflight[id] = cancel
	return ctx, func() {
		cancel(nil)
		d.mu.Lock()
		defer d.mu.Unlock()
		delete(d.inflight, id)
		if d.draining && len(d.inflight) == 0 && d.idle != nil {
			close(d.idle)
			d.idle = nil
		}
	}, true
}

func (d *drainer) isDraining() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.draining
}

// Drain drains the engine as vLLM does on SIGTERM with --shutdown-timeout
// grace: from now on GET /health and every route but GET /live,
// GET /metrics and the /kv/* side channel answer 503, new generation
// requests included, while the requests in flight go on. Those still
// running when grace ends are cut as a process exit cuts them: their
// connections close, no [DONE], no error event. Drain returns once none is
// left; the engine keeps refusing until it is stopped. A second Drain only
// waits.
func (e *Engine) Drain(grace time.Duration) {
	d := e.drain
	d.mu.Lock()
	d.draining = true
	idle := d.idle
	if idle == nil {
		idle = make(chan struct{})
		if len(d.inflight) == 0 {
			close(idle)
		} else {
			d.idle = idle
		}
	}
	d.mu.Unlock()
	timer := e.clock.NewTimer(grace)
	defer timer.Stop()
	select {
	case <-idle:
		return
	case <-timer.C():
	}
	d.mu.Lock()
	for _, cancel := range d.inflight {
		cancel(errDrainCut)
	}
	d.mu.Unlock()
	<-idle
}

// drainGate answers 503 in vLLM's shape on every route a draining vLLM
// refuses.
func (e *Engine) drainGate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if e.drain.isDraining() && r.URL.Path != "/live" && r.URL.Path != "/metrics" && !strings.HasPrefix(r.URL.Path, "/kv/") {
			writeUnavailable(w)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// writeUnavailable is vLLM's draining answer, which is not the OpenAI
// error shape: its middleware writes a bare message.
func writeUnavailable(w http.ResponseWriter) {
	writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "Server is unavailable. Please try again later."})
}

// cutIfDrained ends a handler whose request the drain's grace cut: its
// connection closes mid-answer, as the exiting process's would.
func cutIfDrained(ctx context.Context) {
	if errors.Is(context.Cause(ctx), errDrainCut) {
		panic(http.ErrAbortHandler)
	}
}
