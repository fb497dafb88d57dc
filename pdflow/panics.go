package pdflow

import (
	"errors"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
)

// ErrPanic is what a client is told when serving its request panicked.
var ErrPanic = api.NewError(api.KindPanicked, "the proxy failed while serving this request; it was aborted on its engines")

// recoverRequest is the safety net of a request in flight: a panic while serving it still
// finishes it. It is failed with what it took (failTaken), counted in pdproxy_panics_total,
// logged with its id, and its client is told (a 502 when nothing was sent yet; an error event
// in a stream; a cut connection for a JSON answer under way). The panic never reaches
// net/http, which would drop the connection and leave the request uncounted.
func (x *Exchange) recoverRequest(e **api.Error) {
	v := recover()
	if v == nil {
		return
	}
	x.s.m.Panics.Inc()
	x.s.logger.Error("panic serving a request", zap.String("request_id", x.ID), zap.String("engine_request_id", x.EngineID),
		zap.Any("panic", v), zap.StackSkip("stack", 1))
	func() {
		defer func() {
			if v := recover(); v != nil {
				x.s.m.Panics.Inc()
				x.s.logger.Error("panic failing a request after a panic: its table entry ends as it is", zap.String("request_id", x.ID), zap.Any("panic", v))
			}
		}()
		x.failTaken()
	}()
	*e = x.cut(ErrPanic)
}

// failTaken fails a request after a panic. The panic may have come anywhere in the flow, with
// the request's custody in any step's hands, so only steps that count once whoever takes them
// first are taken: what the table still holds for the request goes as a failed request's does
// (fail: a hold it still has released, paired legs aborted); every lease the request took is
// given back (a drain already under way on the decoder reserved for the request then runs
// outside its lease); every hold it handed to a decode that no decoder acknowledged and no release
// took on (lifecycle.Hold.Claim) ends as expired, its blocks left to the prefiller's timer;
// and the entry ends. A hold a release took on is left to it: a panic after the request went
// to a release ends its entry early, and the release still ends its hold as it would have.
func (x *Exchange) failTaken() {
	x.fail(custody{id: x.ID, engineID: x.EngineID, span: x.traceParent()}, router.Result{})
	for _, l := range x.Tries.taken.leases {
		l.Release(router.Result{})
	}
	for _, ho := range x.Tries.taken.handoffs {
		ho.abandon()
	}
}

// recoverBackground is the safety net of the work that outlives a request's handler (a KV
// release, the abort of paired legs, a prefill let finish after its client left): a panic
// there would take the whole proxy down with every request in it. It is counted in
// pdproxy_panics_total and logged, and what the work held ends, each step counting once
// whoever takes it first: the hold as expired (its blocks left to the prefiller's timer), the
// decoder's lease, and the request's table entry (an attempt's custody leaves the entry).
func (s *Flow) recoverBackground(c custody, hold *lifecycle.Hold) {
	v := recover()
	if v == nil {
		return
	}
	s.m.Panics.Inc()
	s.logger.Error("panic in a request's background work: its hold ends as expired", zap.String("request_id", c.id),
		zap.String("engine_request_id", c.engineID), zap.Any("panic", v), zap.StackSkip("stack", 1))
	defer func() {
		if v := recover(); v != nil {
			s.m.Panics.Inc()
			s.logger.Error("panic ending a request's background work after a panic", zap.String("request_id", c.id), zap.Any("panic", v))
		}
	}()
	hold.Release(lifecycle.ReleaseExpired)
	c = c.withoutLease(router.Result{Canceled: true})
	if !c.ofAttempt {
		s.table.End(c.id)
	}
}

// BuildFailed is the answer to a request whose engine body could not be built.
func BuildFailed(err error, what string) *api.Error {
	if errors.Is(err, errEnginePanic) {
		return ErrPanic
	}
	return api.NewError(api.KindInternal, "could not build the "+what+" request").With("", err, 0)
}
