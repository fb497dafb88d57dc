package pdflow

import (
	"errors"
	"sync/atomic"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
)

// heldKV is a KV hold (which names its blocks, and since when they are held) with what its
// release needs besides: the request whose blocks they are, and the prefiller that holds them
// (nil when unknown: then only its timer frees them).
type heldKV struct {
	hold    *lifecycle.Hold
	req     *api.Request
	prefill *router.Backend
}

// unsentHold is a hold a decode handed over that no decoder acknowledged, with what its
// release may do.
type unsentHold struct {
	heldKV
	// avoid names a decoder that could not be reached with the hold: a drain goes elsewhere.
	avoid string
	// taken: the decode went out whole and its decoder neither acknowledged nor refused it, so
	// it may have read the params (a decoder that reads a request and then closes, or a
	// timeout while it pulls). No decoder may get them again: only the prefiller's explicit
	// abort, or its own lease, frees the blocks.
	taken bool
}

// handoff is a hold on its way to a decoder with the decode. It is open until the decoder
// acknowledges the decode ("100 Continue", which its server sends as the handler begins to
// read the body, or its answer's headers): the hold is then the decoder's, which pulls the
// blocks or tells the prefiller when it aborts or refuses the request. Or the proxy withdraws
// it first, when the decode returned without an acknowledgement: the hold is then the proxy's
// to release. A written request is no proof of delivery: a server still finishing the previous
// response on a reused connection drops a request whose connection closes before it reads it.
// So a decode cut short before it was acknowledged leaves the release to the proxy; one
// acknowledged is never sent to a second decoder, even when the answer, which for a whole
// JSON answer comes only at its end, never does. A client that leaves while the decode is on
// its way does not cut it before the acknowledgement (see watchdog): the decoder may have read
// it already. The acknowledgement arrives on the transport's goroutine, hence an atomic.
type handoff struct {
	state atomic.Int32
	held  unsentHold
}

const (
	handoffOpen int32 = iota
	handoffAcked
	handoffWithdrawn
)

// ack records the decoder's acknowledgement: the hold is the decoder's.
func (h *handoff) ack() {
	if h != nil && h.state.CompareAndSwap(handoffOpen, handoffAcked) {
		h.held.hold.Release(lifecycle.ReleaseDecoded)
	}
}

// withdraw ends a handoff the decoder d did not acknowledge, once the decode returned with
// err (nil: it was never sent): the hold, for the custody, with what its release may do. It is
// nil when the decoder acknowledged: the hold is the decoder's.
func (h *handoff) withdraw(err error, d *router.Backend) *unsentHold {
	if h == nil || !h.state.CompareAndSwap(handoffOpen, handoffWithdrawn) {
		return nil
	}
	u := h.held
	var se *engine.StatusError
	var ce *engine.CallError
	switch {
	case err == nil, errors.As(err, &se):
		// Never sent, or refused by a decoder that answered without reading it: alive, and
		// free to take the drain.
	case errors.As(err, &ce) && ce.Unprocessed:
		if ce.Connect {
			u.avoid = d.Name
		}
	default:
		u.taken = true
	}
	return &u
}

// abandon ends a handoff whose request failed with a panic: a hold no decoder acknowledged and
// no release took on (lifecycle.Hold.Claim) ends as expired, its blocks left to the
// prefiller's timer. One a release took on is the release's.
func (h *handoff) abandon() {
	open := h.state.CompareAndSwap(handoffOpen, handoffWithdrawn)
	if (open || h.state.Load() == handoffWithdrawn) && h.held.hold.Claim() {
		h.held.hold.Release(lifecycle.ReleaseExpired)
	}
}

// refused reports whether a decoder refused, with err, a decode it had acknowledged.
func (h *handoff) refused(err error) bool {
	var se *engine.StatusError
	return h != nil && h.state.Load() == handoffAcked && errors.As(err, &se)
}

// refusedAfterHandoff handles a decoder that refused a decode it had acknowledged, with its
// params: its engine tells the prefiller where RejectionFreesKV says so (vLLM #41269). Where
// not, the hold, which went to the decoder, is freed by the prefiller's explicit abort, or
// its lease: it may never go to a second decoder.
func (s *Flow) refusedAfterHandoff(parent trace.SpanContext, engineID string, p, d *router.Backend, err error) {
	var se *engine.StatusError
	errors.As(err, &se)
	status := se.Status
	if engineOf(d).RejectionFreesKV(status) || p == nil {
		return
	}
	if canAbort(p) {
		s.abortOnEngine(parent, engineID, p)
		return
	}
	s.logger.Warn("a decoder refused a decode it had the kv params of, and its engine does not tell the prefiller: the blocks stay held until the prefiller's lease ends",
		zap.String("engine_request_id", engineID), zap.String("decoder", d.Name), zap.Int("status", status))
}

// held is hold as the request's legs name it.
func (x *Exchange) held(hold *lifecycle.Hold) heldKV {
	return heldKV{hold: hold, req: x.Req, prefill: x.Legs.Prefill}
}

// handOver starts the handoff of hold (nil: the decode carries none, and so is the handoff).
func (x *Exchange) handOver(hold *lifecycle.Hold) *handoff {
	if hold == nil {
		return nil
	}
	h := &handoff{held: unsentHold{heldKV: x.held(hold)}}
	x.Tries.taken.handoff(h)
	return h
}
