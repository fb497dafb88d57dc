package pdflow

import (
	"github.com/pdproxy/pdproxy/router"
	"go.opentelemetry.io/otel/trace"
)

// tries is what a request's attempts leave to the next.
type tries struct {
	// avoid are the engines a later attempt does not go to: decoders a stream left, engines
	// that failed a pair, each until it returns to service (avoided).
	avoid []avoided
	// prefill and decode count the fresh pairs tried after a failure of that role.
	prefill, decode int
	// N counts the attempts begun; span is the one under way's trace span (nil when tracing
	// is off), the parent of its calls' spans.
	N    int
	span trace.Span
	// taken is what the request's attempts took on the engines, for the safety net of a panic.
	taken taken
}

// taken records what a request took on the engines, so that the safety net of a panic
// (failTaken) finds it wherever in the flow the panic came: every lease it was given and every
// hold it handed to a decode. Only the handler's goroutine appends; the tries bound both. A
// request's usual few (a prefiller's lease and a decoder's, one decode) fit in the exchange
// itself: recording them allocates nothing.
type taken struct {
	leases     []*router.Lease
	handoffs   []*handoff
	leaseBuf   [2]*router.Lease
	handoffBuf [1]*handoff
}

// lease records l.
func (t *taken) lease(l *router.Lease) {
	if t.leases == nil {
		t.leases = t.leaseBuf[:0]
	}
	t.leases = append(t.leases, l)
}

// handoff records h.
func (t *taken) handoff(h *handoff) {
	if t.handoffs == nil {
		t.handoffs = t.handoffBuf[:0]
	}
	t.handoffs = append(t.handoffs, h)
}

// avoided is an engine a request's attempt failed on, as it was then: the request keeps away
// from it until it has returned to service (its epoch moved: its checks saw it down and up
// again, or its probation after an ejection ended), as a restarted engine is a new one.
type avoided struct {
	b     *router.Backend
	epoch uint64
}

func avoidOf(b *router.Backend) avoided { return avoided{b: b, epoch: b.Epoch()} }

// still reports whether the engine is still the one that failed.
func (a avoided) still() bool { return a.b.Epoch() == a.epoch }

// avoids reports whether the request still keeps away from b.
func (t *tries) avoids(b *router.Backend) bool {
	for _, a := range t.avoid {
		if a.b == b && a.still() {
			return true
		}
	}
	return false
}

// avoided appends to names the engines the request still keeps away from.
func (t *tries) avoided(names []string) []string {
	for _, a := range t.avoid {
		if a.still() {
			names = append(names, a.b.Name)
		}
	}
	return names
}
