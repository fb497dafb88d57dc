package pdflow

import (
	"sync"
	"time"

	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
)

// recentAbortsKept is how many aborts the live view lists: enough to read a burst of
// give-ups, few enough that the state it polls twice a second stays small.
const recentAbortsKept = 50

// AbortRecord is one client that left, as the live view lists it (recent_aborts of
// GET /debug/ui/state).
type AbortRecord struct {
	// ID is the request's id: the client's X-Request-Id, or the one the proxy gave it.
	ID string `json:"id"`
	// EngineRequestID is the id the engines know the request by (engine_request_id in logs).
	EngineRequestID string `json:"engine_request_id"`
	// Route is the route the request came in on.
	Route string `json:"route"`
	// Stage is the state the request was in when its client left: the stage label of
	// pdproxy_aborts_total and pdproxy_abort_propagation_seconds.
	Stage lifecycle.State `json:"stage"`
	// Action is what the proxy did about it: none (nothing was sent yet), cancel_prefill,
	// release_kv or cancel_decode.
	Action lifecycle.Action `json:"action"`
	// Prefill and Decode name the engines the request had reached; absent when none.
	Prefill string `json:"prefill,omitempty"`
	Decode  string `json:"decode,omitempty"`
	// At is when the proxy saw the client gone.
	At time.Time `json:"at"`
	// PropagationSeconds is the time from then to the backend call cancelled or the KV
	// release sent: what pdproxy_abort_propagation_seconds observes for this abort.
	PropagationSeconds float64 `json:"propagation_seconds"`
}

// abortRing keeps the last aborts, newest last, in a fixed buffer: recording one never
// allocates past the first lap, and never blocks a request for longer than a copy.
type abortRing struct {
	mu   sync.Mutex
	buf  []AbortRecord
	next int  // where the next record goes
	full bool // buf has wrapped: every slot holds a record
}

func newAbortRing(n int) *abortRing { return &abortRing{buf: make([]AbortRecord, n)} }

// add records a, unless it is no abort: ClientGone answers a terminal stage for a request
// that had already ended (a late event), and nothing was aborted then.
func (r *abortRing) add(a AbortRecord) {
	if a.Stage.Terminal() {
		return
	}
	r.mu.Lock()
	r.buf[r.next] = a
	r.next = (r.next + 1) % len(r.buf)
	r.full = r.full || r.next == 0
	r.mu.Unlock()
}

// list returns the records kept, newest first; never nil, so that it is [] in JSON.
func (r *abortRing) list() []AbortRecord {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.next
	if r.full {
		n = len(r.buf)
	}
	out := make([]AbortRecord, 0, n)
	for i := 1; i <= n; i++ {
		out = append(out, r.buf[(r.next-i+len(r.buf))%len(r.buf)])
	}
	return out
}

func backendName(b *router.Backend) string {
	if b == nil {
		return ""
	}
	return b.Name
}
