package pdflow

import (
	"sync/atomic"

	"go.opentelemetry.io/otel/trace"

	"github.com/pdproxy/pdproxy/router"
)

// custody is what a request holds while the proxy serves it: its entry in the table, the
// lease on the decoder reserved for it, and, once a decode its decoder never acknowledged has
// returned, the KV hold that decode carried. It has one owner at a time, and moves as a value:
// the exchange's flow passes it from step to step, and a step that fails ends it or gives it
// on (to a release, to the legs' abort, to a prefill let finish after the client left), so
// that a step returning an error owns nothing any more. The last owner ends it exactly once,
// with end or by running a release.
type custody struct {
	id       string // the request's key in the table
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
	// passed records that the custody left the exchange (given on, or ended): the safety net
	// for a panic then leaves it to its owner. Written by whichever goroutine owns it.
	passed atomic.Bool
	// ofAttempt marks what one failed attempt held, split off the request's custody (split):
	// ending it ends the attempt's lease and hold, not the request, which goes on.
	ofAttempt bool
}

// pass gives the custody on: the caller owns it no more.
func (c *custody) pass() *custody {
	c.passed.Store(true)
	return c
}

// giveBackLease ends the decoder's lease, if the custody still has one.
func (c *custody) giveBackLease(res router.Result) {
	if c.lease != nil {
		c.lease.Release(res)
		c.lease = nil
	}
}

// takeLease takes the decoder's lease out of the custody, for a call that gives it back
// itself (a drain on the decoder reserved for the request); nil when there is none.
func (c *custody) takeLease() *router.Lease {
	l := c.lease
	c.lease = nil
	return l
}

// split takes out of the request's custody what its attempt under way holds, to be released as
// that attempt's: the decoder's lease (given back with res) and a hold no decoder acknowledged.
// The request keeps its table entry and starts its next attempt with nothing held.
func (c *custody) split(res router.Result) *custody {
	a := &custody{id: c.id, engineID: c.engineID, lease: c.lease, res: res, unsent: c.unsent, span: c.span, ofAttempt: true}
	c.lease, c.unsent = nil, nil
	return a
}
