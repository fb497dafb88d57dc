package pdflow

import (
	"go.opentelemetry.io/otel/trace"

	"github.com/pdproxy/pdproxy/router"
)

// custody is what a request holds while the proxy serves it: its entry in the table, the
// lease on the decoder reserved for it, and, once a decode its decoder never acknowledged has
// returned, the KV hold that decode carried. It is a value, and moves as one, with one rule
// the signatures state:
//
//   - a step that may end it returns it: c, e = x.step(c). When the step ended it (the
//     request failed, its client left, it went to a release), what comes back is the zero
//     custody, which holds nothing and whose end does nothing;
//   - a step that always ends it takes it and returns none: x.gone(c), x.failWith(c, …),
//     s.startRelease(mode, c, …), c.end(s).
//
// A step changes only its own copy, so no step clears what its caller holds. The last owner
// ends it exactly once, with end or by running a release.
type custody struct {
	id       string // the request's key in the table; "" for the zero custody
	engineID string // what the engines know it by
	// lease is the decoder reserved for the request; nil before that, and once given back.
	lease *router.Lease
	// res is what the lease is given back with: the decode's outcome, for passive health.
	res router.Result
	// unsent is a hold a decode handed over that no decoder acknowledged; nil else. Ending
	// the custody releases it.
	unsent *unsentHold
	// span is the request's trace span, the parent of its releases' and aborts' spans.
	span trace.SpanContext
	// ofAttempt marks what one failed attempt held, split off the request's custody (split):
	// ending it ends the attempt's lease and hold, not the request, which goes on.
	ofAttempt bool
}

// held reports whether c is a custody at all, not the zero one a step that ended it returns.
func (c custody) held() bool { return c.id != "" }

// withoutLease is c with the decoder's lease, if it had one, given back with res.
func (c custody) withoutLease(res router.Result) custody {
	if c.lease != nil {
		c.lease.Release(res)
		c.lease = nil
	}
	return c
}

// split parts the request's custody from what its attempt under way holds, to be released as
// that attempt's: the decoder's lease (given back with res) and a hold no decoder acknowledged.
// The request keeps its table entry and starts its next attempt with nothing held.
func (c custody) split(res router.Result) (request, attempt custody) {
	attempt = c
	attempt.res, attempt.ofAttempt = res, true
	c.lease, c.unsent = nil, nil
	return c, attempt
}
